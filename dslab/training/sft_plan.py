"""The run `dslab sft` would start, as plain values, and what another framework needs to run it
(dslab.training.equivalents prints the commands): `describe` reads the data and any --deepspeed file (no weights, no
ranks) into a plan; the HF Trainer's own step count for it (`trainer_steps`); which chat format the model's template
writes (`chat_style`); the chats cut into the pieces the frameworks take them in (`split_data`); and `write`, which
puts a framework's files into OUTPUT-<framework>/ atomically and never replaces a file that dslab did not write there.
"""
import copy
import hashlib
import inspect
import json
import math
import os
import re
from pathlib import Path

from dslab import data, files
from dslab.models import loading, lora
from dslab.training import sft, sft_settings

# The values TrainingArguments also holds: the Trainer fills "auto" from it and stops on a config that disagrees.
TRAINER_FILLED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                  "gradient_clipping")
MANIFEST = ".dslab-written.json"  # {file: sha256} of what --print-equivalent wrote into OUTPUT-<framework>/
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# The default system prompt each chat format adds when a chat has none (dslab-tiny's ChatML adds none).
CHAT_STYLES = {"chatml": None, "qwen2": "You are a helpful assistant.", "qwen2.5": QWEN25_SYSTEM}
_SAMPLE_CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
_CHATML_SAMPLE = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"


class EquivalentError(ValueError):
    """The files a printed command needs cannot be written; the message says why and what to do."""


def plan_from_args(args):
    """The run, as plain values, from `dslab sft`'s parsed arguments: an argparse Namespace (or anything alike) with an
    attribute for each setting of dslab.training.sft_settings."""
    from dslab import machine

    sft.check_settings(vars(args))
    # a missing folder fails; a hub id passes (the framework downloads it)
    loading.check_model(args.model, weights=False)
    data_files = [str(f) for f in (args.data or [sft.DEFAULT_DATA])]
    name, author = data.name_pair(args.model_name, "--model-name"), data.name_pair(args.model_author, "--model-author")
    n_examples = len(sft.load_chats(data_files, name, author, args.mix_general, args.seed))  # DataError if malformed
    world_size, epochs, full = args.world_size, args.epochs, args.full
    if args.deepspeed:  # the recipe then takes the whole config from the file: stage, batch sizes, optimizer
        ds_config = sft.read_deepspeed_file(args.deepspeed, world_size)
        accum = ds_config.get("gradient_accumulation_steps", 1)
        micro = ds_config.get("train_micro_batch_size_per_gpu") or ds_config["train_batch_size"] // (accum * world_size)
        steps = sft.total_steps(n_examples, world_size, micro, accum, epochs)
    else:
        micro, accum = args.micro_batch_size, args.grad_accum_steps
        steps = sft.total_steps(n_examples, world_size, micro, accum, epochs)
        lr = args.lr or sft_settings.default_lr(full)
        ds_config = sft.deepspeed_config(args.zero_stage, world_size, micro, accum, lr, steps)
    zero = ds_config.get("zero_optimization", {})
    adam = ds_config.get("optimizer", {}).get("params", {})
    schedule = ds_config.get("scheduler", {}).get("params", {})
    model = loading.resolve_model(args.model)
    framework_steps = trainer_steps(n_examples, world_size, micro, accum, epochs)
    warmup = schedule.get("warmup_num_steps", 0)
    return {
        "output": str(args.output), "model": model, "cwd": os.getcwd(), "use_cpu": not machine.gpu_count(),
        "default_model": Path(model).resolve() == loading.DEFAULT_MODEL_DIR, "local_model": Path(model).is_dir(),
        "chat_style": chat_style(model), "architecture": architecture(model), "data": data_files,
        "model_name": list(args.model_name), "model_author": list(args.model_author), "mix_general": args.mix_general,
        "n_examples": n_examples, "seed": args.seed, "max_length": args.max_length,
        "full": full, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
        # the recipe calls lora.attach_lora without a dropout, so its default is the run's
        "lora_dropout": inspect.signature(lora.attach_lora).parameters["dropout"].default,
        "target_modules": list(args.target_modules or _mlp_targets(model)),  # what attach_lora will adapt
        "zero_stage": zero.get("stage", 0), "ds_config": ds_config, "deepspeed_file": args.deepspeed,
        "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none") != "none",
        "offload_param": zero.get("offload_param", {}).get("device", "none") != "none",
        "world_size": world_size, "micro_batch_size": micro, "grad_accum_steps": accum, "epochs": epochs,
        "steps": steps, "framework_steps": framework_steps, "lr": adam.get("lr"),
        "betas": list(adam.get("betas", (0.9, 0.999))),
        "eps": adam.get("eps", 1e-8), "weight_decay": adam.get("weight_decay", 0.01),  # torch AdamW's defaults
        "scheduler": ds_config.get("scheduler", {}).get("type"), "warmup_steps": warmup,
        # dslab warms up for 1/20 of its steps; the frameworks get the same share of theirs (a file's number stays)
        "framework_warmup_steps": warmup if args.deepspeed else max(1, framework_steps // 20) if warmup else 0,
        "min_lr_ratio": schedule.get("cos_min_ratio", 0.0),
        "max_grad_norm": ds_config.get("gradient_clipping", 1.0),  # DeepSpeed 0.19's default
        "precision": "bf16" if ds_config.get("bf16", {}).get("enabled") else
                     "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32",
        "gradient_checkpointing": args.gradient_checkpointing,
        "log_every": args.log_every or max(1, steps // 8),
        "framework_log_every": args.log_every or max(1, framework_steps // 8),
        "save_every": args.save_every, "checkpoint_dir": args.checkpoint_dir, "resume": args.resume,
        "timeout": args.timeout,
    }


def trainer_steps(n_examples, world_size, micro_batch_size, grad_accum_steps, epochs):
    """Optimizer steps the HF Trainer plans (so ms-swift and LLaMA-Factory too): its DataLoader keeps the last partial
    batch, accelerate deals the batches out to the ranks evenly (BatchSamplerShard, even_batches: a short rank repeats
    from the start), and the last accumulation of an epoch steps too (Trainer.set_initial_training_values)."""
    per_rank = math.ceil(math.ceil(n_examples / micro_batch_size) / world_size)
    return math.ceil(epochs * max(math.ceil(per_rank / grad_accum_steps), 1))


def work_dir(plan, target):
    """OUTPUT-<target>: where --print-equivalent writes the files the printed command needs, and the framework its
    output."""
    return f"{plan['output'].rstrip('/')}-{target}"


def write(folder, written):
    """Write {name: text} into folder, each file atomically. A file already there is replaced only if dslab wrote it
    (its hash is in the folder's manifest) and nobody changed it since; otherwise nothing is written and
    EquivalentError says which file is in the way."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise EquivalentError(f"{folder} is a file; the printed command needs a folder there: move it or pick "
                              "another --output")
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = {}
    for name, text in written.items():
        path = folder / name
        if path.is_dir():
            raise EquivalentError(f"{path} is a folder; the printed command needs a file there: move it or pick "
                                  "another --output")
        if path.exists():
            old = _sha(path.read_bytes())
            if old != _sha(text.encode("utf-8")) and old != manifest.get(name):
                raise EquivalentError(f"{path} exists and is not a file dslab wrote there (or it was changed since): "
                                      "nothing was written; move it away or pick another --output")
    for name, text in written.items():
        path = folder / name
        if not path.exists() or path.read_bytes() != text.encode("utf-8"):
            files.atomic_write_text(path, text)
        manifest[name] = _sha(text.encode("utf-8"))
    files.atomic_write_json(folder / MANIFEST, manifest, indent=1, sort_keys=True)
    return folder


def _sha(blob):
    return hashlib.sha256(blob).hexdigest()


# ----------------------------------------------------------------------------------------------------
# The model: its chat format and architecture, read from its folder (a hub id: from its name)
# ----------------------------------------------------------------------------------------------------
def chat_style(model):
    """How the model's own chat template writes a chat: "chatml" (ChatML without a system prompt, as dslab-tiny's),
    "qwen2" or "qwen2.5" (ChatML with Qwen2's or Qwen2.5's default system prompt), or None when dslab cannot tell.
    A local folder's template is rendered for a sample chat and compared; a hub id is judged by its name."""
    path = Path(model)
    if not path.is_dir():
        match = re.fullmatch(r"qwen(2|2\.5)-[\d.]+b(-instruct)?", str(model).rstrip("/").rsplit("/", 1)[-1].lower())
        return None if not match else "qwen2.5" if match.group(1) == "2.5" else "qwen2"
    template = _chat_template(path)
    if template is None:
        return None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders it
    environment.globals["raise_exception"] = raise_exception
    try:
        text = environment.from_string(template).render(messages=_SAMPLE_CHAT, add_generation_prompt=False)
    except TemplateError:
        return None
    for style, system in CHAT_STYLES.items():
        if text == (f"<|im_start|>system\n{system}<|im_end|>\n" if system else "") + _CHATML_SAMPLE:
            return style
    return None


def _chat_template(folder):
    """The tokenizer's chat template text (chat_template.jinja, or tokenizer_config.json's), or None."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _mlp_targets(model):
    """The MLP layers attach_lora finds by type in `model` (read from its config, no weights); where no config is here
    (a hub id printed for another machine), the names Qwen2/3, Llama and Mistral give them."""
    if not (Path(model) / "config.json").is_file():
        return lora.DEFAULT_TARGETS
    return lora.targets_of(model)   # AdapterError when no layer would get one: the same refusal as dslab sft's


def architecture(model):
    """The first entry of config.json's "architectures" (e.g. "Qwen2ForCausalLM"); None for a hub id."""
    try:
        return json.loads((Path(model) / "config.json").read_text(encoding="utf-8")).get("architectures", [None])[0]
    except (OSError, ValueError, IndexError):
        return None


# ----------------------------------------------------------------------------------------------------
# The data, in each framework's own format
# ----------------------------------------------------------------------------------------------------
def split_data(plan):
    """The chats dslab trains on, in the pieces the frameworks take them: {"query_response": [paths of files with only
    {"query", "response"} rows (self-cognition style, {name}/{author} left in)], "chats": [chats of the other files,
    names filled], "general": [the general dialogue rows dslab mixes in, in its order]}."""
    p = plan
    name, author = data.name_pair(p["model_name"]), data.name_pair(p["model_author"])
    query_response, chats, n_rows = [], [], 0
    for path in p["data"]:
        rows = data.load_jsonl(path)
        n_rows += len(rows)
        if rows and all("query" in r and "response" in r and "messages" not in r for r in rows):
            query_response.append(path)
        else:
            chats += sft.load_chats(path, name, author, mix_general=0, seed=p["seed"])
    n_general = n_rows if p["mix_general"] is None else int(p["mix_general"])
    return {"query_response": query_response, "chats": chats, "general": data.general_sft(limit=n_general)}


def chat_rows(plan):
    """Every chat dslab trains on ({"messages"}: names filled, general dialogue mixed in), in dslab's order."""
    p = plan
    chats = sft.load_chats(p["data"], data.name_pair(p["model_name"]), data.name_pair(p["model_author"]),
                           p["mix_general"], p["seed"])
    return [{"messages": c["messages"]} for c in chats]


def trainer_ds_config(ds_config):
    """dslab's DeepSpeed config as a Trainer-based framework takes it: "auto" where TrainingArguments holds the value,
    and no "scheduler" section (the Trainer then builds the schedule its lr_scheduler_type names, as for ms-swift's
    presets, which have none); the ZeRO section, the optimizer type and everything else stay as dslab runs them."""
    cfg = copy.deepcopy(ds_config)
    cfg.pop("scheduler", None)
    for key in TRAINER_FILLED:
        cfg[key] = "auto"
    for precision in ("bf16", "fp16"):
        if precision in cfg:
            cfg[precision]["enabled"] = "auto"
    if "optimizer" in cfg:
        params = cfg["optimizer"].setdefault("params", {})
        for key in ("lr", "betas", "eps", "weight_decay"):
            params[key] = "auto"
    return cfg
