"""Build DeepSpeed config dicts, read and write them as JSON, and the ready-made files in dslab/config/presets.

Checking a config (what DeepSpeed would refuse or silently ignore) is dslab.config.check; make_config runs
those checks on every config it builds.
"""
import copy
import difflib
import json
from pathlib import Path

from dslab import files
from dslab.config import check
from dslab.messages import say

CONFIG_DIR = Path(__file__).resolve().parent / "presets"
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

# The ready-made files in dslab/config/presets/ (tests check each equals make_config(**these)).
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
    world, _ = check.resolve_world_size(world_size)
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
    check.validate(cfg, world_size=world, device="any")
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
    """The config make_config builds for one of the BUNDLED names (what dslab/config/presets/NAME.json holds)."""
    return make_config(**{**BUNDLED_DEFAULTS, **BUNDLED[name]})


def write_bundled(folder=CONFIG_DIR):
    """(Re)write every ready-made config file from make_config; returns the paths."""
    return [save_config(bundled_config(name), Path(folder) / f"{name}.json") for name in BUNDLED]


def config_path(name):
    """Path of a ready-made config in dslab/config/presets ("zero3_offload" or "zero3_offload.json")."""
    stem = name[:-5] if name.endswith(".json") else name
    if stem not in BUNDLED:
        hint = difflib.get_close_matches(stem, BUNDLED, n=1)
        raise FileNotFoundError(f"no ready-made config {name!r}; there are {', '.join(BUNDLED)}"
                                + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    return CONFIG_DIR / f"{stem}.json"


def to_json(cfg):
    """The config as JSON text: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def save_config(cfg, path, option="--output"):
    """Write the config as sorted JSON, atomically (a reader never sees half a file); returns the Path.

    A folder at `path`, or a place that cannot be written, raises OSError with the fix before anything is written.
    """
    files.check_file_writable(path, option)
    return files.atomic_write_text(path, to_json(cfg))


def load_config(path):
    """Read a JSON config file into a dict.

    Malformed JSON, a duplicated key or a file that is not one JSON object raises check.ConfigError
    naming the file, line and column.
    """
    path = Path(path)
    if path.is_dir():
        raise check.ConfigError(say("config.is_dir", file=path, bundled=", ".join(BUNDLED)))
    text = path.read_text()

    def no_duplicates(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise check.ConfigError(say("load.duplicate_key", path=path, key=key))
            seen[key] = value
        return seen

    try:
        cfg = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        lines = text.splitlines()
        line = lines[exc.lineno - 1] if exc.lineno <= len(lines) else ""
        raise check.ConfigError(
            say("load.malformed", path=path, line=exc.lineno, column=exc.colno, msg=exc.msg)
            + f"\n    {line}\n    {' ' * (exc.colno - 1)}^\n    {say('problem.fix')}: {say('load.malformed.fix')}"
        ) from None
    if not isinstance(cfg, dict):
        raise check.ConfigError(say("load.not_object", path=path, kind=type(cfg).__name__))
    return cfg

