"""Check DeepSpeed config dicts before a run: every problem names its key, what is wrong and the fix.

DeepSpeed silently ignores keys it does not read and fails late (or not at all) on many wrong values;
check_config finds them all at once, against the keys the installed DeepSpeed reads (dslab.config_keys)
and its own pydantic validation. `dslab config check FILE` prints the same list.
"""
import difflib
import json
import os
import re
from dataclasses import dataclass

from dslab.config_keys import optimizer_param_keys, schema, signature_keys

_AUTO_FIX = ('replace it with the value itself (a number, true/false, ...), or pass the config to '
             'transformers\' Trainer (TrainingArguments(deepspeed=...)), which fills every "auto" from its '
             'arguments; check such a file with `dslab config check --hf-trainer`')
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a config: the dotted key, what is wrong, and how to fix it."""
    key: str
    problem: str
    fix: str

    def __str__(self):
        return f"{self.key or '(config)'}: {self.problem}\n    fix: {self.fix}"


class ConfigError(ValueError):
    """A DeepSpeed config that would fail (or silently misbehave); .problems lists every issue."""

    def __init__(self, message, problems=()):
        self.problems = list(problems)
        super().__init__(message)

    @classmethod
    def from_problems(cls, problems, source="the DeepSpeed config"):
        n = len(problems)
        lines = [f"{n} problem{'s' if n != 1 else ''} in {source}:"] + [f"  {p}" for p in problems]
        return cls("\n".join(lines), problems)


def check_config(cfg, world_size=None, device=None, allow_auto=False):
    """Every problem in `cfg` (an empty list when it is fine).

    world_size: ranks the config will run on (default: $WORLD_SIZE, else 1).
    device: accelerator to check precision support against: None detects this machine's, a name
    ("cpu", "cuda") assumes that one, "any" skips hardware checks.
    allow_auto: accept "auto" values (the config goes to transformers' Trainer, which fills them).
    """
    if not isinstance(cfg, dict):
        return [Problem("", f"a DeepSpeed config is a dict (JSON object), got {type(cfg).__name__}",
                        "pass a dict such as dslab.config.make_config(...) or dslab.config.load_config(path)")]
    problems = _Problems()
    deepspeed_keys = schema()
    _scan_values(cfg, "", problems, allow_auto or deepspeed_keys["auto_ok"])
    _walk(cfg, deepspeed_keys["top"], "", problems)
    _check_batch(cfg, world_size, problems)
    _check_zero(cfg, problems)
    _check_precision(cfg, device, problems)
    _check_optimizer(cfg, problems)
    _check_scheduler(cfg, problems)
    _validate_models(cfg, deepspeed_keys["models"], problems)  # last: DeepSpeed's messages for the rest
    return problems.items


def validate(cfg, world_size=None, device=None, allow_auto=False):
    """Raise ConfigError listing every problem; return cfg unchanged when there is none."""
    problems = check_config(cfg, world_size=world_size, device=device, allow_auto=allow_auto)
    if problems:
        raise ConfigError.from_problems(problems)
    return cfg


def resolve_world_size(world_size=None):
    """(world_size, where it came from): the argument, else $WORLD_SIZE, else 1."""
    if world_size is not None:
        return int(world_size), "the world_size argument (--world-size)"
    env = os.environ.get("WORLD_SIZE", "")
    if env.strip().isdigit() and int(env) > 0:
        return int(env), "the WORLD_SIZE environment variable"
    return 1, "the default (no world_size given and WORLD_SIZE unset)"


def describe(cfg, world_size=None):
    """Two short lines: ZeRO stage, precision and offload; then the batch triple."""
    zero = cfg.get("zero_optimization") or {}
    precision = ("bf16" if _enabled(cfg, "bf16") or _enabled(cfg, "bfloat16")
                 else "fp16" if _enabled(cfg, "fp16") else "fp32")
    parts = [f"ZeRO stage {zero.get('stage', 0)}", precision]
    for what in ("optimizer", "param"):
        device = (zero.get(f"offload_{what}") or {}).get("device", "none")
        if device != "none":
            parts.append(f"offload {what} -> {device}")
    world, source = resolve_world_size(world_size)
    total, micro, accum = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps"))
    if all(isinstance(v, int) or v is None for v in (total, micro, accum)):
        accum = accum or 1
        micro = micro or total // world // accum
        if total is None:
            total = f"{micro * accum * world} (computed by DeepSpeed)"
    batch = (f"batch: train_batch_size {total} = micro {micro} x accum {accum} x world {world}; "
             f"world_size {world} came from {source}")
    return ", ".join(parts) + "\n" + batch


class _Problems:
    """Problems in the order found, and the keys they name (later checks skip keys already reported)."""

    def __init__(self):
        self.items = []
        self.keys = set()

    def add(self, key, problem, fix):
        self.keys.add(key)
        self.items.append(Problem(key, problem, fix))


def _join(path, key):
    return f"{path}.{key}" if path else str(key)


def _show(value):
    return json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _enabled(cfg, section):
    block = cfg.get(section)
    return isinstance(block, dict) and block.get("enabled") is True


def _scan_values(value, path, problems, allow_auto):
    """"auto" placeholders and numbers written as strings, anywhere in the config.

    allow_auto: True, or the keys for which "auto" is one of DeepSpeed's own values.
    """
    if isinstance(value, dict):
        for key, item in value.items():
            _scan_values(item, _join(path, key), problems, allow_auto)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _scan_values(item, f"{path}[{i}]", problems, allow_auto)
    elif isinstance(value, str):
        if value.strip().lower() == "auto":
            if allow_auto is not True and path.rpartition(".")[2] not in allow_auto:
                problems.add(path, '"auto" is a placeholder that only transformers\' Trainer fills in; '
                             'deepspeed.initialize does not: inside sections DeepSpeed quietly uses its default, '
                             'elsewhere it fails later with a confusing error', _AUTO_FIX)
        elif _NUMBER.fullmatch(value.strip()):
            problems.add(path, f"the number {value.strip()} is written as a string ({json.dumps(value)})",
                         f"remove the quotes: {value.strip()}")
        elif value.strip().lower() in ("true", "false"):
            problems.add(path, f"the boolean {value.strip().lower()} is written as a string ({json.dumps(value)})",
                         f"remove the quotes: {value.strip().lower()}")


def _walk(value, section, path, problems):
    """Unknown or misspelled keys, deprecated keys and value types, level by level."""
    for key, item in value.items():
        where = _join(path, key)
        if key not in section["keys"]:
            removed = section["removed"].get(key)
            if removed:
                problems.add(where, f"DeepSpeed removed this option: {removed}", f"delete {where!r}")
                continue
            hint = difflib.get_close_matches(str(key), sorted(section["keys"]), n=1, cutoff=0.6)
            level = f"in {path!r}" if path else "at the top level"
            problems.add(where, f"unknown key {key!r} {level}; DeepSpeed silently ignores keys it does not know",
                         f"did you mean {_join(path, hint[0])!r}?" if hint else
                         f"delete it, or check the spelling against DeepSpeed's config docs ({level} it reads: "
                         f"{', '.join(sorted(section['keys']))})")
            continue
        if key in section["deprecated"]:
            problems.add(where, "deprecated: DeepSpeed still reads it but warns and may drop it",
                         f"use {section['deprecated'][key]!r} instead")
            continue
        if where in problems.keys:
            continue
        kind = section["kinds"].get(key)
        _check_kind(item, kind, where, problems)
        child = section["children"].get(key)
        if child is not None and isinstance(item, dict):
            _walk(item, child, where, problems)
        elif child is not None and item is not None and not isinstance(item, bool):
            problems.add(where, f"must be a JSON object {{...}}, got {_show(item)}",
                         f"write it as an object, e.g. {where!r}: {{...}}")


def _check_kind(value, kind, where, problems):
    if kind is None or value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return
    if kind == "bool" and not isinstance(value, bool):
        problems.add(where, f"must be true or false, got {_show(value)}", "write true or false (no quotes)")
    elif kind in ("int", "posint"):
        whole = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        if not whole:
            problems.add(where, f"must be a whole number, got {_show(value)}", "write an integer such as 4 (no quotes)")
        elif kind == "posint" and value < 1:
            problems.add(where, f"must be at least 1, got {_show(value)}", "use a positive integer")
    elif kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        problems.add(where, f"must be a number, got {_show(value)}", "write a number such as 1.0 (no quotes)")
    elif kind == "str" and not isinstance(value, str):
        problems.add(where, f"must be a string, got {_show(value)}", "write it in double quotes")


def _validate_models(cfg, models, problems):
    """Run DeepSpeed's own pydantic validation of each section (ranges, enums, cross-field rules)."""
    import pydantic
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel("ERROR")  # deprecated-field warnings are reported as problems instead
    try:
        for key, model in models.items():
            block = cfg.get(key)
            if not isinstance(block, dict):
                continue
            try:
                model(**block)
            except pydantic.ValidationError as exc:
                for err in exc.errors():
                    where = ".".join([key] + [str(p) for p in err["loc"]])
                    if not any(where == k or where.startswith(k + ".") for k in problems.keys):
                        problems.add(where, f"DeepSpeed rejects this: {err['msg']}",
                                     "change the value as the message says (see DeepSpeed's config docs)")
            except (AssertionError, ValueError, TypeError) as exc:
                problems.add(key, f"DeepSpeed rejects this section: {exc}", "change the values the message names")
    finally:
        logger.setLevel(level)


def _check_batch(cfg, world_size, problems):
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if any(k in problems.keys for k in keys):
        return
    total, micro, accum = (cfg.get(k) for k in keys)
    if any(v is not None and not isinstance(v, int) for v in (total, micro, accum)):
        return  # already reported, or "auto" allowed for the HF Trainer
    world, source = resolve_world_size(world_size)
    if total is None and micro is None:
        problems.add("train_micro_batch_size_per_gpu", "neither train_batch_size nor train_micro_batch_size_per_gpu "
                     "is set; DeepSpeed needs one of them", "set train_micro_batch_size_per_gpu (e.g. 4)")
        return
    if total is None:
        return  # DeepSpeed computes micro x accum x world
    # DeepSpeed fills the missing ones by integer division, then insists on the product.
    if micro is None:
        accum = accum or 1
        micro = total // world // accum
    elif accum is None:
        accum = total // micro // world
    product = micro * accum * world
    if total != product or micro < 1 or accum < 1:
        fits = ""
        if micro >= 1 and accum >= 1 and total % (micro * accum) == 0 and total // (micro * accum) != world:
            fits = f"; {total} would fit world_size {total // (micro * accum)}"
        suggested = max(micro, 1) * max(accum, 1) * world
        problems.add(
            "train_batch_size",
            f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
            f"{accum} x world_size {world} = {product}; world_size {world} came from {source}{fits}",
            f"set train_batch_size to {suggested}, or remove it so DeepSpeed computes micro x accum x world; "
            "if the config is for another number of ranks, pass that world size (--world-size N)")


def _offload_device(zero, what):
    block = zero.get(f"offload_{what}")
    if not isinstance(block, dict):
        return None
    device = block.get("device", "none")
    return None if device == "none" else device


def _check_zero(cfg, problems):
    zero = cfg.get("zero_optimization")
    if isinstance(zero, bool):
        problems.add("zero_optimization", "the old boolean form (true/false) is deprecated",
                     'write an object with the stage, e.g. "zero_optimization": {"stage": 1}')
        return
    if not isinstance(zero, dict):
        return
    stage = zero.get("stage", 0)
    if "zero_optimization.stage" not in problems.keys:
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            problems.add("zero_optimization.stage", f"ZeRO stage must be 0, 1, 2 or 3, got {_show(stage)}",
                         "use 0 (plain data parallel), 1 (partition optimizer states), 2 (+ gradients) "
                         "or 3 (+ parameters)")
            stage = None
    else:
        stage = None
    for what in ("optimizer", "param"):
        where = f"zero_optimization.offload_{what}"
        block = zero.get(f"offload_{what}")
        if not isinstance(block, dict) or where + ".device" in problems.keys:
            continue
        device = block.get("device", "none")
        if device not in ("cpu", "nvme", "none"):
            problems.add(where + ".device", f"offload device must be \"cpu\" or \"nvme\", got {_show(device)}",
                         'use "cpu" (or "nvme" with nvme_path; "none" turns offload off)')
            continue
        if device == "nvme" and not block.get("nvme_path"):
            problems.add(where + ".nvme_path", "device \"nvme\" needs nvme_path, the directory on the fast disk",
                         f'add "nvme_path": "/local_nvme" to {where}, or use device "cpu"')
    if stage is None:
        return
    if _offload_device(zero, "param") and stage != 3:
        problems.add("zero_optimization.offload_param",
                     f"offload_param needs ZeRO stage 3 (parameters are only partitioned there), stage is {stage}",
                     "set zero_optimization.stage to 3, or remove offload_param (offload_optimizer works "
                     "with stages 1-3)")
    if _offload_device(zero, "optimizer") and stage == 0:
        problems.add("zero_optimization.offload_optimizer",
                     "offload_optimizer needs ZeRO stage 1, 2 or 3; with stage 0 it does nothing",
                     "set zero_optimization.stage to 1, 2 or 3, or remove offload_optimizer")


def device_support(device):
    """What an accelerator offers for 16-bit training: (name, fp16 ok, bf16 ok, detail); ok is None when unknown.

    device: None for this machine's accelerator (asked from DeepSpeed), or a name ("cpu", "cuda") to assume.
    """
    from deepspeed.accelerator import get_accelerator

    here = get_accelerator()
    name = here.device_name() if device is None else device
    if name != here.device_name():
        return name, (name != "cpu"), (True if name == "cpu" else None), f"assumed {name}"
    if name == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        # torch's default also counts slow emulated bf16; DeepSpeed needs the real thing (Ampere, sm_80+)
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        detail = f"{props.name}, compute capability {props.major}.{props.minor}"
        return name, bool(here.is_fp16_supported()), bf16, detail
    return name, bool(here.is_fp16_supported()), bool(here.is_bf16_supported()), f"the {name} accelerator"


def _check_precision(cfg, device, problems):
    fp16, bf16 = _enabled(cfg, "fp16"), _enabled(cfg, "bf16") or _enabled(cfg, "bfloat16")
    bf16_key = "bfloat16.enabled" if _enabled(cfg, "bfloat16") else "bf16.enabled"
    if "bfloat16" in cfg and "bf16" not in cfg and "bfloat16" not in problems.keys:
        problems.add("bfloat16", '"bfloat16" is the old name of the section', 'rename it to "bf16"')
    if fp16 and bf16:
        problems.add("fp16.enabled", f"fp16.enabled and {bf16_key} are both true; DeepSpeed trains in one 16-bit "
                     "format", "keep one: bf16 on CPUs and Ampere-or-newer GPUs, fp16 on older GPUs "
                     "(set the other's enabled to false)")
        return
    if device == "any" or not (fp16 or bf16):
        return
    name, fp16_ok, bf16_ok, detail = device_support(device)
    if fp16 and fp16_ok is False:
        why = ("DeepSpeed's CPU accelerator has no fp16 training" if name == "cpu"
               else f"{detail} has no fp16 support")
        problems.add("fp16.enabled", f"fp16 is enabled but {why}; deepspeed.initialize would stop later with "
                     "'Type fp16 is not supported on your device.'",
                     "use bf16 (bf16.enabled true, fp16.enabled false) or fp32 (both false); fp16 needs a GPU")
    if bf16 and bf16_ok is False:
        problems.add(bf16_key, f"bf16 is enabled but {detail} has no native bf16 (it needs an Ampere or newer GPU)",
                     "use fp16 instead (fp16.enabled true, bf16.enabled false), or fp32")


def _check_params(params, known, where, problems):
    if not isinstance(params, dict) or not known:
        return
    for key in params:
        if key not in known and _join(where, key) not in problems.keys:
            hint = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            problems.add(_join(where, key), f"unknown parameter {key!r}; the optimizer/scheduler would fail with "
                         "an unexpected keyword argument", f"did you mean {_join(where, hint[0])!r}?" if hint
                         else f"use one of: {', '.join(sorted(known - {'max_grad_norm'}))}")


def _check_optimizer(cfg, problems):
    block = cfg.get("optimizer")
    if not isinstance(block, dict) or "optimizer.type" in problems.keys:
        return
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = block.get("type")
    if name is None:
        problems.add("optimizer.type", "the optimizer section has no type, so DeepSpeed ignores it",
                     'add "type": "AdamW" (or remove the section and pass an optimizer to deepspeed.initialize)')
        return
    if not isinstance(name, str):
        return
    torch_names = [n for n in dir(torch.optim) if n[:1].isupper() and n != "Optimizer"]
    if name.lower() not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, name):
        choices = ["Adam", "AdamW", "Adagrad", "Lamb", "Lion"] + torch_names
        hint = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
        problems.add("optimizer.type", f"DeepSpeed knows no optimizer {name!r} (its own: "
                     f"{', '.join(DEEPSPEED_OPTIMIZERS)}; or a torch.optim class name)",
                     f"did you mean {hint[0]!r}?" if hint else 'use "AdamW"')
        return
    params = block.get("params")
    if isinstance(params, dict) and "max_grad_norm" in params:
        problems.add("optimizer.params.max_grad_norm", "DeepSpeed refuses max_grad_norm as an optimizer parameter",
                     'remove it and set the top-level "gradient_clipping" instead')
    known = optimizer_param_keys(name)
    if known:  # empty: this optimizer's parameters are not checked
        _check_params(params, known | {"max_grad_norm"}, "optimizer.params", problems)


def _check_scheduler(cfg, problems):
    block = cfg.get("scheduler")
    if not isinstance(block, dict) or "scheduler.type" in problems.keys:
        return
    import torch
    from deepspeed.runtime import lr_schedules

    name = block.get("type")
    if not isinstance(name, str):
        problems.add("scheduler.type", "the scheduler section has no type, so DeepSpeed ignores it",
                     'add "type": "WarmupLR" (or remove the section)')
        return
    if hasattr(lr_schedules, name):
        dotted = f"deepspeed.runtime.lr_schedules.{name}"
    elif hasattr(torch.optim.lr_scheduler, name):
        dotted = f"torch.optim.lr_scheduler.{name}"
    else:
        hint = difflib.get_close_matches(name, lr_schedules.VALID_LR_SCHEDULES, n=1, cutoff=0.6)
        problems.add("scheduler.type", f"DeepSpeed knows no LR scheduler {name!r}",
                     f"did you mean {hint[0]!r}?" if hint else
                     f"use one of {', '.join(lr_schedules.VALID_LR_SCHEDULES)} or a torch.optim.lr_scheduler class")
        return
    _check_params(block.get("params"), signature_keys([dotted]), "scheduler.params", problems)


