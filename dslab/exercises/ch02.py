"""Chapter 02 (mixed precision): fp16 fates, DeepSpeed's loss scale, bf16 rounding, a bf16 config; the AMP step,
02.amp_clip, in dslab/exercises/ch02_amp_clip.py.

Solutions: notebooks/solutions/02_solutions.py."""
import math

from dslab.exercises import (Mistake, ch02_amp_clip, classic_adam_mistake, config_problems, exercise, get,
                             name_known_mistake, resolved_config, resolved_optimizer, same)
from dslab.precision.formats import FP16_FATE_VALUES, cast, fate

CODING = (ch02_amp_clip,)   # imported for the exercise it registers, 02.amp_clip


# Why fp16 does what it does to a value, by fate (the words a learner reads when they named another fate).
FATE_REASONS = {
    "overflow": "above fp16's largest finite value, 65504, so it becomes inf",
    "underflow": "below half of fp16's smallest subnormal (2^-24, about 6e-8), so it becomes 0",
    "subnormal": "between fp16's smallest subnormal (6e-8) and its smallest normal (2^-14, about 6.1e-5): kept as a "
                 "subnormal, with fewer significant bits",
    "rounded": "inside fp16's normal range but between two fp16 values (near 1.0 they are 2^-10 apart), so it is "
               "rounded to the nearest one",
    "exact": "an fp16 value itself, stored exactly",
}


@exercise("02.fp16_fates",
          wrong=((["overflow", "underflow", "underflow", "exact"], "3e-06 is between fp16's smallest subnormal"),
                 (["rounded", "underflow", "subnormal", "rounded"], "70000.0 is above fp16's largest"),
                 (["overflow", "subnormal", "subnormal", "exact"], "1e-09 is below half of fp16's smallest subnormal"),
                 (["overflow", "underflow", "subnormal", "exact"], "1.000244140625 is inside fp16's normal range")),
          hint="compare each value with fp16's max (65504), smallest subnormal (6e-8: below half of it is 0), "
               "smallest normal (6.1e-5) and eps (2^-10): answer a list of 'overflow', 'underflow', "
               "'subnormal', 'rounded' or 'exact'; dslab.precision.formats.fate(value, 'fp16') tells you after.")
def _check_fp16_fates(answer):
    truth = [fate(v, "fp16") for v in FP16_FATE_VALUES]
    if not isinstance(answer, (list, tuple)) or len(answer) != len(truth):
        raise Mistake(f"answer a list of {len(truth)} words, one per value of precision.FP16_FATE_VALUES")
    for value, right, given in zip(FP16_FATE_VALUES, truth, answer):
        if not same(given, right):
            raise Mistake(f"{value!r} is {FATE_REASONS[right]}: {right!r}, not {given!r}")
    return True


# The scale after the last step. tests/test_precision.py replays the flags through DeepSpeed's own
# scaler and checks this number (the checker itself stays free of a process group).
DS_SCALE_ANSWER = 2048.0


# Each wrong value is what DeepSpeed's scaler gives with one rule changed (replayed with hysteresis 1, with the window
# counted as torch's GradScaler counts it, ...).
@exercise("02.deepspeed_scale",
          wrong=((1024.0, "1024 halves the scale at every overflow: with hysteresis 2 the first overflow only uses up "
                          "one unit of hysteresis (the step is skipped, the scale stays 4096)"),
                 (4096.0, "4096 doubles the scale after every 2 good steps counting the step itself, as torch's "
                          "GradScaler counts: DeepSpeed doubles once the steps since the last overflow, not counting "
                          "the step itself, reach loss_scale_window, so only once here, after step 7"),
                 (512.0, "512 halves the scale at all 3 overflows and never grows it back: after loss_scale_window "
                         "steps without overflow the scale doubles"),
                 (8192.0, "8192 doubles the scale after every good step: it doubles only when loss_scale_window (2) "
                          "steps have passed since the last overflow")),
          hint="start at 2**initial_scale_power; with hysteresis 2 the first overflow only uses up one unit of "
               "hysteresis (the step is still skipped), later ones halve the scale; the scale doubles once "
               "the steps since the last overflow (not counting the step itself) reach loss_scale_window, "
               "and that refills the hysteresis.")
def _check_deepspeed_scale(answer):
    return same(answer, DS_SCALE_ANSWER) or name_known_mistake(answer, get("02.deepspeed_scale").wrong)


@exercise("02.bf16_min_update",
          wrong=((2.0**-8, "1 + 2^-8 lies exactly halfway between 1.0 and the next bf16 value, 1 + 2^-7: a tie, "
                           "rounded to the even neighbour, 1.0"),
                 (2.0**-10, "2^-10 is fp16's step near 1.0 (10 mantissa bits); bf16 keeps 7, so 1 + 2^-10 rounds to "
                            "1.0 in bf16"),
                 (2.0**-23, "2^-23 is fp32's step near 1.0 (23 mantissa bits); bf16 keeps 7"),
                 (2.0**-6, "1 + 2^-6 is not 1.0 in bf16, but it is not the smallest such power of two"),
                 (1e-3, "1 + 0.001 is less than half a bf16 step (2^-7, about 0.0078) above 1.0, so it rounds to 1.0")),
          hint="bf16 keeps 7 mantissa bits; an update of exactly half the gap between 1.0 and the next bf16 "
               "value rounds back to 1.0 (ties go to the even neighbour). Check with dslab.precision.formats.cast.")
def _check_bf16_min_update(answer):
    kept = next(2.0**-n for n in range(30, -1, -1) if cast(1.0 + 2.0**-n, "bf16") != 1.0)
    return same(answer, kept, rel=1e-9) or name_known_mistake(answer, get("02.bf16_min_update").wrong, rel=1e-9)


# 02.bf16_config: the learner writes a whole DeepSpeed config for this chapter's 2-rank bf16 run. The checker runs
# dslab's config check, then DeepSpeed's own DeepSpeedConfig on 2 ranks (the batch keys it derives, bf16, the ZeRO
# stage, the optimizer the engine would build) and compares what DeepSpeed resolved with the task.
BF16_CONFIG_TASK = {"world_size": 2, "zero_stage": 1, "micro_batch_size": 4, "grad_accum_steps": 1,
                    "train_batch_size": 8, "lr": 1e-3}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _config_with(**changes):
    """The chapter's config with top-level keys replaced (None: removed): the wrong answers a learner might give."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@exercise("02.bf16_config",
          wrong=((_config_with(fp16={"enabled": True}), "are both true"),              # both 16-bit formats
                 (_config_with(train_micro_batch_size_per_gpu="4"), "is written as a string"),
                 (_config_with(bf16={"enabled": False}), "bf16 is not enabled"),       # trains in fp32
                 (_config_with(train_batch_size=4),                                    # written for one rank
                  "train_batch_size 4 != train_micro_batch_size_per_gpu 4"),
                 (_config_with(zero_optimization={"stage": 2}), "zero_optimization.stage is 2"),
                 (_config_with(train_micro_batch_size_per_gpu=None, gradient_accumulation_steps=2),   # micro derived
                  "a micro batch of 2 per rank"),
                 (_config_with(train_batch_size=16, gradient_accumulation_steps=None),  # accumulation derived: 2
                  "gradient_accumulation_steps 2"),
                 (_config_with(optimizer={"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}),
                  "classic Adam"),
                 (_config_with(optimizer={"type": "AdamW", "params": {"lr": 1e-4}}), "lr 0.0001")),
          hint="a dict with bf16 on, ZeRO stage 1, micro batch 4 per rank on 2 ranks without accumulation, "
               "and an AdamW optimizer with lr 1e-3; dslab.config.check.check_config(cfg, world_size=2) lists "
               "problems.")
def _check_bf16_config(cfg):
    if not isinstance(cfg, dict):
        raise Mistake(f"a DeepSpeed config is a dict (the JSON object), got {type(cfg).__name__}")
    task = BF16_CONFIG_TASK
    problems = config_problems(cfg, world_size=task["world_size"], device="cpu")
    if problems:
        raise Mistake(str(problems[0]))
    ds = resolved_config(cfg, task["world_size"])
    if not ds.bfloat16_config.enabled:
        raise Mistake('bf16 is not enabled, so this config trains in fp32: add "bf16": {"enabled": true}')
    stage = ds.zero_optimization_stage
    if stage != task["zero_stage"]:
        raise Mistake(f"zero_optimization.stage is {stage}; this run partitions only the optimizer states "
                      "(fp32 master weights and Adam's moments): stage 1")
    total, micro, accum = ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps
    if (total, micro, accum) != (task["train_batch_size"], task["micro_batch_size"], task["grad_accum_steps"]):
        left_out = [k for k in BATCH_KEYS if k not in cfg]
        said = (f"DeepSpeed reads train_batch_size {total} = a micro batch of {micro} per rank x "
                f"gradient_accumulation_steps {accum} x {task['world_size']} ranks"
                + (f" (it derives {' and '.join(left_out)}, which the config leaves out, from the others by integer "
                   "division: runtime/config.py, _set_batch_related_parameters)" if left_out else ""))
        if micro != task["micro_batch_size"]:
            raise Mistake(f"{said}; each rank takes 4 sequences per micro-step: a micro batch of 4")
        raise Mistake(f"{said}; this run does not accumulate: gradient_accumulation_steps 1 (or leave it out), "
                      "so train_batch_size 8")
    optimizer = resolved_optimizer(ds)
    if optimizer is None:
        raise Mistake('there is no "optimizer" section, so deepspeed.initialize builds none and needs one passed in; '
                      'the task asks the config for AdamW: "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}')
    kind, lr, built = optimizer
    if kind == "Adam":
        raise classic_adam_mistake(built)
    if kind != "AdamW":
        raise Mistake(f'the optimizer is {kind!r} ({built}); the task asks AdamW: "type": "AdamW" (or "Adam", '
                      "which DeepSpeed builds as AdamW unless adam_w_mode is false)")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isclose(lr, task["lr"], rel_tol=1e-9):
        given = "" if "lr" in ((cfg.get("optimizer") or {}).get("params") or {}) else \
            f", the default of {built}, as the config gives none"
        raise Mistake(f"DeepSpeed's AdamW would run with lr {lr}{given}; the task asks lr 1e-3")
    return True
