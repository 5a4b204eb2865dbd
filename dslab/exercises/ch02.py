"""Chapter 02 (mixed precision): fp16 fates, DeepSpeed's loss scale, bf16 rounding, an AMP step, a bf16 config.

Solutions: notebooks/solutions/02_solutions.py."""
import functools

from dslab.exercises import Mistake, exercise, get, name_known_mistake, same
from dslab.precision.loss_scaling import reference_amp_clip_step, run_amp_step, same_weights
from dslab.precision.formats import FP16_FATE_VALUES, cast, fate


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


# 02.amp_clip: the learner writes one fp16 training step with a GradScaler and gradient clipping; the checker runs it
# on an amp_problem whose sizes, max_norm and number of steps it draws at check time, and compares the weights with
# the reference step's. Each known mistake is the reference step with one thing changed.
CHAPTER_MAX_NORM = 1e-4   # the max_norm the chapter's text uses: a step that hard-codes it fails here
_no_scaler_step = functools.partial(reference_amp_clip_step, scale=False)
_clip_scaled_step = functools.partial(reference_amp_clip_step, unscale_first=False)
_unclipped_step = functools.partial(reference_amp_clip_step, clip=False)
_no_update_step = functools.partial(reference_amp_clip_step, update=False)


def _chapter_norm_step(model, optimizer, scaler, x, y, max_norm):
    """Clips to the chapter's 1e-4 whatever max_norm it is given."""
    return reference_amp_clip_step(model, optimizer, scaler, x, y, CHAPTER_MAX_NORM)


def _draw_amp_case(rng):
    # rows x d_out >= 896 x 192 keeps each output's gradient, 2 x offset / (rows x d_out), below what fp16 keeps
    return {"rows": rng.randint(896, 1280), "d_out": rng.randint(192, 320), "steps": rng.randint(3, 5),
            "max_norm": CHAPTER_MAX_NORM * rng.choice([rng.uniform(0.4, 0.75), rng.uniform(1.3, 1.8)])}


def _amp_case():
    """A case in which the reference and every known mistake end with different weights (a few draws at most)."""
    import random

    rng = random.SystemRandom()
    for _ in range(20):
        case = _draw_amp_case(rng)
        want = run_amp_step(reference_amp_clip_step, **case)["weights"]
        others = [run_amp_step(step, **case)["weights"] for step in (_no_scaler_step, _clip_scaled_step,
                                                                      _unclipped_step, _chapter_norm_step)]
        if not any(same_weights(w, want) for w in others):
            return case, want
    raise RuntimeError("no amp_problem found in which the known mistakes differ from the reference")


@exercise("02.amp_clip",
          wrong=((_no_scaler_step, "no loss scaling"), (_clip_scaled_step, "still multiplied by the loss scale"),
                 (_unclipped_step, "were not clipped"), (_no_update_step, "call scaler.update()"),
                 (_chapter_norm_step, "you clipped to 0.0001")),
          hint="write step(model, optimizer, scaler, x, y, max_norm): zero_grad; forward and loss under "
               "torch.autocast('cpu', dtype=torch.float16); scaler.scale(loss).backward(); scaler.unscale_"
               "(optimizer); clip_grad_norm_(model.parameters(), max_norm); scaler.step(optimizer); scaler.update().")
def _check_amp_clip(step_fn):
    if not callable(step_fn):
        raise Mistake("answer with the function itself: answer = my_amp_step")
    case, want = _amp_case()
    try:
        got = run_amp_step(step_fn, **case)
    except RuntimeError as exc:
        if "update()" in str(exc) or "after step()" in str(exc):
            raise Mistake("the scaler refused the second step: call scaler.update() at the end of every step "
                          "(it also halves or grows the scale)") from None
        raise
    if same_weights(got["weights"], want):
        return True
    if not got["moved"]:
        if got["grad_zero"] == 1.0:
            raise Mistake("no loss scaling: every gradient was 0 and no weight moved, fp16 flushed the tiny "
                          "gradients. Multiply the loss by the scale before backward: scaler.scale(loss).backward()")
        raise Mistake("no weight moved: the optimizer never stepped. Call scaler.step(optimizer) (it unscales "
                      "the gradients and skips the step only if one is inf/nan)")
    if same_weights(got["weights"], run_amp_step(_clip_scaled_step, **case)["weights"]):
        raise Mistake("you clipped the gradients while they were still multiplied by the loss scale (2**16), so "
                      "the clipping cut them 65536x too much: call scaler.unscale_(optimizer) before clip_grad_norm_")
    if same_weights(got["weights"], run_amp_step(_unclipped_step, **case)["weights"]):
        raise Mistake("the gradients were not clipped: call torch.nn.utils.clip_grad_norm_(model.parameters(), "
                      "max_norm) between scaler.unscale_(optimizer) and scaler.step(optimizer)")
    if same_weights(got["weights"], run_amp_step(_chapter_norm_step, **case)["weights"]):
        raise Mistake(f"you clipped to {CHAPTER_MAX_NORM}, the chapter's number, but this check passed "
                      f"max_norm={case['max_norm']:.3g}: clip to the max_norm your step is given")
    if same_weights(got["weights"], run_amp_step(_no_scaler_step, **case)["weights"]):
        raise Mistake("no loss scaling: fp16 flushed the gradients to 0. Use scaler.scale(loss).backward()")
    raise Mistake(f"after {case['steps']} steps your weights differ from the reference step's: check the order "
                  "zero_grad, autocast forward, scaler.scale(loss).backward(), unscale_, clip, scaler.step, "
                  "scaler.update")


# 02.bf16_config: the learner writes a whole DeepSpeed config for this chapter's 2-rank bf16 run.
BF16_CONFIG_TASK = {"world_size": 2, "zero_stage": 1, "micro_batch_size": 4, "grad_accum_steps": 1, "lr": 1e-3}


def _config_with(**changes):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    cfg.update(changes)
    return cfg


@exercise("02.bf16_config",
          wrong=((_config_with(fp16={"enabled": True}), "are both true"),              # both 16-bit formats
                 (_config_with(train_micro_batch_size_per_gpu="4"), "is written as a string"),
                 (_config_with(bf16={"enabled": False}), "bf16 is not enabled"),       # trains in fp32
                 (_config_with(train_batch_size=4),                                    # the triple ignores the ranks
                  "train_batch_size 4 != train_micro_batch_size_per_gpu 4"),
                 (_config_with(zero_optimization={"stage": 2}), "zero_optimization.stage is 2"),
                 (_config_with(bfloat16={"enabled": True}, bf16=None), "the old name of the section")),
          hint="a dict with bf16 on, ZeRO stage 1, micro batch 4 per rank on 2 ranks without accumulation, "
               "and an AdamW optimizer with lr 1e-3; dslab.config.check.check_config(cfg, world_size=2) lists "
               "problems.")
def _check_bf16_config(cfg):
    from dslab.config import check
    if not isinstance(cfg, dict):
        raise Mistake(f"a DeepSpeed config is a dict (the JSON object), got {type(cfg).__name__}")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    problems = check.check_config(cfg, world_size=BF16_CONFIG_TASK["world_size"], device="cpu")
    if problems:
        raise Mistake(str(problems[0]))
    if not (cfg.get("bf16") or {}).get("enabled"):
        raise Mistake('bf16 is not enabled, so this config trains in fp32: add "bf16": {"enabled": true}')
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if stage != BF16_CONFIG_TASK["zero_stage"]:
        raise Mistake(f"zero_optimization.stage is {stage}; this run partitions only the optimizer states "
                      "(fp32 master weights and Adam's moments): stage 1")
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if micro != BF16_CONFIG_TASK["micro_batch_size"]:
        raise Mistake(f"train_micro_batch_size_per_gpu is {micro}; each rank takes 4 sequences per micro-step")
    if cfg.get("gradient_accumulation_steps", 1) != 1:
        raise Mistake("this run does not accumulate: gradient_accumulation_steps 1 (or leave it out)")
    opt = cfg.get("optimizer") or {}
    if str(opt.get("type", "")).lower() != "adamw" or (opt.get("params") or {}).get("lr") != BF16_CONFIG_TASK["lr"]:
        raise Mistake('the optimizer should be {"type": "AdamW", "params": {"lr": 1e-3, ...}}')
    return True
