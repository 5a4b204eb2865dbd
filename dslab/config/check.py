"""Check DeepSpeed config dicts before a run: every problem names its key, what is wrong and the fix.

DeepSpeed silently ignores keys it does not read and fails late (or not at all) on many wrong values;
check_config finds them all at once, against the keys the installed DeepSpeed reads (dslab.config.keys)
and its own pydantic validation. `dslab config check FILE` prints the same list.
"""
import difflib
import json
import os
import re
from dataclasses import dataclass

from dslab.config.keys import optimizer_param_keys, schema, signature_keys
from dslab.messages import say
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a config: the dotted key, what is wrong, and how to fix it."""
    key: str
    problem: str
    fix: str

    def __str__(self):
        return f"{self.key or '(config)'}: {self.problem}\n    {say('problem.fix')}: {self.fix}"


class ConfigError(ValueError):
    """A DeepSpeed config that would fail (or silently misbehave); .problems lists every issue."""

    def __init__(self, message, problems=()):
        self.problems = list(problems)
        super().__init__(message)

    @classmethod
    def from_problems(cls, problems, source=None):
        n = len(problems)
        header = say("problems.header", n=n, s="s" if n != 1 else "", source=source or say("problems.source"))
        lines = [header] + [f"  {p}" for p in problems]
        return cls("\n".join(lines), problems)


def check_config(cfg, world_size=None, device=None, allow_auto=False):
    """Every problem in `cfg` (an empty list when it is fine).

    world_size: ranks the config will run on (default: $WORLD_SIZE, else 1).
    device: accelerator to check precision support against: None detects this machine's, a name
    ("cpu", "cuda") assumes that one, "any" skips hardware checks.
    allow_auto: accept "auto" values (the config goes to transformers' Trainer, which fills them).
    """
    if not isinstance(cfg, dict):
        return [Problem("", say("check.not_a_dict", kind=type(cfg).__name__), say("check.not_a_dict.fix"))]
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
    """(world_size, where it came from): the argument, else $WORLD_SIZE, else 1. An argument below 1 raises
    ConfigError: no config fits no ranks."""
    if world_size is not None:
        if not int(world_size) >= 1:
            raise ConfigError(say("launch.world_size", world_size=world_size))
        return int(world_size), say("world.argument")
    env = os.environ.get("WORLD_SIZE", "")
    if env.strip().isdigit() and int(env) > 0:
        return int(env), say("world.env")
    return 1, say("world.default")


def summary(cfg, world_size=None):
    """Two short lines: ZeRO stage, precision and offload; then the batch triple."""
    zero = cfg.get("zero_optimization") or {}
    precision = ("bf16" if _enabled(cfg, "bf16") or _enabled(cfg, "bfloat16")
                 else "fp16" if _enabled(cfg, "fp16") else "fp32")
    parts = [say("describe.stage", stage=zero.get("stage", 0)), precision]
    for what in ("optimizer", "param"):
        device = (zero.get(f"offload_{what}") or {}).get("device", "none")
        if device != "none":
            parts.append(say("describe.offload", what=what, device=device))
    world, source = resolve_world_size(world_size)
    total, micro, accum = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps"))
    if all(isinstance(v, int) or v is None for v in (total, micro, accum)):
        accum = accum or 1
        micro = micro or total // world // accum
        if total is None:
            total = say("describe.computed", total=micro * accum * world)
    batch = say("describe.batch", total=total, micro=micro, accum=accum, world=world, source=source)
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
                problems.add(path, say("check.auto"), say("check.auto.fix"))
        elif _NUMBER.fullmatch(value.strip()):
            problems.add(path, say("check.number_as_string", value=value.strip(), quoted=json.dumps(value)),
                         say("check.remove_quotes", value=value.strip()))
        elif value.strip().lower() in ("true", "false"):
            problems.add(path, say("check.bool_as_string", value=value.strip().lower(), quoted=json.dumps(value)),
                         say("check.remove_quotes", value=value.strip().lower()))


def _walk(value, section, path, problems):
    """Unknown or misspelled keys, deprecated keys and value types, level by level."""
    for key, item in value.items():
        where = _join(path, key)
        if key not in section["keys"]:
            removed = section["removed"].get(key)
            if removed:
                problems.add(where, say("check.removed", why=removed), say("check.delete", key=where))
                continue
            hint = difflib.get_close_matches(str(key), sorted(section["keys"]), n=1, cutoff=0.6)
            level = say("check.level.in", path=path) if path else say("check.level.top")
            problems.add(where, say("check.unknown_key.refused", key=key, level=level) if section["refuses_unknown"]
                         else say("check.unknown_key", key=key, level=level),
                         say("check.did_you_mean", hint=_join(path, hint[0])) if hint else
                         say("check.unknown_key.fix", level=level, keys=", ".join(sorted(section["keys"]))))
            continue
        if key in section["deprecated"]:
            problems.add(where, say("check.deprecated"), say("check.use_instead", new=section["deprecated"][key]))
            continue
        if where in problems.keys:
            continue
        kind = section["kinds"].get(key)
        _check_kind(item, kind, where, problems)
        child = section["children"].get(key)
        if child is not None and isinstance(item, dict):
            _walk(item, child, where, problems)
        elif child is not None and item is not None and not isinstance(item, bool):
            problems.add(where, say("check.not_object", value=_show(item)), say("check.not_object.fix", key=where))


def _check_kind(value, kind, where, problems):
    if kind is None or value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return
    if kind == "bool" and not isinstance(value, bool):
        problems.add(where, say("check.bool", value=_show(value)), say("check.bool.fix"))
    elif kind in ("int", "posint"):
        whole = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        if not whole:
            problems.add(where, say("check.int", value=_show(value)), say("check.int.fix"))
        elif kind == "posint" and value < 1:
            problems.add(where, say("check.posint", value=_show(value)), say("check.posint.fix"))
    elif kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        problems.add(where, say("check.float", value=_show(value)), say("check.float.fix"))
    elif kind == "str" and not isinstance(value, str):
        problems.add(where, say("check.str", value=_show(value)), say("check.str.fix"))


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
                        problems.add(where, say("check.rejects", msg=err["msg"]), say("check.rejects.fix"))
            except (AssertionError, ValueError, TypeError) as exc:
                problems.add(key, say("check.rejects_section", msg=exc), say("check.rejects_section.fix"))
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
        problems.add("train_micro_batch_size_per_gpu", say("check.no_batch"), say("check.no_batch.fix"))
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
            fits = say("check.batch.fits", total=total, world=total // (micro * accum))
        suggested = max(micro, 1) * max(accum, 1) * world
        problems.add("train_batch_size", say("check.batch", total=total, micro=micro, accum=accum, world=world,
                                             product=product, source=source, fits=fits),
                     say("check.batch.fix", suggested=suggested))


def _offload_device(zero, what):
    block = zero.get(f"offload_{what}")
    if not isinstance(block, dict):
        return None
    device = block.get("device", "none")
    return None if device == "none" else device


def _check_zero(cfg, problems):
    zero = cfg.get("zero_optimization")
    if isinstance(zero, bool):
        problems.add("zero_optimization", say("check.zero_bool"), say("check.zero_bool.fix"))
        return
    if not isinstance(zero, dict):
        return
    stage = zero.get("stage", 0)
    if "zero_optimization.stage" not in problems.keys:
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            problems.add("zero_optimization.stage", say("check.zero_stage", value=_show(stage)),
                         say("check.zero_stage.fix"))
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
            problems.add(where + ".device", say("check.offload_device", value=_show(device)),
                         say("check.offload_device.fix"))
            continue
        if device == "nvme" and not block.get("nvme_path"):
            problems.add(where + ".nvme_path", say("check.nvme_path"), say("check.nvme_path.fix", key=where))
    if stage is None:
        return
    if _offload_device(zero, "param") and stage != 3:
        problems.add("zero_optimization.offload_param", say("check.offload_param", stage=stage),
                     say("check.offload_param.fix"))
    if _offload_device(zero, "optimizer") and stage == 0:
        problems.add("zero_optimization.offload_optimizer", say("check.offload_optimizer"),
                     say("check.offload_optimizer.fix"))


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
        problems.add("bfloat16", say("check.bfloat16_name"), say("check.bfloat16_name.fix"))
    if fp16 and bf16:
        problems.add("fp16.enabled", say("check.fp16_and_bf16", bf16_key=bf16_key), say("check.fp16_and_bf16.fix"))
        return
    if device == "any" or not (fp16 or bf16):
        return
    name, fp16_ok, bf16_ok, detail = device_support(device)
    if fp16 and fp16_ok is False:
        why = say("check.fp16_cpu") if name == "cpu" else say("check.fp16_device", detail=detail)
        problems.add("fp16.enabled", say("check.fp16", why=why), say("check.fp16.fix"))
    if bf16 and bf16_ok is False:
        problems.add(bf16_key, say("check.bf16", detail=detail), say("check.bf16.fix"))


def _check_params(params, known, where, problems):
    if not isinstance(params, dict) or not known:
        return
    for key in params:
        if key not in known and _join(where, key) not in problems.keys:
            hint = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            problems.add(_join(where, key), say("check.unknown_param", key=key),
                         say("check.did_you_mean", hint=_join(where, hint[0])) if hint
                         else say("check.use_one_of", choices=", ".join(sorted(known - {"max_grad_norm"}))))


def _check_optimizer(cfg, problems):
    block = cfg.get("optimizer")
    if not isinstance(block, dict) or "optimizer.type" in problems.keys:
        return
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = block.get("type")
    if name is None:
        problems.add("optimizer.type", say("check.optimizer_no_type"), say("check.optimizer_no_type.fix"))
        return
    if not isinstance(name, str):
        return
    torch_names = [n for n in dir(torch.optim) if n[:1].isupper() and n != "Optimizer"]
    if name.lower() not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, name):
        choices = ["Adam", "AdamW", "Adagrad", "Lamb", "Lion"] + torch_names
        hint = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
        problems.add("optimizer.type", say("check.optimizer_unknown", name=name, own=", ".join(DEEPSPEED_OPTIMIZERS)),
                     say("check.did_you_mean", hint=hint[0]) if hint else say("check.use_adamw"))
        return
    params = block.get("params")
    if isinstance(params, dict) and "max_grad_norm" in params:
        problems.add("optimizer.params.max_grad_norm", say("check.max_grad_norm"), say("check.max_grad_norm.fix"))
    lr = params.get("lr") if isinstance(params, dict) else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not 0 <= lr < float("inf"):  # NaN too
        problems.add("optimizer.params.lr", say("check.lr", value=lr), say("check.lr.fix"))
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
        problems.add("scheduler.type", say("check.scheduler_no_type"), say("check.scheduler_no_type.fix"))
        return
    if hasattr(lr_schedules, name):
        dotted = f"deepspeed.runtime.lr_schedules.{name}"
    elif hasattr(torch.optim.lr_scheduler, name):
        dotted = f"torch.optim.lr_scheduler.{name}"
    else:
        hint = difflib.get_close_matches(name, lr_schedules.VALID_LR_SCHEDULES, n=1, cutoff=0.6)
        problems.add("scheduler.type", say("check.scheduler_unknown", name=name),
                     say("check.did_you_mean", hint=hint[0]) if hint else
                     say("check.scheduler_unknown.fix", choices=", ".join(lr_schedules.VALID_LR_SCHEDULES)))
        return
    _check_params(block.get("params"), signature_keys([dotted]), "scheduler.params", problems)


