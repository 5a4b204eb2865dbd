"""Build and check DeepSpeed config dicts; every problem names its key, what is wrong and the fix."""
import copy
import difflib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
PRECISIONS = ("bf16", "fp16", "fp32")

# ZeRO buffers are sized in elements. DeepSpeed's defaults (5e8) allocate about 1 GB of bf16
# buffers, far more than the few-million-parameter models of this course: one bucket of 2**22
# elements holds all of dslab-tiny (4.0M parameters) and costs 8 MB in bf16. For multi-billion
# parameter models on GPUs, raise these (a common rule: hidden_size**2).
BUCKET_SIZE = 2**22
# ZeRO-3 keeps parameters smaller than this unpartitioned on every rank. DeepSpeed's default (1e5)
# would keep every 256 x 256 matrix of a tiny model whole, hiding what stage 3 does; 0 partitions all.
PARAM_PERSISTENCE_THRESHOLD = 0
# DeepSpeed logs a progress line every steps_per_print steps; the course prints its own losses.
STEPS_PER_PRINT = 1_000_000

# The ready-made files in dslab/configs/ (tests check each equals make_config(**these)).
# No train_batch_size in them (train_batch_size=None deletes it): DeepSpeed computes it as
# micro x accum x the number of ranks, so one file serves any world size.
BUNDLED = {
    "zero0": dict(zero_stage=0),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3),
    "zero2_offload": dict(zero_stage=2, offload_optimizer=True),
    "zero3_offload": dict(zero_stage=3, offload_optimizer=True, offload_param=True),
}
BUNDLED_DEFAULTS = dict(precision="bf16", micro_batch_size=4, grad_accum_steps=1, lr=1e-3, train_batch_size=None)

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


# --------------------------------------------------------------------------- building

def make_config(zero_stage=0, offload_optimizer=False, offload_param=False, precision="bf16",
                micro_batch_size=1, grad_accum_steps=1, world_size=None, lr=1e-3, **extra):
    """A DeepSpeed config dict for this setup; `extra` is deep-merged on top (a None value deletes a key).

    train_batch_size = micro_batch_size x grad_accum_steps x world_size, where world_size=None means
    $WORLD_SIZE (the deepspeed launcher sets it on every rank), else 1. Pass train_batch_size=None to
    leave it out and let DeepSpeed compute it from the number of ranks.
    """
    if precision not in PRECISIONS:
        hint = difflib.get_close_matches(str(precision), PRECISIONS, n=1)
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
                         + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    world, _ = resolve_world_size(world_size)
    cfg = {
        "train_batch_size": micro_batch_size * grad_accum_steps * world,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": 1.0,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "optimizer": {
            "type": "AdamW",
            # no weight decay: course runs are a few hundred steps, and results compare across stages
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_optimization": {"stage": zero_stage},
    }
    if precision == "fp16":
        # Dynamic loss scaling (loss_scale 0): start at 2**16, halve it when gradients overflow (after
        # `hysteresis` overflows), double it after 1000 steps without one.
        cfg["fp16"].update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                           min_loss_scale=1)
    if not offload_optimizer:
        # Plain torch.optim.AdamW: without this DeepSpeed picks FusedAdam, a C++/CUDA op built on first use.
        cfg["optimizer"]["params"]["torch_adam"] = True
    zero = cfg["zero_optimization"]
    if zero_stage in (1, 2, 3):
        zero.update(reduce_bucket_size=BUCKET_SIZE, allgather_bucket_size=BUCKET_SIZE)
    if zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=BUCKET_SIZE,
                    stage3_param_persistence_threshold=PARAM_PERSISTENCE_THRESHOLD,
                    # save_16bit_model() / HF save_model gather the partitioned weights into one file
                    stage3_gather_16bit_weights_on_model_save=True)
    if offload_optimizer:
        # Optimizer states live in CPU memory and DeepSpeedCPUAdam (the cpu_adam op) updates them there.
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = deep_merge(cfg, extra)
    validate(cfg, world_size=world, device="any")
    return cfg


def deep_merge(base, extra):
    """A copy of `base` with `extra` merged in: nested dicts merge, other values replace, None deletes."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def bundled_config(name):
    """The config make_config builds for one of the BUNDLED names (what dslab/configs/NAME.json holds)."""
    return make_config(**{**BUNDLED_DEFAULTS, **BUNDLED[name]})


def write_bundled(folder=CONFIG_DIR):
    """(Re)write every ready-made config file from make_config; returns the paths."""
    return [save_config(bundled_config(name), Path(folder) / f"{name}.json") for name in BUNDLED]


def config_path(name):
    """Path of a ready-made config in dslab/configs ("zero3_offload" or "zero3_offload.json")."""
    stem = name[:-5] if name.endswith(".json") else name
    if stem not in BUNDLED:
        hint = difflib.get_close_matches(stem, BUNDLED, n=1)
        raise FileNotFoundError(f"no ready-made config {name!r}; there are {', '.join(BUNDLED)}"
                                + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    return CONFIG_DIR / f"{stem}.json"


def to_json(cfg):
    """The config as JSON text: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def save_config(cfg, path):
    """Write the config as sorted JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(to_json(cfg))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it normal permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def load_config(path):
    """Read a JSON config; malformed JSON or a duplicated key raises ConfigError with file, line and column."""
    path = Path(path)
    text = path.read_text()

    def no_duplicates(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{path}: key {key!r} appears twice in the same object; JSON keeps only the "
                                  f"last one and DeepSpeed refuses the file. Keep one {key!r}.")
            seen[key] = value
        return seen

    try:
        cfg = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        lines = text.splitlines()
        line = lines[exc.lineno - 1] if exc.lineno <= len(lines) else ""
        raise ConfigError(
            f"{path}, line {exc.lineno}, column {exc.colno}: malformed JSON: {exc.msg}\n"
            f"    {line}\n    {' ' * (exc.colno - 1)}^\n"
            "    fix: JSON has no comments, no trailing commas, and needs double quotes around keys and strings"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object {{...}}, this file holds a "
                          f"{type(cfg).__name__}")
    return cfg


# --------------------------------------------------------------------------- checking

def check_config(cfg, world_size=None, device=None, allow_auto=False):
    """Every problem in `cfg` (an empty list when it is fine).

    world_size: ranks the config will run on (default: $WORLD_SIZE, else 1).
    device: accelerator to check precision support against: None detects this machine's, a name
    ("cpu", "cuda") assumes that one, "any" skips hardware checks.
    allow_auto: accept "auto" values (the config goes to transformers' Trainer, which fills them).
    """
    if not isinstance(cfg, dict):
        return [Problem("", f"a DeepSpeed config is a dict (JSON object), got {type(cfg).__name__}",
                        "pass a dict such as dslab.config.make_config(...) or load_config(path)")]
    problems = _Problems()
    schema = _schema()
    _scan_values(cfg, "", problems, allow_auto or schema["auto_ok"])
    _walk(cfg, schema["top"], "", problems)
    _check_batch(cfg, world_size, problems)
    _check_zero(cfg, problems)
    _check_precision(cfg, device, problems)
    _check_optimizer(cfg, problems)
    _check_scheduler(cfg, problems)
    _validate_models(cfg, schema, problems)  # last: DeepSpeed's own messages for anything not yet named
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


def _validate_models(cfg, schema, problems):
    """Run DeepSpeed's own pydantic validation of each section (ranges, enums, cross-field rules)."""
    import pydantic
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel("ERROR")  # deprecated-field warnings are reported as problems instead
    try:
        for key, model in schema["models"].items():
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


def _device_support(device):
    """(accelerator name, fp16 ok, bf16 ok, detail); ok is None when unknown."""
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
    name, fp16_ok, bf16_ok, detail = _device_support(device)
    if fp16 and fp16_ok is False:
        why = ("DeepSpeed's CPU accelerator has no fp16 training" if name == "cpu"
               else f"{detail} has no fp16 support")
        problems.add("fp16.enabled", f"fp16 is enabled but {why}; deepspeed.initialize would stop later with "
                     "'Type fp16 is not supported on your device.'",
                     "use bf16 (bf16.enabled true, fp16.enabled false) or fp32 (both false); fp16 needs a GPU")
    if bf16 and bf16_ok is False:
        problems.add(bf16_key, f"bf16 is enabled but {detail} has no native bf16 (it needs an Ampere or newer GPU)",
                     "use fp16 instead (fp16.enabled true, bf16.enabled false), or fp32")


_ADAM_EXTRAS = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}
_OPTIMIZER_CLASSES = {
    "adam": ["torch.optim.Adam", "torch.optim.AdamW", "deepspeed.ops.adam.DeepSpeedCPUAdam",
             "deepspeed.ops.adam.FusedAdam"],
    "adagrad": ["torch.optim.Adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad"],
    "lion": ["deepspeed.ops.lion.FusedLion", "deepspeed.ops.lion.DeepSpeedCPULion"],
    "lamb": ["deepspeed.ops.lamb.FusedLamb"],
}
_OPTIMIZER_CLASSES["adamw"] = _OPTIMIZER_CLASSES["adam"]


def _signature_keys(dotted_names):
    """Keyword names the classes accept (besides the parameters/optimizer they are built on)."""
    import importlib
    import inspect

    keys = set()
    for dotted in dotted_names:
        module, _, name = dotted.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
            keys |= set(inspect.signature(cls).parameters)
        except (ImportError, AttributeError, ValueError, TypeError):
            continue
    return keys - {"self", "params", "model_params", "optimizer", "args", "kwargs"}


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
    lower = name.lower()
    if lower in _OPTIMIZER_CLASSES:
        known = _signature_keys(_OPTIMIZER_CLASSES[lower]) | (_ADAM_EXTRAS if lower.startswith("adam") else set())
    elif lower in DEEPSPEED_OPTIMIZERS:
        known = set()  # mu* / muon: parameters depend on optional packages; not checked
    else:
        known = _signature_keys([f"torch.optim.{name}"])
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
    _check_params(block.get("params"), _signature_keys([dotted]), "scheduler.params", problems)


# --------------------------------------------------------------------------- the schema, read from DeepSpeed

# Read from the raw config outside DeepSpeedConfig._initialize_params (deepspeed.initialize and
# DeepSpeedConfig.__init__ / _do_warning_check), so the probe below cannot see them.
_EXTRA_TOP_KEYS = {"sequence_parallel_size": "posint", "data_parallel_size": "posint", "vocabulary_size": "int"}
_PROBE = "__dslab_probe__"


def _section(keys=(), kinds=None, children=None, removed=None, deprecated=None):
    """One level of the config: its keys, their kinds ("bool", "int", ...), nested sections, retired keys."""
    return {"keys": set(keys), "kinds": dict(kinds or {}), "children": dict(children or {}),
            "removed": dict(removed or {}), "deprecated": dict(deprecated or {})}


def _model_section(model):
    """Known keys (field names and JSON aliases), kinds and nested sections of a DeepSpeed pydantic config."""
    import enum
    import typing

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    section = _section()
    for name, field in model.model_fields.items():
        names = {name} | ({field.alias} if field.alias else set())
        section["keys"] |= names
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            new = extra.get("new_param") or "its replacement"
            new_field = model.model_fields.get(new)
            for n in names:  # name the replacement as JSON files spell it (its alias, if it has one)
                section["deprecated"][n] = (new_field.alias if new_field and new_field.alias else new)
        annotation = field.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) is typing.Union and len(args) == 1:
            annotation = args[0]
        kind = child = None
        if annotation is bool:
            kind = "bool"
        elif annotation is int:
            kind = "int"
        elif annotation is float:
            kind = "float"
        elif isinstance(annotation, type) and issubclass(annotation, DeepSpeedConfigModel):
            child = _model_section(annotation)
        elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            kind = None  # DeepSpeed's own validation names the allowed values
        for n in names:
            if kind:
                section["kinds"][n] = kind
            if child:
                section["children"][n] = child
    return section


class _Recorder(dict):
    """A dict that notes every key DeepSpeed's config readers look up in it."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def _note(self, key):
        if key != _PROBE:
            self.seen.add(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def keys(self):
        outer = self

        class _Keys:
            def __contains__(self, key):
                return outer.__contains__(key)

            def __iter__(self):
                return iter([k for k in dict.keys(outer) if k != _PROBE])

            def __len__(self):
                return len(outer)

        return _Keys()

    def __copy__(self):
        return self


@lru_cache(maxsize=None)
def _schema():
    """The keys DeepSpeed reads, found by running its own config readers on recording dicts.

    DeepSpeed ignores keys it does not read (a typo such as "zero_optimisation" just means
    "no ZeRO"), so the list has to come from the readers themselves: each top-level key that
    DeepSpeedConfig looks up, and for each section the keys its reader looks up or the fields of
    the pydantic model it builds.
    """
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import constants
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    from deepspeed.utils import logger

    models = {}
    original_init = DeepSpeedConfigModel.__init__

    def spying_init(self, strict=False, **data):
        if _PROBE in data:  # this model was built from the section we planted the marker in
            models[data.pop(_PROBE)] = type(self)
        original_init(self, strict=strict, **data)

    def read(param_dict):
        probe = ds_config.DeepSpeedConfig.__new__(ds_config.DeepSpeedConfig)
        probe._param_dict, probe.world_size, probe.global_rank = param_dict, 1, 0
        try:
            probe._initialize_params(param_dict)
        except Exception:  # a scalar reader given our probe dict; what it looked up is already noted
            pass

    level = logger.level
    logger.setLevel("ERROR")
    DeepSpeedConfigModel.__init__ = spying_init
    try:
        top_keys = set()
        read(_Recorder({_PROBE: ""}, top_keys))
        nested = {}
        for key in sorted(top_keys):
            seen = set()
            read(_Recorder({key: _Recorder({_PROBE: key}, seen), _PROBE: ""}, set()))
            nested[key] = seen
    finally:
        DeepSpeedConfigModel.__init__ = original_init
        logger.setLevel(level)

    # optimizer/scheduler "params" are read only when "type" is present, so the probe misses them.
    # (Their contents are checked against the optimizer's / scheduler's signature instead.)
    nested[constants.OPTIMIZER] |= {constants.TYPE, constants.OPTIMIZER_PARAMS}
    nested[constants.SCHEDULER] |= {constants.TYPE, constants.SCHEDULER_PARAMS}

    names = {value: name for name, value in vars(constants).items() if name.isupper() and isinstance(value, str)}
    kinds = dict(_EXTRA_TOP_KEYS)
    for key in top_keys:
        default = getattr(constants, f"{names.get(key, '')}_DEFAULT", None)
        kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default))
        if kind:
            kinds[key] = kind
    kinds.update(train_batch_size="posint", train_micro_batch_size_per_gpu="posint",
                 gradient_accumulation_steps="posint", steps_per_print="posint", gradient_clipping="float")

    children = {}
    for key in top_keys:
        if key in models:
            children[key] = _model_section(models[key])
        elif nested.get(key):
            children[key] = _section(nested[key])
        else:
            children[key] = None  # a scalar, or a section whose keys DeepSpeed does not fix (e.g. pipeline)
    children = {k: v for k, v in children.items() if v is not None}
    zero = children.get("zero_optimization")
    if zero is not None:
        zero["removed"] = dict(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}))
    top = _section(top_keys | set(_EXTRA_TOP_KEYS), kinds, children,
                   removed=getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    # Keys where "auto" is DeepSpeed's own value (data_types.keep_in_fp32_modules), not the HF placeholder.
    auto_ok = {getattr(constants, name[:-len("_DEFAULT")]) for name, value in vars(constants).items()
               if name.endswith("_DEFAULT") and value == "auto"
               and isinstance(getattr(constants, name[:-len("_DEFAULT")], None), str)}
    return {"top": top, "models": {k: m for k, m in models.items() if k in top_keys},
            "auto_ok": frozenset(auto_ok | {"replace_method"})}


def known_keys(path=""):
    """Sorted keys DeepSpeed reads at a dotted section path ("" = top level, "zero_optimization", ...)."""
    section = _schema()["top"]
    for part in [p for p in path.split(".") if p]:
        section = section["children"][part]
    return sorted(section["keys"])


# --------------------------------------------------------------------------- command line

def _cmd_check(args):
    from dslab.env import send_deepspeed_logs_to_stderr

    path = Path(args.file)
    if not path.exists() and os.sep not in args.file:
        try:
            path = config_path(args.file)
        except FileNotFoundError:
            pass
    try:
        cfg = load_config(path)
    except FileNotFoundError:
        print(f"{args.file}: no such file (ready-made configs: {', '.join(BUNDLED)})")
        return 1
    except ConfigError as exc:
        print(exc)
        return 1
    send_deepspeed_logs_to_stderr()
    device = None if args.device == "auto" else args.device
    problems = check_config(cfg, world_size=args.world_size, device=device, allow_auto=args.hf_trainer)
    if problems:
        n = len(problems)
        print(f"{args.file}: {n} problem{'s' if n != 1 else ''}")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"{args.file}: OK")
    for line in describe(cfg, args.world_size).splitlines():
        print(f"  {line}")
    return 0


def _cmd_new(args):
    from dslab.env import send_deepspeed_logs_to_stderr

    send_deepspeed_logs_to_stderr()
    # Without --world-size the file leaves train_batch_size out: DeepSpeed computes it on any number of ranks.
    extra = {} if args.world_size else {"train_batch_size": None}
    try:
        cfg = make_config(zero_stage=args.zero, offload_optimizer=args.offload_optimizer,
                          offload_param=args.offload_param, precision=args.precision,
                          micro_batch_size=args.micro_batch_size, grad_accum_steps=args.grad_accum_steps,
                          world_size=args.world_size, lr=args.lr, **extra)
    except (ConfigError, ValueError) as exc:
        print(exc)
        return 1
    if args.output:
        save_config(cfg, args.output)
        print(f"wrote {args.output}")
    else:
        print(to_json(cfg), end="")
    return 0


def add_commands(subparsers):
    """`dslab config check FILE` and `dslab config new ...`."""
    config = subparsers.add_parser("config", help="check or create DeepSpeed configs")
    sub = config.add_subparsers(dest="config_command", metavar="ACTION")
    config.set_defaults(func=lambda args: config.print_help() or 2)

    check = sub.add_parser("check", help="list every problem in a DeepSpeed JSON config (exit 1 if any)")
    check.add_argument("file", help=f"a JSON file, or a ready-made config name ({', '.join(BUNDLED)})")
    check.add_argument("--world-size", type=int, default=None,
                       help="number of ranks it will run on (default: $WORLD_SIZE, else 1)")
    check.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "any"],
                       help="accelerator to check fp16/bf16 against (auto: this machine; any: skip)")
    check.add_argument("--hf-trainer", action="store_true",
                       help='the file goes to transformers\' Trainer, which fills "auto" values')
    check.set_defaults(func=_cmd_check)

    new = sub.add_parser("new", help="print (or write) a config built by dslab.config.make_config")
    new.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    new.add_argument("--offload-optimizer", action="store_true", help="optimizer states to CPU (ZeRO-Offload)")
    new.add_argument("--offload-param", action="store_true", help="parameters to CPU (needs --zero 3)")
    new.add_argument("--precision", default="bf16", choices=PRECISIONS)
    new.add_argument("--micro-batch-size", type=int, default=1, help="train_micro_batch_size_per_gpu")
    new.add_argument("--grad-accum-steps", type=int, default=1, help="gradient_accumulation_steps")
    new.add_argument("--world-size", type=int, default=None,
                     help="ranks, to write train_batch_size (default: leave it out; DeepSpeed computes it)")
    new.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    new.add_argument("-o", "--output", help="write to this file (atomically) instead of printing")
    new.set_defaults(func=_cmd_new)
