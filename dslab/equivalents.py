"""The run `dslab sft` would start, written for the tools people train with afterwards: the Hugging Face Trainer
(TrainingArguments + a DeepSpeed config dict), ms-swift 4.6 (`swift sft`) and LLaMA-Factory 0.9.5 (a YAML for
`llamafactory-cli train`). `describe` reads the data and any --deepspeed file (no model, no ranks); `hf`, `swift`
and `llamafactory` turn its plan into text. What a tool has no setting for is a comment line, never an invented
flag. tests/test_equivalents.py checks every printed flag and key against the tools' own argument definitions.
"""
import copy
import inspect
import json
import os
import pprint
import shlex
from pathlib import Path

from dslab import data, files, lora, models, sft

TARGETS = ("hf", "swift", "llamafactory")
# ms-swift 4.6 ships these DeepSpeed configs under these names (swift/arguments/sft_args.py, _init_deepspeed),
# keyed here by (stage, optimizer offloaded, parameters offloaded).
SWIFT_PRESETS = {(0, False, False): "zero0", (1, False, False): "zero1", (2, False, False): "zero2",
                 (3, False, False): "zero3", (2, True, False): "zero2_offload", (3, True, True): "zero3_offload"}
# The values TrainingArguments also holds: the Trainer fills "auto" from it and stops on a config that disagrees.
TRAINER_FILLED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                  "gradient_clipping")
DATA_FILE = "train.jsonl"  # the chats dslab trains on, written by the printed command for swift and LLaMA-Factory


def describe(args):
    """The run, as plain values, from `dslab sft`'s parsed arguments (an argparse Namespace or anything alike)."""
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
        ds_config = sft.deepspeed_config(args.zero, world_size, micro, accum, args.lr or sft.default_lr(full), steps)
    zero = ds_config.get("zero_optimization", {})
    adam = ds_config.get("optimizer", {}).get("params", {})
    schedule = ds_config.get("scheduler", {}).get("params", {})
    return {
        "output": str(args.output), "model": models.resolve_model(args.model),
        "default_model": Path(models.resolve_model(args.model)).resolve() == models.DEFAULT_MODEL_DIR,
        "data": data_files,
        "model_name": list(args.model_name), "model_author": list(args.model_author), "mix_general": args.mix_general,
        "n_examples": n_examples, "seed": args.seed, "max_length": sft.RECIPE_DEFAULTS["max_length"],
        "full": full, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
        # the recipe calls lora.attach_lora without a dropout, so its default is the run's
        "lora_dropout": inspect.signature(lora.attach_lora).parameters["dropout"].default,
        "target_modules": list(args.target_modules or lora.DEFAULT_TARGETS),
        "zero_stage": zero.get("stage", 0), "ds_config": ds_config, "deepspeed_file": args.deepspeed,
        "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none") != "none",
        "offload_param": zero.get("offload_param", {}).get("device", "none") != "none",
        "world_size": world_size, "micro_batch_size": micro, "grad_accum_steps": accum, "epochs": epochs,
        "steps": steps, "lr": adam.get("lr"), "betas": list(adam.get("betas", (0.9, 0.999))),
        "eps": adam.get("eps", 1e-8), "weight_decay": adam.get("weight_decay", 0.01),  # torch AdamW's defaults
        "scheduler": ds_config.get("scheduler", {}).get("type"), "warmup_steps": schedule.get("warmup_num_steps", 0),
        "min_lr_ratio": schedule.get("cos_min_ratio", 0.0),
        "max_grad_norm": ds_config.get("gradient_clipping", 1.0),  # DeepSpeed 0.19's default
        "precision": "bf16" if ds_config.get("bf16", {}).get("enabled") else
                     "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32",
        "gradient_checkpointing": args.gradient_checkpointing,
        "log_every": args.log_every or max(1, steps // 8), "save_every": args.save_every,
        "checkpoint_dir": args.checkpoint_dir, "resume": args.resume, "timeout": args.timeout,
    }


def render(target, plan):
    """The text for one of TARGETS."""
    return {"hf": hf, "swift": swift, "llamafactory": llamafactory}[target](plan)


def write_chats(path, data_files, model_name, model_author, mix_general=None, seed=0):
    """Write the chats `dslab sft` trains on ({name}/{author} filled, general dialogue mixed in) as {"messages"}
    rows, the format ms-swift and LLaMA-Factory read; returns how many. The printed commands call this."""
    chats = sft.load_chats(data_files, data.name_pair(model_name), data.name_pair(model_author), mix_general, seed)
    files.atomic_write_text(path, "".join(json.dumps({"messages": c["messages"]}, ensure_ascii=False) + "\n"
                                          for c in chats))
    return len(chats)


def trainer_ds_config(ds_config):
    """dslab's DeepSpeed config as the HF Trainer takes it: "auto" where TrainingArguments holds the value; the ZeRO
    section, the optimizer and scheduler types and everything else stay as dslab runs them."""
    cfg = copy.deepcopy(ds_config)
    for key in TRAINER_FILLED:
        cfg[key] = "auto"
    for precision in ("bf16", "fp16"):
        if precision in cfg:
            cfg[precision]["enabled"] = "auto"
    for section, keys in (("optimizer", ("lr", "betas", "eps", "weight_decay")),
                          ("scheduler", ("total_num_steps", "warmup_num_steps", "warmup_max_lr"))):
        params = cfg.get(section, {}).get("params", {})
        for key in keys:
            if key in params or section == "optimizer":
                params[key] = "auto"
    return cfg


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


def summary(plan):
    """Comment lines that say what `dslab sft` would run, the same for every target."""
    p = plan
    what = "full fine-tuning" if p["full"] else (f"LoRA r={p['lora_r']} alpha={_num(p['lora_alpha'])} dropout "
                                                 f"{p['lora_dropout']} on {' '.join(p['target_modules'])}")
    offload = [part for part, on in (("optimizer", p["offload_optimizer"]), ("parameters", p["offload_param"])) if on]
    schedule = (f"warm-up {p['warmup_steps']} steps, then cosine to {_num(p['min_lr_ratio'])} x lr" if
                p["scheduler"] == "WarmupCosineLR" else "constant" if not p["scheduler"] else p["scheduler"])
    mix = "as many as the data" if p["mix_general"] is None else p["mix_general"]
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
        ("# The examples are the same; the order each tool draws them in is its own, so losses follow the same trend,"
         " not the same values."),
    ] + (["# With --deepspeed, dslab takes the ZeRO stage, batch sizes, precision and optimizer from that file:",
          "# --zero, --micro-batch-size, --grad-accum-steps and --lr are not used (nor here)."]
         if p["deepspeed_file"] else []))


def _unmatched(plan, tool):
    """Comment lines for dslab options that `tool` has no setting for."""
    p, lines = plan, []
    if p["timeout"]:
        lines.append(f"# --timeout {p['timeout']}: {tool} has no overall time limit; stop the job yourself")
    if p["resume"]:
        lines.append(f"# --resume {p['resume']}: dslab's checkpoints are DeepSpeed ones in dslab's layout; {tool} "
                     "resumes only from its own (resume_from_checkpoint)")
    if p["checkpoint_dir"]:
        lines.append(f"# --checkpoint-dir {p['checkpoint_dir']}: {tool} writes checkpoints inside its output_dir")
    return lines


def _export_command(plan, work_dir):
    """The shell lines that write the chats dslab trains on into work_dir (dslab installed)."""
    p = plan
    call = ", ".join(_py(v) for v in (str(Path(work_dir) / DATA_FILE), [_shown(f) for f in p["data"]], p["model_name"],
                                      p["model_author"], p["mix_general"], p["seed"]))
    return [f"mkdir -p {shlex.quote(work_dir)}",
            "python -c " + shlex.quote(f"from dslab import equivalents; equivalents.write_chats({call})")]


def _py(value):
    """A Python literal in double quotes, so that the shell's single quotes around the code stay plain."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is also a Python string literal
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    return repr(value)


# ----------------------------------------------------------------------------------------------------
# The three targets
# ----------------------------------------------------------------------------------------------------
def hf(plan):
    """Python for the Hugging Face Trainer: TrainingArguments, the DeepSpeed config dict and the LoRA config."""
    p = plan
    ds_text = pprint.pformat(trainer_ds_config(p["ds_config"]), indent=1, width=100, sort_dicts=True)
    scheduler = ("cosine_with_min_lr", {"min_lr_rate": p["min_lr_ratio"]}) if p["scheduler"] == "WarmupCosineLR" \
        else ("constant", None)
    kwargs = [("output_dir", p["output"]), ("per_device_train_batch_size", p["micro_batch_size"]),
              ("gradient_accumulation_steps", p["grad_accum_steps"]), ("num_train_epochs", p["epochs"]),
              ("learning_rate", p["lr"]), ("lr_scheduler_type", scheduler[0])]
    kwargs += [("lr_scheduler_kwargs", scheduler[1])] if scheduler[1] else []
    kwargs += [("warmup_steps", p["warmup_steps"]), ("weight_decay", p["weight_decay"]),
               ("adam_beta1", p["betas"][0]), ("adam_beta2", p["betas"][1]), ("adam_epsilon", p["eps"]),
               ("max_grad_norm", p["max_grad_norm"]), ("bf16", p["precision"] == "bf16"),
               ("fp16", p["precision"] == "fp16"), ("gradient_checkpointing", p["gradient_checkpointing"])]
    kwargs += [("gradient_checkpointing_kwargs", {"use_reentrant": False})] if p["gradient_checkpointing"] else []
    kwargs += [("seed", p["seed"]), ("logging_steps", p["log_every"])]
    kwargs += ([("save_strategy", "steps"), ("save_steps", p["save_every"])] if p["save_every"]
               else [("save_strategy", "no")])
    kwargs += [("report_to", "none"), ("deepspeed", "ds_config")]
    lines = ["# The Hugging Face Trainer (transformers + peft + DeepSpeed) for this dslab run.", summary(p), "#",
             (f"# Save as train.py and start it on {p['world_size']} rank{'s' * (p['world_size'] != 1)}: "
              f"deepspeed --num_gpus {p['world_size']} train.py (or torchrun --nproc_per_node {p['world_size']} train.py)"),
             "import torch", "from peft import LoraConfig", "from transformers import TrainingArguments", "",
             "# dslab's DeepSpeed config; \"auto\" where TrainingArguments holds the value (the Trainer fills it in)",
             f"ds_config = {ds_text}", "", "args = TrainingArguments("]
    for key, value in kwargs:
        note = f"  # {global_batch(p)}" if key == "gradient_accumulation_steps" else ""
        lines.append(f"    {key}={value if key == 'deepspeed' else repr(value)},{note}")
    lines += ["    use_cpu=not torch.cuda.is_available(),  # CPU ranks (gloo) where there is no GPU, as dslab runs", ")"]
    if p["full"]:
        lines.append("# Full fine-tuning: no LoRA config; every weight trains.")
    else:
        lines.append(f"lora_config = LoraConfig(r={p['lora_r']}, lora_alpha={_num(p['lora_alpha'])!r}, "
                     f"lora_dropout={p['lora_dropout']!r}, target_modules={p['target_modules']!r}, "
                     "task_type='CAUSAL_LM', bias='none')")
    model = _shown(p["model"])
    lines += ["", "# The rest of train.py, as dslab's recipe does it (dslab/recipes/sft.py):",
              "# from peft import get_peft_model",
              "# from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer",
              "# from dslab import data, sft",
              f"# tokenizer = AutoTokenizer.from_pretrained({model!r})",
              (f"# model = AutoModelForCausalLM.from_pretrained({model!r})  # fp32 weights; DeepSpeed's "
               f"{p['precision']} mode casts them"),
              *([] if p["full"] else ["# model = get_peft_model(model, lora_config)"]),
              (f"# chats = sft.load_chats({[_shown(f) for f in p['data']]!r}, {p['model_name']!r}, "
               f"{p['model_author']!r}, {p['mix_general']!r}, {p['seed']!r})"),
              f"# train_dataset = sft.tokenize(tokenizer, chats, max_length={p['max_length']})  # prompts labelled -100",
              "# Trainer(model=model, args=args, train_dataset=train_dataset,",
              "#         data_collator=lambda batch: data.collate(batch, tokenizer.pad_token_id)).train()",
              f"# model.save_pretrained({p['output']!r})"]
    return "\n".join(lines + _unmatched(p, "the Trainer")) + "\n"


def swift(plan):
    """A shell script: write the chats, then the `swift sft` command line (ms-swift 4.6.0)."""
    p = plan
    work_dir = f"{p['output'].rstrip('/')}-swift"
    preset = SWIFT_PRESETS.get((p["zero_stage"], p["offload_optimizer"], p["offload_param"]))
    flags = [("model", _shown(p["model"]))]
    # dslab-tiny's config names Qwen2ForCausalLM, which several swift model types share; its template is ChatML
    flags += [("model_type", "qwen2"), ("template", "chatml")] if p["default_model"] else []
    flags += [("dataset", str(Path(work_dir) / DATA_FILE)), ("model_name", p["model_name"]),
              ("model_author", p["model_author"]), ("max_length", p["max_length"]), ("truncation_strategy", "right"),
              ("tuner_type", "full" if p["full"] else "lora")]
    if not p["full"]:
        flags += [("lora_rank", p["lora_r"]), ("lora_alpha", _num(p["lora_alpha"])), ("lora_dropout", p["lora_dropout"]),
                  ("target_modules", p["target_modules"])]
    flags += [("deepspeed", preset or str(Path(work_dir) / "ds_config.json")),
              ("per_device_train_batch_size", p["micro_batch_size"]),
              ("gradient_accumulation_steps", p["grad_accum_steps"]), ("num_train_epochs", p["epochs"]),
              ("learning_rate", p["lr"])]
    if p["scheduler"] == "WarmupCosineLR":
        flags += [("lr_scheduler_type", "cosine_with_min_lr"),
                  ("lr_scheduler_kwargs", json.dumps({"min_lr_rate": p["min_lr_ratio"]}))]
    else:
        flags += [("lr_scheduler_type", "constant")]
    flags += [("warmup_steps", p["warmup_steps"]), ("weight_decay", p["weight_decay"]), ("adam_beta1", p["betas"][0]),
              ("adam_beta2", p["betas"][1]), ("adam_epsilon", p["eps"]), ("max_grad_norm", p["max_grad_norm"]),
              # dslab loads fp32 weights and lets DeepSpeed cast them; swift would infer fp16 from float32
              ("torch_dtype", "float32"), ("bf16", p["precision"] == "bf16"), ("fp16", p["precision"] == "fp16"),
              ("gradient_checkpointing", p["gradient_checkpointing"])]
    flags += [("gradient_checkpointing_kwargs", json.dumps({"use_reentrant": False}))] if p["gradient_checkpointing"] else []
    flags += [("seed", p["seed"]), ("data_seed", p["seed"]), ("logging_steps", p["log_every"])]
    flags += [("save_steps", p["save_every"])] if p["save_every"] else []
    flags += [("output_dir", p["output"])]
    lines = ["# ms-swift 4.6.0 (`swift sft`) for this dslab run.", summary(p), "#",
             "# swift's --model_name/--model_author fill {{NAME}}/{{AUTHOR}} in its own swift/self-cognition data only,",
             f"# while dslab fills {{name}}/{{author}} in its files: so the chats are written first ({DATA_FILE}:",
             "# names filled, general dialogue mixed in), and the two flags stay for when you add swift/self-cognition."]
    if preset:
        lines.append(f"# --deepspeed {preset}: swift's own ZeRO-{p['zero_stage']} config; its bucket sizes are \"auto\""
                     " (hidden_size^2) where dslab's are sized for the tiny model.")
    else:
        lines.append(f"# swift has no preset for this ZeRO setup: the script writes dslab's config to "
                     f"{work_dir}/ds_config.json.")
    lines += _unmatched(p, "swift") + _export_command(p, work_dir)
    if not preset:
        lines += [f"cat > {shlex.quote(str(Path(work_dir) / 'ds_config.json'))} <<'EOF'",
                  json.dumps(trainer_ds_config(p["ds_config"]), indent=2, sort_keys=True), "EOF"]
    command = [f"NPROC_PER_NODE={p['world_size']} swift sft \\"]
    for key, value in flags:
        values = value if isinstance(value, list) else [value]
        shown = [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
        command.append(f"    --{key} {' '.join(shlex.quote(v) for v in shown)} \\")
    command[-1] = command[-1][:-2]
    return "\n".join(lines + command) + "\n"


def llamafactory(plan):
    """A shell script that writes the chats, dataset_info.json, the DeepSpeed JSON and the YAML next to each other,
    then runs `llamafactory-cli train` (LLaMA-Factory 0.9.5)."""
    p = plan
    work_dir = f"{p['output'].rstrip('/')}-llamafactory"
    ds_file = f"ds_z{p['zero_stage']}{'_offload' if p['offload_optimizer'] or p['offload_param'] else ''}_config.json"
    dataset_info = {"dslab_sft": {"file_name": DATA_FILE, "formatting": "sharegpt", "columns": {"messages": "messages"},
                                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                           "assistant_tag": "assistant", "system_tag": "system"}}}
    keys = [("model_name_or_path", _shown(p["model"])), ("stage", "sft"), ("do_train", True),
            ("finetuning_type", "full" if p["full"] else "lora")]
    if not p["full"]:
        keys += [("lora_rank", p["lora_r"]), ("lora_alpha", _num(p["lora_alpha"])), ("lora_dropout", p["lora_dropout"]),
                 ("lora_target", ",".join(p["target_modules"]))]
    keys += [("deepspeed", str(Path(work_dir) / ds_file)), ("dataset", "dslab_sft"), ("dataset_dir", work_dir),
             ("template", "chatml"), ("cutoff_len", p["max_length"]), ("output_dir", p["output"]),
             ("per_device_train_batch_size", p["micro_batch_size"]),
             ("gradient_accumulation_steps", p["grad_accum_steps"]), ("num_train_epochs", p["epochs"]),
             ("learning_rate", p["lr"])]
    if p["scheduler"] == "WarmupCosineLR":
        keys += [("lr_scheduler_type", "cosine_with_min_lr"), ("lr_scheduler_kwargs", {"min_lr_rate": p["min_lr_ratio"]})]
    else:
        keys += [("lr_scheduler_type", "constant")]
    keys += [("warmup_steps", p["warmup_steps"]), ("weight_decay", p["weight_decay"]), ("adam_beta1", p["betas"][0]),
             ("adam_beta2", p["betas"][1]), ("adam_epsilon", p["eps"]), ("max_grad_norm", p["max_grad_norm"])]
    keys += [(p["precision"], True)] if p["precision"] != "fp32" else []
    # LLaMA-Factory checkpoints activations unless told not to; dslab only with --gradient-checkpointing
    keys += [("use_reentrant_gc", False)] if p["gradient_checkpointing"] else [("disable_gradient_checkpointing", True)]
    keys += [("seed", p["seed"]), ("logging_steps", p["log_every"])]
    keys += [("save_steps", p["save_every"])] if p["save_every"] else [("save_strategy", "no")]
    keys += [("report_to", "none")]
    yaml_lines = [f"{key}: {_yaml_value(value)}" for key, value in keys]
    lines = ["# LLaMA-Factory 0.9.5 (`llamafactory-cli train`) for this dslab run.", summary(p), "#",
             "# LLaMA-Factory has no --model_name/--model_author (its data/identity.json has {{name}}/{{author}} to",
             (f"# replace by hand): the chats are written with {' / '.join(p['model_name'])} and "
              f"{' / '.join(p['model_author'])} already filled in, as dslab fills them."),
             "# template chatml: dslab-tiny's chat template (ChatML, no system prompt); another model takes its own.",
             (f"# LLaMA-Factory loads the base weights in the compute dtype ({p['precision']}); dslab loads fp32 and "
              "DeepSpeed casts them."), *_unmatched(p, "LLaMA-Factory"), *_export_command(p, work_dir),
             f"cat > {shlex.quote(str(Path(work_dir) / 'dataset_info.json'))} <<'EOF'",
             json.dumps(dataset_info, indent=2), "EOF",
             f"cat > {shlex.quote(str(Path(work_dir) / ds_file))} <<'EOF'",
             json.dumps(trainer_ds_config(p["ds_config"]), indent=2, sort_keys=True), "EOF",
             f"cat > {shlex.quote(str(Path(work_dir) / 'dslab_sft.yaml'))} <<'EOF'", *yaml_lines, "EOF",
             (f"FORCE_TORCHRUN=1 NPROC_PER_NODE={p['world_size']} llamafactory-cli train "
              f"{shlex.quote(str(Path(work_dir) / 'dslab_sft.yaml'))}")]
    return "\n".join(lines) + "\n"


def _yaml_value(value):
    """One YAML scalar or flow mapping, typed as LLaMA-Factory's dataclasses expect."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _yaml_num(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar
