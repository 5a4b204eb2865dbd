"""The run `dslab sft` would start, for the frameworks people train with afterwards: the Hugging Face Trainer (a
train.py), ms-swift 4.6 (`swift sft`) and LLaMA-Factory 0.9.5 (`llamafactory-cli train` on a YAML).

`render(target, plan)` turns a dslab.training.sft_plan plan into the text to print and the files its command needs (the data in
the framework's own format, configs, the script), which `sft_plan.write` puts into OUTPUT-<framework>/. The printed
commands run as pasted in the framework's venv (`make swift`, `make llamafactory`; dslab's .venv for hf): they need no
dslab. What a framework has no setting for is a comment line, never an invented flag. tests/test_equivalents.py checks
every flag against the frameworks' argument definitions; tests/test_frameworks_runs.py runs the printed commands for a
few steps in the frameworks' venvs.
"""
import json
import math
import os
import pprint
import shlex

from dslab import data
from dslab.training import framework_data, sft_plan, sft_settings
from dslab.launch import frameworks
from dslab.training.sft_plan import CHAT_STYLES, trainer_ds_config, work_dir

TARGETS = ("hf", "swift", "llamafactory")
# ms-swift 4.6 ships these DeepSpeed configs (swift/config/*.json, named in swift/arguments/sft_args.py _init_deepspeed),
# keyed here by (stage, optimizer offloaded, parameters offloaded).
SWIFT_PRESETS = {(0, False, False): "zero0", (1, False, False): "zero1", (2, False, False): "zero2",
                 (3, False, False): "zero3", (2, True, False): "zero2_offload", (3, True, True): "zero3_offload"}
# (swift --template, LLaMA-Factory template, LLaMA-Factory default_system) for each chat format (sft_plan.chat_style)
TEMPLATES = {"chatml": ("chatml", "chatml", None), "qwen2": ("qwen", "qwen", CHAT_STYLES["qwen2"]),
             "qwen2.5": ("qwen2_5", "qwen", None)}


def render(target, plan):
    """(text to print, {file name in work_dir: text}) for one of TARGETS."""
    return {"hf": hf, "swift": swift, "llamafactory": llamafactory}[target](plan)


def _jsonl(rows):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


# ----------------------------------------------------------------------------------------------------
# What the three have in common: the summary, the global batch, paths as the learner typed them
# ----------------------------------------------------------------------------------------------------
def _shown(path):
    """A path relative to the working directory when it lies below it (what a learner would type)."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(path)


def _num(x):
    """32.0 -> 32, 0.002 -> 0.002: numbers as a person writes them."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _yaml_num(x):
    """A number PyYAML reads back as the same number (it reads 1e-05 as a string; 1.0e-05 is a float)."""
    if isinstance(x, int):
        return str(x)
    mantissa, _, exponent = repr(x).partition("e")
    return mantissa + ("" if "." in mantissa else ".0") + (f"e{'+' if exponent[0] != '-' else ''}{exponent.lstrip('+')}"
                                                           if exponent else "")


def global_batch(plan):
    """The batch triple and its product, in words."""
    m, a, w = plan["micro_batch_size"], plan["grad_accum_steps"], plan["world_size"]
    return (f"{m} per rank x {a} accumulation step{'s' * (a != 1)} x {w} rank{'s' * (w != 1)} = global batch "
            f"{m * a * w} examples per optimizer step")


def summary(plan, framework):
    """Comment lines that say what `dslab sft` would run, and the steps `framework` (a Trainer) plans for it."""
    p = plan
    what = "full fine-tuning" if p["full"] else (f"LoRA r={p['lora_r']} alpha={_num(p['lora_alpha'])} dropout "
                                                 f"{p['lora_dropout']} on {' '.join(p['target_modules'])}")
    offload = [part for part, on in (("optimizer", p["offload_optimizer"]), ("parameters", p["offload_param"])) if on]
    schedule = (f"warm-up {p['warmup_steps']} steps, then cosine to {_num(p['min_lr_ratio'])} x lr" if
                p["scheduler"] == "WarmupCosineLR" else "constant" if not p["scheduler"] else p["scheduler"])
    mix = "as many as the data" if p["mix_general"] is None else p["mix_general"]
    per_rank = math.ceil(p["n_examples"] / p["micro_batch_size"])
    *replaced, last = sft_settings.replaced_by_deepspeed_file()
    return "\n".join([
        f"# The run `dslab sft --output {p['output']}` starts: {what} of {_shown(p['model'])},",
        f"# ZeRO-{p['zero_stage']} ({'offload: ' + ' and '.join(offload) if offload else 'no offload'}), {p['precision']}"
        + (f", config from {p['deepspeed_file']}" if p["deepspeed_file"] else "") + ", gradient checkpointing "
        + ("on" if p["gradient_checkpointing"] else "off") + f"; seed {p['seed']}",
        f"# batch: {global_batch(p)};",
        (f"# {p['epochs']} epochs of {p['n_examples']} chats = {p['steps']} steps; AdamW lr {p['lr']} (betas "
         f"{p['betas'][0]}/{p['betas'][1]}, weight decay {p['weight_decay']}), {schedule}, clip {p['max_grad_norm']}"),
        (f"# data: {' '.join(_shown(f) for f in p['data'])} with {{name}}/{{author}} = {' / '.join(p['model_name'])}, "
         f"{' / '.join(p['model_author'])}; general dialogue mixed in: {mix}; max length {p['max_length']} tokens"),
        (f"# {framework} plans {p['framework_steps']} steps, not {p['steps']}: its DataLoader keeps the last partial "
         f"batch (ceil({p['n_examples']}/{p['micro_batch_size']}) = {per_rank} batches, dealt evenly to "
         f"{p['world_size']} rank{'s' * (p['world_size'] != 1)}) where dslab drops it; warm-up "
         f"{p['framework_warmup_steps']} steps"),
        ("# The examples are the same; the order each framework draws them in is its own, so losses follow the same "
         "trend, not the same values."),
    ] + ([f"# With {sft_settings.flag('deepspeed')}, dslab takes the ZeRO stage, batch sizes, precision and optimizer "
          "from that file:", f"# {', '.join(replaced)} and {last} are not used (nor here)."]
         if p["deepspeed_file"] else []))


def _unmatched(plan, framework):
    """Comment lines for dslab options that `framework` has no setting for."""
    p, lines, flag = plan, [], sft_settings.flag
    if p["timeout"]:
        lines.append(f"# {flag('timeout')} {p['timeout']}: {framework} has no overall time limit; stop the job "
                     "yourself")
    if p["resume"]:
        lines.append(f"# {flag('resume')} {p['resume']}: dslab's checkpoints are DeepSpeed ones in dslab's layout; "
                     f"{framework} resumes only from its own (resume_from_checkpoint)")
    if p["checkpoint_dir"]:
        lines.append(f"# {flag('checkpoint_dir')} {p['checkpoint_dir']}: {framework} writes checkpoints inside its "
                     "output_dir")
    return lines


def _written(plan, target, described):
    """Comment lines that list the files --print-equivalent wrote for the command: [(name, what it holds)]."""
    return [f"# dslab wrote what it reads into {work_dir(plan, target)}/:"] + [
        f"#   {name}: {what}" if what else f"#   {name}" for name, what in described]


def _schedule(plan):
    """(lr_scheduler_type, lr_scheduler_kwargs or None): dslab's DeepSpeed schedule as the Trainer names it."""
    if plan["scheduler"] == "WarmupCosineLR":  # linear warm-up, then cosine down to cos_min_ratio x lr
        return "cosine_with_min_lr", {"min_lr_rate": plan["min_lr_ratio"]}
    return "constant", None


def _venv_line(plan, target):
    """Where the printed lines run: the framework's venv and the folder the paths are relative to."""
    folder, make = frameworks.VENVS[{"swift": "swift", "llamafactory": "llamafactory-cli"}[target]]
    return [f"# In {target}'s venv (make {make}; source {frameworks.ROOT / folder}/bin/activate), from the folder the "
            "paths are relative to:", f"cd {shlex.quote(plan['cwd'])}"]


# ----------------------------------------------------------------------------------------------------
# The three targets
# ----------------------------------------------------------------------------------------------------
def hf(plan):
    """(train.py for the Hugging Face Trainer, {"train.py", "train.jsonl"}): printed and written alike."""
    p = plan
    wd = work_dir(p, "hf")
    ds = trainer_ds_config(p["ds_config"])
    zero = ds.get("zero_optimization", {})
    scheduler, scheduler_kwargs = _schedule(p)
    kwargs = [("output_dir", f"{wd}/output"), ("per_device_train_batch_size", p["micro_batch_size"]),
              ("gradient_accumulation_steps", p["grad_accum_steps"]), ("num_train_epochs", p["epochs"]),
              ("learning_rate", p["lr"]), ("lr_scheduler_type", scheduler)]
    kwargs += [("lr_scheduler_kwargs", scheduler_kwargs)] if scheduler_kwargs else []
    kwargs += [("warmup_steps", p["framework_warmup_steps"]), ("weight_decay", p["weight_decay"]),
               ("adam_beta1", p["betas"][0]), ("adam_beta2", p["betas"][1]), ("adam_epsilon", p["eps"]),
               ("max_grad_norm", p["max_grad_norm"]), ("bf16", p["precision"] == "bf16"),
               ("fp16", p["precision"] == "fp16"), ("gradient_checkpointing", p["gradient_checkpointing"])]
    kwargs += [("gradient_checkpointing_kwargs", {"use_reentrant": False})] if p["gradient_checkpointing"] else []
    kwargs += [("seed", p["seed"]), ("logging_steps", p["framework_log_every"])]
    kwargs += ([("save_strategy", "steps"), ("save_steps", p["save_every"])] if p["save_every"]
               else [("save_strategy", "no")])
    kwargs += [("report_to", "none"), ("deepspeed", "ds_config")]
    world = p["world_size"]
    lines = ["# The Hugging Face Trainer (transformers + peft + DeepSpeed) for this dslab run.", summary(p, "The Trainer"),
             "#", *_written(p, "hf", [("train.py", "this script"), ("train.jsonl", f"the {p['n_examples']} chats dslab "
                                                                            "trains on (names filled, general mixed in)")]),
             f"# Start it on {world} rank{'s' * (world != 1)} from {p['cwd']}, in dslab's venv (or any with transformers,",
             f"# peft and deepspeed): deepspeed --num_gpus {world} {wd}/train.py (or torchrun --nproc_per_node {world} ...)",
             "# A hub model instead of MODEL's folder: MODEL = \"Qwen/Qwen2.5-0.5B-Instruct\" (from China, with",
             "# HF_ENDPOINT=https://hf-mirror.com set; or fetch it from ModelScope first: modelscope download --model",
             "# Qwen/Qwen2.5-0.5B-Instruct --local_dir DIR, and MODEL = DIR).",
             *_unmatched(p, "the Trainer"),
             "import json", "from pathlib import Path", "",
             "import deepspeed", "import torch", "from peft import LoraConfig, get_peft_model",
             "from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, "
             "TrainingArguments", "",
             f"MODEL = {_shown(p['model'])!r}",
             "DATA = Path(__file__).with_name(\"train.jsonl\")",
             f"MAX_LENGTH = {p['max_length']}  # dslab cuts a chat's tokens here (the kit's chats are shorter)", "",
             "# dslab's DeepSpeed config; \"auto\" where TrainingArguments holds the value (the Trainer fills it in).",
             "# No \"scheduler\" section: with one, DeepSpeed would build the schedule and lr_scheduler_type below would",
             "# be ignored; without, the Trainer builds the schedule lr_scheduler_type names.",
             f"ds_config = {pprint.pformat(ds, indent=1, width=100, sort_dicts=True)}", "", "args = TrainingArguments("]
    for key, value in kwargs:
        note = f"  # {global_batch(p)}" if key == "gradient_accumulation_steps" else ""
        lines.append(f"    {key}={value if key == 'deepspeed' else repr(value)},{note}")
    lines += ["    use_cpu=not torch.cuda.is_available(),  # CPU ranks (gloo) where there is no GPU, as dslab runs", ")"]
    if not p["full"]:
        lines.append(f"lora_config = LoraConfig(r={p['lora_r']}, lora_alpha={_num(p['lora_alpha'])!r}, "
                     f"lora_dropout={p['lora_dropout']!r}, target_modules={p['target_modules']!r}, "
                     "task_type='CAUSAL_LM', bias='none')")
    lines += ["",
              "# args holds an HfDeepSpeedConfig now: under ZeRO-3 from_pretrained creates every weight inside",
              "# deepspeed.zero.Init, already cut into per-rank partitions. On CPUs (use_cpu) accelerate started the",
              "# gloo group itself, and DeepSpeed's comm layer must wrap it before zero.Init counts the ranks, or it",
              "# counts 1. On GPUs accelerate has called this already: then it does nothing.",
              "deepspeed.init_distributed()",
              "tokenizer = AutoTokenizer.from_pretrained(MODEL)",
              "# fp32 weights, as dslab loads them (DeepSpeed's bf16 mode keeps them as master weights and computes in",
              "# bf16). Without dtype=, transformers 5 loads the checkpoint's own dtype (\"auto\": bf16 for dslab-tiny).",
              "model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, use_safetensors=True)"]
    lines += ["# Full fine-tuning: no LoRA; every weight trains."] if p["full"] else \
        ["model = get_peft_model(model, lora_config)"]
    lines += ["END = tokenizer.convert_tokens_to_ids(\"<|im_end|>\") if \"<|im_end|>\" in tokenizer.get_vocab() \\",
              "    else tokenizer.eos_token_id", "", "",
              "def example(messages):",
              "    \"\"\"input_ids + labels: the loss learns each answer up to its end token; the prompt is -100.\"\"\"",
              "    input_ids, labels, done = [], [], \"\"",
              "    for i, message in enumerate(messages):",
              "        if message[\"role\"] != \"assistant\":",
              "            continue",
              "        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)",
              "        full = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)",
              "        prompt_ids = tokenizer.encode(prompt[len(done):], add_special_tokens=False)",
              "        answer_ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)",
              "        stop = answer_ids.index(END) + 1 if END in answer_ids else len(answer_ids)",
              "        input_ids += prompt_ids + answer_ids",
              "        labels += [-100] * len(prompt_ids) + answer_ids[:stop] + [-100] * (len(answer_ids) - stop)",
              "        done = full",
              "    return {\"input_ids\": input_ids[:MAX_LENGTH], \"labels\": labels[:MAX_LENGTH]}", "", "",
              "chats = [json.loads(line)[\"messages\"] for line in DATA.read_text(encoding=\"utf-8\").splitlines()]",
              "trainer = Trainer(model=model, args=args, train_dataset=[example(c) for c in chats], processing_class=tokenizer,",
              "                  data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100))",
              "trainer.train()"]
    if p["zero_stage"] == 3:
        lines += ["# trainer.save_model(), not model.save_pretrained(): under ZeRO-3 every rank holds only its partitions,",
                  "# and save_pretrained would write empty tensors. save_model gathers a LoRA adapter always; a whole",
                  "# model only with stage3_gather_16bit_weights_on_model_save (without it, a DeepSpeed checkpoint to",
                  "# convert with zero_to_fp32)."
                  + (" This config has it." if zero.get("stage3_gather_16bit_weights_on_model_save") else
                     " This config lacks it." if p["full"] else "")]
    lines += [f"trainer.save_model()  # into {wd}/output",
              "torch.distributed.destroy_process_group()  # leave the gloo group before exit, or a finished rank may abort"]
    text = "\n".join(lines) + "\n"
    return text, {"train.py": text, "train.jsonl": _jsonl(sft_plan.chat_rows(p))}


def swift(plan):
    """(the `swift sft` command with its comments, {files it reads}) for ms-swift 4.6.0."""
    p = plan
    wd = work_dir(p, "swift")
    parts = sft_plan.split_data(p)
    written, datasets = {}, []
    if parts["query_response"]:
        rows = [r for path in parts["query_response"] for r in framework_data.swift_self_cognition_rows(path)]
        written["self-cognition/self_cognition.jsonl"] = _jsonl(rows)
        datasets.append(f"{wd}/self-cognition")
    if parts["chats"]:
        written["chats.jsonl"] = _jsonl({"messages": c["messages"]} for c in parts["chats"])
        datasets.append(f"{wd}/chats.jsonl")
    if parts["general"]:
        written["general.jsonl"] = _jsonl(parts["general"])
        datasets.append(f"{wd}/general.jsonl")
    preset = SWIFT_PRESETS.get((p["zero_stage"], p["offload_optimizer"], p["offload_param"]))
    if not preset:
        written["ds_config.json"] = json.dumps(trainer_ds_config(p["ds_config"]), indent=2, sort_keys=True) + "\n"
    template_lines, flags = _swift_model_flags(p)
    flags += [("dataset", datasets)]
    if parts["query_response"]:
        flags += [("model_name", p["model_name"]), ("model_author", p["model_author"])]
    flags += [("max_length", p["max_length"]), ("truncation_strategy", "right"),
              ("tuner_type", "full" if p["full"] else "lora")]
    if not p["full"]:
        flags += [("lora_rank", p["lora_r"]), ("lora_alpha", _num(p["lora_alpha"])), ("lora_dropout", p["lora_dropout"]),
                  ("target_modules", p["target_modules"])]
    scheduler, scheduler_kwargs = _schedule(p)
    flags += [("deepspeed", preset or f"{wd}/ds_config.json"), ("per_device_train_batch_size", p["micro_batch_size"]),
              ("gradient_accumulation_steps", p["grad_accum_steps"]), ("num_train_epochs", p["epochs"]),
              ("learning_rate", p["lr"]), ("lr_scheduler_type", scheduler)]
    flags += [("lr_scheduler_kwargs", json.dumps(scheduler_kwargs))] if scheduler_kwargs else []
    flags += [("warmup_steps", p["framework_warmup_steps"]), ("weight_decay", p["weight_decay"]),
              ("adam_beta1", p["betas"][0]), ("adam_beta2", p["betas"][1]), ("adam_epsilon", p["eps"]),
              ("max_grad_norm", p["max_grad_norm"]), ("torch_dtype", "float32"),
              ("bf16", p["precision"] == "bf16"), ("fp16", p["precision"] == "fp16")]
    flags += [("use_cpu", True)] if p["use_cpu"] else []
    flags += [("gradient_checkpointing", p["gradient_checkpointing"])]
    flags += [("gradient_checkpointing_kwargs", json.dumps({"use_reentrant": False}))] if p["gradient_checkpointing"] else []
    flags += [("seed", p["seed"]), ("data_seed", p["seed"]), ("logging_steps", p["framework_log_every"])]
    flags += [("save_steps", p["save_every"])] if p["save_every"] else [("save_only_model", True)]
    flags += [("add_version", False), ("output_dir", f"{wd}/output")]

    described = [(n, what) for n, what in (
        ("self-cognition/self_cognition.jsonl", "the self-cognition rows in swift's own format ({{NAME}}/{{AUTHOR}}, "
         "tag zh/en).\n#     The folder's name makes swift load it as its registered self-cognition dataset, whose "
         "rows\n#     --model_name/--model_author fill (swift/dataset/dataset_syntax.py); they change no other data"),
        ("chats.jsonl", "the other chats, names filled"),
        ("general.jsonl", f"the {len(parts['general'])} general chats dslab mixes in"),
        ("ds_config.json", "dslab's DeepSpeed config (swift has no preset for this ZeRO setup), without its scheduler"))
        if n in written]
    lines = ["# ms-swift 4.6.0 (`swift sft`) for this dslab run.", summary(p, "swift"), "#",
             *_written(p, "swift", described)]
    lines += template_lines
    if preset:
        lines += [f"# --deepspeed {preset}: swift's own config (swift/config/{preset}.json): "
                  + ("fixed bucket sizes (2e8 elements) where dslab sizes them for the model;" if p["zero_stage"] < 3
                     else "bucket sizes \"auto\" (filled from the hidden size), as the Trainer fills them;"),
                  "# it has no optimizer or scheduler section, so swift runs the Trainer's AdamW (torch) and the "
                  "--lr_scheduler_type below."]
    lines += ["# --torch_dtype float32: the weights load in fp32, as dslab loads them (swift's default is the "
              "checkpoint's dtype); DeepSpeed's bf16 mode computes in bf16.",
              f"# --gradient_checkpointing {str(p['gradient_checkpointing']).lower()}: as dslab (swift's default is "
              "true). --truncation_strategy right: cut a long chat's end, as dslab (swift's default drops the chat).",
              (f"# Output: {wd}/output (--add_version false; by default swift writes OUTPUT/vN-TIMESTAMP/): "
               "logging.jsonl, args.json, and at the end checkpoint-N/ with the "
               + ("model" if p["full"] else "adapter")
               + ("" if p["save_every"] else " (--save_only_model true: no optimizer states, as dslab keeps none)")
               + "."),
              ]
    if p["local_model"]:
        lines.append("# --check_model false: the model is a local folder; swift would ask ModelScope whether it is the "
                     "newest version (retries for ~7 s offline).")
    if p["use_cpu"]:
        lines.append("# --use_cpu true: no GPU here (without it the Trainer refuses --bf16 on CPU: \"Your setup doesn't"
                     " support bf16/gpu\").")
    lines += ["# On GPUs: drop --use_cpu; NPROC_PER_NODE=number of GPUs. A hub model instead, e.g. --model "
              "Qwen/Qwen2.5-0.5B-Instruct without",
              "# --model_type/--template/--check_model (swift takes them from the id): swift downloads it from "
              "ModelScope (--use_hf false,",
              "# its default; reachable from China); --use_hf true takes the Hugging Face hub (from China: "
              "HF_ENDPOINT=https://hf-mirror.com).",
              "# Or download first: modelscope download --model Qwen/Qwen2.5-0.5B-Instruct --local_dir DIR, then "
              "--model DIR --model_type qwen2 --template qwen2_5."]
    lines += _unmatched(p, "swift") + _venv_line(p, "swift")
    command = [f"NPROC_PER_NODE={p['world_size']} swift sft \\"]
    for key, value in flags:
        values = value if isinstance(value, list) else [value]
        shown = [str(v).lower() if isinstance(v, bool) else _shown(v) if key in ("model", "dataset") else str(v)
                 for v in values]
        command.append(f"    --{key} {' '.join(shlex.quote(v) for v in shown)} \\")
    command[-1] = command[-1][:-2]
    return "\n".join(lines + command) + "\n", written


def _swift_model_flags(plan):
    """(comment lines, [(flag, value)]) that tell swift the model, its model_type and its chat template."""
    p = plan
    flags = [("model", p["model"])]
    style = p["chat_style"]
    if style and p["local_model"]:
        # a folder's name rarely matches a registered model id, and Qwen2ForCausalLM is both qwen2 and qwen2_gte
        model_type = [("model_type", "qwen2")] if p["architecture"] == "Qwen2ForCausalLM" else []
        flags += model_type + [("template", TEMPLATES[style][0])]
        lines = [f"# --template {TEMPLATES[style][0]}: the model's own chat template is "
                 + ("ChatML without a system prompt" if style == "chatml" else f"{style}'s ChatML with its system prompt")
                 + ("" if model_type else "; swift picks --model_type from config.json (set it if swift asks)")]
    elif style:
        lines = [f"# swift matches {p['model']} to its registered model: model_type qwen2, template "
                 f"{TEMPLATES[style][0]}."]
    else:
        lines = [f"# dslab cannot tell which chat template {p['model']} uses: set --template (and --model_type) to "
                 "swift's names for it (swift/template/constant.py, swift/model/constant.py)."]
    flags += [("check_model", False)] if p["local_model"] else []
    return lines, flags


def llamafactory(plan):
    """(the YAML shown as comments and the `llamafactory-cli train` command, {files it reads}) for LLaMA-Factory 0.9.5."""
    p = plan
    wd = work_dir(p, "llamafactory")
    parts = sft_plan.split_data(p)
    name, author = data.name_pair(p["model_name"]), data.name_pair(p["model_author"])
    written, info = {}, {}
    if parts["query_response"]:
        rows = [r for path in parts["query_response"]
                for r in framework_data.llamafactory_identity_rows(name, author, path)]
        written["identity.json"] = json.dumps(rows, ensure_ascii=False, indent=1) + "\n"
        info["identity"] = {"file_name": "identity.json"}  # alpaca columns: instruction, input, output
    if parts["chats"]:
        written["chats.jsonl"] = _jsonl({"messages": c["messages"]} for c in parts["chats"])
        info["chats"] = {"file_name": "chats.jsonl", **framework_data.SHAREGPT_MESSAGES}
    if parts["general"]:
        written["general.jsonl"] = _jsonl(parts["general"])
        info["general"] = {"file_name": "general.jsonl", **framework_data.SHAREGPT_MESSAGES}
    written["dataset_info.json"] = json.dumps(info, indent=1) + "\n"
    written["ds_config.json"] = json.dumps(trainer_ds_config(p["ds_config"]), indent=2, sort_keys=True) + "\n"
    keys = [("model_name_or_path", _shown(p["model"]))]
    style = p["chat_style"]
    if style:
        keys += [("template", TEMPLATES[style][1])]
        keys += [("default_system", TEMPLATES[style][2])] if TEMPLATES[style][2] else []
    keys += [("stage", "sft"), ("do_train", True), ("finetuning_type", "full" if p["full"] else "lora")]
    if not p["full"]:
        keys += [("lora_rank", p["lora_r"]), ("lora_alpha", _num(p["lora_alpha"])), ("lora_dropout", p["lora_dropout"]),
                 ("lora_target", ",".join(p["target_modules"]))]
    scheduler, scheduler_kwargs = _schedule(p)
    keys += [("deepspeed", f"{wd}/ds_config.json"), ("dataset", ",".join(info)), ("dataset_dir", wd),
             ("cutoff_len", p["max_length"]), ("output_dir", f"{wd}/output"), ("overwrite_output_dir", True),
             ("per_device_train_batch_size", p["micro_batch_size"]),
             ("gradient_accumulation_steps", p["grad_accum_steps"]), ("num_train_epochs", p["epochs"]),
             ("learning_rate", p["lr"]), ("lr_scheduler_type", scheduler)]
    keys += [("lr_scheduler_kwargs", scheduler_kwargs)] if scheduler_kwargs else []
    keys += [("warmup_steps", p["framework_warmup_steps"]), ("weight_decay", p["weight_decay"]),
             ("adam_beta1", p["betas"][0]), ("adam_beta2", p["betas"][1]), ("adam_epsilon", p["eps"]),
             ("max_grad_norm", p["max_grad_norm"])]
    keys += [(p["precision"], True)] if p["precision"] != "fp32" else []
    keys += [("use_cpu", True)] if p["use_cpu"] else []
    # LLaMA-Factory checkpoints activations unless told not to; dslab only with --gradient-checkpointing
    keys += [("use_reentrant_gc", False)] if p["gradient_checkpointing"] else [("disable_gradient_checkpointing", True)]
    keys += [("seed", p["seed"]), ("logging_steps", p["framework_log_every"])]
    keys += [("save_steps", p["save_every"])] if p["save_every"] else [("save_strategy", "no")]
    keys += [("report_to", "none")]
    written["train.yaml"] = "".join(f"{key}: {_yaml_value(value)}\n" for key, value in keys)
    if style:
        template = (f"# template {TEMPLATES[style][1]}: the model's own chat template is "
                    + ("ChatML without a system prompt" if style == "chatml" else f"{style}'s ChatML")
                    + (f"; default_system: Qwen2's system prompt (LLaMA-Factory's qwen template adds Qwen2.5's)"
                       if TEMPLATES[style][2] else "") + ".")
    else:
        template = (f"# dslab cannot tell which chat template {p['model']} uses: add template: with LLaMA-Factory's name "
                    "for it (llamafactory/data/template.py); left out, LLaMA-Factory parses the tokenizer's own.")
    described = [(n, what) for n, what in (
        ("identity.json", "the self-cognition rows, names filled per language (LLaMA-Factory has no --model_name)"),
        ("chats.jsonl", "the other chats, names filled"),
        ("general.jsonl", f"the {len(parts['general'])} general chats dslab mixes in"),
        ("dataset_info.json", f"names them: {', '.join(info)}"),
        ("ds_config.json", "dslab's DeepSpeed config, \"auto\" where the Trainer fills it, without its scheduler"),
        ("train.yaml", "below")) if n in written]
    lines = ["# LLaMA-Factory 0.9.5 (`llamafactory-cli train`) for this dslab run.", summary(p, "LLaMA-Factory"), "#",
             *_written(p, "llamafactory", described),
             template,
             (f"# cutoff_len {p['max_length']}: LLaMA-Factory shares it out between prompt and answer where dslab cuts "
              "the chat's end; the same while chats fit (the kit's do)."),
             ("# The weights load in the checkpoint's dtype (LLaMA-Factory passes dtype \"auto\": bf16 for dslab-tiny), "
              "LoRA's in fp32; dslab loads fp32."),
             (f"# output_dir {wd}/output, apart from dslab's {p['output']}; overwrite_output_dir: without it "
              "LLaMA-Factory refuses a folder"),
             "# that holds an adapter, and resumes from a checkpoint-N in it.",
             *(["# use_cpu: no GPU here (the Trainer refuses bf16 on CPU without it)."] if p["use_cpu"] else []),
             "# On GPUs: drop use_cpu; NPROC_PER_NODE=number of GPUs. A hub model: model_name_or_path: "
             "Qwen/Qwen2.5-0.5B-Instruct with template: qwen;",
             "# from China, USE_MODELSCOPE_HUB=1 before llamafactory-cli takes it from ModelScope, HF_ENDPOINT="
             "https://hf-mirror.com from a",
             "# Hugging Face mirror; or modelscope download --model Qwen/Qwen2.5-0.5B-Instruct --local_dir DIR, and "
             "model_name_or_path: DIR.",
             *_unmatched(p, "LLaMA-Factory"),
             f"# {wd}/train.yaml:", *[f"#   {line}" for line in written["train.yaml"].splitlines()],
             *_venv_line(p, "llamafactory"),
             f"FORCE_TORCHRUN=1 NPROC_PER_NODE={p['world_size']} llamafactory-cli train {shlex.quote(wd + '/train.yaml')}"]
    return "\n".join(lines) + "\n", written


def _yaml_value(value):
    """One YAML scalar or flow mapping, typed as LLaMA-Factory's dataclasses expect."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _yaml_num(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


# ---- reading a printed command back, to compare it with one typed by hand (chapter 14) ----------------------------

def command_line(text, framework="swift"):
    """The first `framework ...` command line in `text` (a printout, or a command as typed), continuation backslashes
    joined: one line, as frameworks.run_framework takes it."""
    lines = text.replace("\\\n", " ").splitlines()
    return next(line for line in lines
                if f" {framework} " in f" {line} " and not line.lstrip().startswith("#")).strip()


def command_words(text, framework="swift"):
    """{flag: [its words]} of the first `framework ...` command line in `text` (see command_line), split as a shell
    would (frameworks.split_framework_command): each --flag takes the words up to the next --flag."""
    _, argv = frameworks.split_framework_command(command_line(text, framework))
    flags, current = {}, None
    for word in argv[1:]:
        if word.startswith("--"):
            current = flags.setdefault(word, [])
        elif current is not None:
            current.append(word)
    return flags


def command_flags(text, framework="swift"):
    """{flag: value} of command_words, each flag's words joined by spaces ("" for none)."""
    return {flag: " ".join(words) for flag, words in command_words(text, framework).items()}


def _same_value(a, b):
    try:
        return math.isclose(float(a), float(b))   # 2e-3 and 0.002 are one learning rate
    except (TypeError, ValueError):
        return a == b


def flag_differences(typed, printed):
    """[(flag, value typed, value printed)] for every flag whose value differs between two {flag: value} (None where
    one of them leaves the flag to the framework's default), in the printed command's order."""
    order = list(printed) + [flag for flag in typed if flag not in printed]
    return [(flag, typed.get(flag), printed.get(flag)) for flag in order
            if not (flag in typed and flag in printed and _same_value(typed[flag], printed[flag]))]
