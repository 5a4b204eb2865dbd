"""Exercise 02.amp_clip: the learner writes one fp16 training step with torch's GradScaler and gradient clipping,
`step(model, optimizer, scaler, x, y, max_norm)`. The checker runs it for a few steps on an amp_problem whose sizes,
max_norm and overflowing steps it draws at check time, each step starting from the reference run's weights and loss
scale, records on every step what the optimizer was given (whether it stepped at all, the gradients it applied, how
the weights moved, the scale after the step), and compares each step with the reference step's; the first step that
differs names the mistake, unless one of the answer's forward passes did not run under fp16 autocast (fp32, or
bf16): then that is the mistake named. An answer that calls dslab's reference step is refused. Registered when
dslab.exercises.ch02 imports it.

On an overflowing step the targets are multiplied by SPIKE: the loss stays finite, but its gradients, multiplied by
the loss scale, exceed fp16's largest value (65504) in the backward and become inf. The reference skips that step
(scaler.step sees the inf that unscale_ found) and halves the scale (scaler.update); a step that calls
optimizer.step() itself writes inf/nan into the weights. Clipping is checked on the gradients the optimizer applied:
their norm is max_norm when they were unscaled first, max_norm / scale when they were clipped while scaled.
"""
import math
import sys

from dslab.exercises import Mistake, exercise
from dslab.precision.loss_scaling import amp_problem, reference_amp_clip_step

CHAPTER_MAX_NORM = 1e-4   # the max_norm the chapter's text uses: a step that hard-codes it fails here
SPIKE = 1e4               # targets x SPIKE on an overflowing step (the scaled gradients become inf in fp16)
LR, OFFSET = 60.0, 0.002  # SGD's lr; targets sit OFFSET above the outputs: gradients ~1e-8, below fp16's subnormals


# The usual mistakes, written out (not as calls of the reference, which an answer may not call).
def _fp16_forward(model, x, y):
    import torch

    with torch.autocast("cpu", dtype=torch.float16):
        return torch.nn.functional.mse_loss(model(x), y)


def no_scaler_step(model, optimizer, scaler, x, y, max_norm):
    """fp16 autocast and clipping, but no GradScaler at all."""
    import torch

    optimizer.zero_grad()
    loss = _fp16_forward(model, x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return loss


def clip_scaled_step(model, optimizer, scaler, x, y, max_norm):
    """Clips before unscale_: the gradients are still multiplied by the scale."""
    import torch

    optimizer.zero_grad()
    loss = _fp16_forward(model, x, y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss


def unclipped_step(model, optimizer, scaler, x, y, max_norm):
    """The GradScaler step without clipping."""
    optimizer.zero_grad()
    loss = _fp16_forward(model, x, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def no_update_step(model, optimizer, scaler, x, y, max_norm):
    """Never calls scaler.update()."""
    import torch

    optimizer.zero_grad()
    loss = _fp16_forward(model, x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    return loss


def optimizer_step(model, optimizer, scaler, x, y, max_norm):
    """Unscales and clips right, then optimizer.step() instead of scaler.step(optimizer): steps on inf gradients."""
    import torch

    optimizer.zero_grad()
    loss = _fp16_forward(model, x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()
    return loss


def chapter_norm_step(model, optimizer, scaler, x, y, max_norm):
    """The right step, with the chapter's max_norm written in: a hard-coded answer."""
    import torch

    optimizer.zero_grad()
    loss = _fp16_forward(model, x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), CHAPTER_MAX_NORM)
    scaler.step(optimizer)
    scaler.update()
    return loss


def calls_the_reference_step(model, optimizer, scaler, x, y, max_norm):
    """Hands the work to dslab's own reference step."""
    return reference_amp_clip_step(model, optimizer, scaler, x, y, max_norm)


def draw_case(rng):
    """Sizes, steps, max_norm and the overflowing steps (never the first) of one check."""
    steps = rng.randint(4, 6)
    # rows x d_out >= 896 x 192 keeps each output's gradient, 2 x offset / (rows x d_out), below what fp16 keeps
    return {"rows": rng.randint(896, 1280), "d_out": rng.randint(192, 320), "steps": steps,
            "overflow_steps": sorted(rng.sample(range(1, steps), rng.randint(1, 2))),
            "max_norm": CHAPTER_MAX_NORM * rng.choice([rng.uniform(0.4, 0.75), rng.uniform(1.3, 1.8)])}


class CallsReference(Exception):
    """The learner's step ran dslab's reference step."""


def run_steps(step_fn, case, watch=False, starts=None):
    """Run `step_fn` once per step of `case` on a model, an SGD optimizer and a GradScaler('cpu').

    starts: the reference run's "starts": each step then begins from the reference's weights and scaler state
    before it (the gradients stay as the previous step left them), so every step is judged on its own, and a
    difference of a fraction of a percent on one step (clip_grad_norm_'s 1e-6) does not grow over the next ones.
    Returns {"steps": [per step: stepped (the optimizer's step ran), grads (what it applied), norm, finite, zero,
    scale_before, scale (after the step), delta (how each weight changed), autocast (the dtype autocast gave each
    forward of the step, None where it was off)], "starts": [weights and scaler state before each step]}. watch:
    raise CallsReference after a step in which step_fn ran dslab's reference step (seen with sys.setprofile)."""
    import torch

    x, y, new_model = amp_problem(rows=case["rows"], d_out=case["d_out"], offset=OFFSET)
    model = new_model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    applied, forwards = [], []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: applied.append(
        [None if p.grad is None else p.grad.detach().clone() for p in params]))

    def autocast_dtype(module, args):   # the dtype autocast gives a forward autograd records; None: fp32, no autocast
        if torch.is_grad_enabled():
            forwards.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    model.register_forward_pre_hook(autocast_dtype)
    reference, called = reference_amp_clip_step.__code__, []

    def spy(frame, event, arg):
        if event == "call" and frame.f_code is reference:
            called.append(True)

    rows, start_states = [], []
    for step in range(case["steps"]):
        if starts is not None:
            model.load_state_dict(starts[step]["weights"])
            scaler.load_state_dict(starts[step]["scaler"])
        start_states.append({"weights": {k: v.clone() for k, v in model.state_dict().items()},
                             "scaler": scaler.state_dict()})
        before, scale_before, forwards_before = len(applied), scaler.get_scale(), len(forwards)
        targets = y * SPIKE if step in case["overflow_steps"] else y
        previous = sys.getprofile()
        if watch:
            sys.setprofile(spy)
        try:
            step_fn(model, optimizer, scaler, x, targets, case["max_norm"])
        finally:
            if watch:
                sys.setprofile(previous)
        if called:
            raise CallsReference()
        grads = applied[-1] if len(applied) > before else None
        row = {"stepped": grads is not None, "grads": grads, "scale_before": scale_before, "scale": scaler.get_scale(),
               "delta": {k: v - start_states[-1]["weights"][k] for k, v in model.state_dict().items()},
               "autocast": forwards[forwards_before:]}
        if grads is not None:
            present = [g for g in grads if g is not None]
            row["finite"] = all(bool(torch.isfinite(g).all()) for g in present)
            row["norm"] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))) \
                if present else 0.0
            row["zero"] = all(not bool(g.any()) for g in present)
        rows.append(row)
    return {"steps": rows, "starts": start_states}


def _close(a, b, rel=1e-2):
    """True if two lists of tensors agree to `rel` of the second's norm (clip_grad_norm_'s own 1e-6 in the divisor
    moves the norm by ~0.4 % here: a step that clips by its own formula is right too)."""
    import torch

    if any((u is None) != (v is None) for u, v in zip(a, b)):
        return False
    pairs = [(u, v) for u, v in zip(a, b) if u is not None]
    if not pairs:
        return True
    diff = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(u - v) for u, v in pairs]))
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for _, v in pairs]))
    return bool(torch.isfinite(diff)) and float(diff) <= rel * float(norm)


def diagnose(got, want, case):
    """None if `got` (run from the reference's `starts`) took the reference's steps: the optimizer stepped on the same
    steps with the same gradients, the weights changed as much, the scale followed; else what its first differing
    step did wrong."""
    max_norm = case["max_norm"]
    for k, (g, r) in enumerate(zip(got["steps"], want["steps"])):
        where = f"on step {k + 1} of {case['steps']}"
        if r["stepped"] and not g["stepped"]:
            return (f"{where} the optimizer never stepped, and no gradient was inf/nan: call scaler.step(optimizer) "
                    "every step (it unscales the gradients, unless unscale_ did, and skips the step only when one "
                    "of them is inf/nan)")
        if not r["stepped"] and g["stepped"]:
            if not g["finite"]:
                return (f"{where} the scaled gradients overflowed fp16 (inf), and your step still called "
                        "optimizer.step() with them: the weights are now inf/nan. scaler.step(optimizer) skips such "
                        "a step (unscale_ noted the inf/nan) and scaler.update() then halves the scale; call "
                        "scaler.step(optimizer), not optimizer.step()")
            return (f"{where} the loss, multiplied by the scale ({r['scale_before']:g}), overflows fp16 in the "
                    f"backward, so the reference skips the step; yours applied finite gradients (norm "
                    f"{g['norm']:.3g}): was the loss multiplied by the scale, scaler.scale(loss).backward()?")
        if g["stepped"] and not _close(g["grads"], r["grads"]):
            if not g["finite"]:
                return f"{where} the optimizer applied inf/nan gradients: the weights are now inf/nan"
            if math.isclose(g["norm"], max_norm / g["scale_before"], rel_tol=1e-2):
                return (f"{where} the gradients the optimizer applied have norm {g['norm']:.3g} = max_norm / "
                        f"{g['scale_before']:g}: they were clipped while still multiplied by the loss scale, and "
                        "scaler.step then divided them by it (or you divided them by the scale yourself before "
                        "clipping, and scaler.step, which had not seen unscale_, divided them again). Call "
                        "scaler.unscale_(optimizer) before clip_grad_norm_: scaler.step then does not unscale twice")
            if math.isclose(g["norm"], CHAPTER_MAX_NORM, rel_tol=2e-2):   # clip_grad_norm_ divides by norm + 1e-6
                return (f"{where} the gradients the optimizer applied have norm {g['norm']:.3g}: you clipped to "
                        f"{CHAPTER_MAX_NORM}, the chapter's number, but this check passed max_norm={max_norm:.3g}: "
                        "clip to the max_norm your step is given")
            if g["zero"] or g["norm"] < 0.1 * r["norm"]:   # fp16 flushed all of them, or most: no scale lifted them
                applied = "were all 0" if g["zero"] else \
                    f"had norm {g['norm']:.3g} where the reference's have {r['norm']:.3g}, most of them flushed to 0"
                return (f"{where} the gradients the optimizer applied {applied}: no loss scaling. fp16 flushes "
                        f"these tiny gradients (2 x {OFFSET} / ({case['rows']} x {case['d_out']}) each) to 0; "
                        "multiply the loss by the scale before backward: scaler.scale(loss).backward() (and do not "
                        "zero the gradients between backward and the step)")
            if g["norm"] > max_norm * (1 + 1e-3):
                return (f"{where} the gradients the optimizer applied have norm {g['norm']:.3g}, above "
                        f"max_norm={max_norm:.3g}: they were not clipped. Call torch.nn.utils.clip_grad_norm_("
                        "model.parameters(), max_norm) between scaler.unscale_(optimizer) and scaler.step(optimizer)")
            return (f"{where} the optimizer applied gradients of norm {g['norm']:.3g}; the reference step's "
                    f"(unscaled, then clipped to max_norm={max_norm:.3g}) have norm {r['norm']:.3g}. Check the "
                    "order: zero_grad, autocast forward, scaler.scale(loss).backward(), unscale_, clip, scaler.step, "
                    "scaler.update")
        if g["scale"] != r["scale"]:
            return (f"{where} the scale went from {g['scale_before']:g} to {g['scale']:g}; the reference's went to "
                    f"{r['scale']:g}: call scaler.update() once per step, after scaler.step(optimizer) (it halves "
                    "the scale after an overflow)")
        keys = sorted(r["delta"])
        if not _close([g["delta"][k] for k in keys], [r["delta"][k] for k in keys]):
            return (f"{where} the optimizer got the reference's gradients, but the weights changed by other than "
                    "one optimizer step with them: change the weights only through scaler.step(optimizer), once per "
                    "step")
    return None


def autocast_mistake(got):
    """The mistake of a run one of whose forward passes did not run under fp16 autocast (autocast off: fp32; or
    autocast to bf16), else None. Without fp16 these gradients neither underflow nor overflow, so the scaler has
    nothing to do, and the steps differ from the reference's for that reason, whatever the scaler calls."""
    import torch

    off = [d for row in got["steps"] for d in row["autocast"] if d != torch.float16]
    if not off:
        return None
    if off[0] is None:
        return ("the forward ran in fp32, without autocast: write the forward and the loss under "
                "torch.autocast('cpu', dtype=torch.float16). In fp32 no gradient underflows and none overflows, "
                "so the loss scaling this step is about has nothing to do")
    bf16 = (". bf16 keeps fp32's range: nothing underflows or overflows, and it needs no GradScaler"
            if off[0] == torch.bfloat16 else "")
    return (f"the forward ran under autocast to {off[0]}, not float16: this is fp16's step, "
            f"torch.autocast('cpu', dtype=torch.float16){bf16}")


def _learner_run(step_fn, case, want):
    try:
        return run_steps(step_fn, case, watch=True, starts=want["starts"])
    except CallsReference:
        raise Mistake("your step calls dslab.precision.loss_scaling.reference_amp_clip_step, the checker's own "
                      "reference: write the step itself (zero_grad, autocast forward, scaler.scale(loss).backward(), "
                      "scaler.unscale_, clip_grad_norm_, scaler.step, scaler.update)") from None
    except AssertionError as exc:
        if "No inf checks were recorded" in str(exc):   # torch's GradScaler.update, asserting
            raise Mistake("scaler.update() refused the step (" + str(exc).strip() + "): neither "
                          "scaler.unscale_(optimizer) nor scaler.step(optimizer) ran, so the scaler never checked the "
                          "gradients for inf/nan. Call scaler.step(optimizer), not optimizer.step(): it unscales, "
                          "checks, and skips the step when a gradient overflowed") from None
        raise   # the learner's own error: check() shows it as their traceback
    except RuntimeError as exc:
        if "update()" in str(exc) or "after step()" in str(exc):
            raise Mistake("the scaler refused the next step (" + str(exc).strip() + "): call scaler.update() at the "
                          "end of every step (it also halves the scale after an overflow, or grows it)") from None
        raise   # the learner's own error: check() shows it as their traceback


KNOWN_MISTAKES = (no_scaler_step, clip_scaled_step, unclipped_step, optimizer_step, chapter_norm_step)


def first_gradient_norm(case):
    """The norm of the first step's gradient, in fp32, before any clipping."""
    import torch

    x, y, new_model = amp_problem(rows=case["rows"], d_out=case["d_out"], offset=OFFSET)
    model = new_model()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])))


def amp_case(rng=None, tries=20):
    """(case, reference run): a case drawn now that tells every known mistake from the reference: the reference
    skips exactly the drawn overflowing steps (optimizer.step() would step on inf there), and the first step's
    gradient is 5 % above both max_norm and the chapter's 1e-4 (so not clipping, or clipping to 1e-4, shows at
    once). tests/test_exercise_judging.py runs every known mistake on drawn cases."""
    import random

    rng = rng or random.SystemRandom()
    for _ in range(tries):
        case = draw_case(rng)
        if first_gradient_norm(case) < 1.05 * max(case["max_norm"], CHAPTER_MAX_NORM):
            continue
        want = run_steps(reference_amp_clip_step, case)
        if [k for k, row in enumerate(want["steps"]) if not row["stepped"]] == case["overflow_steps"]:
            return case, want
    raise RuntimeError("no amp_problem found in which the known mistakes differ from the reference")


@exercise("02.amp_clip",
          wrong=((no_scaler_step, "no loss scaling"), (clip_scaled_step, "still multiplied by the loss scale"),
                 (unclipped_step, "they were not clipped"), (no_update_step, "call scaler.update()"),
                 (optimizer_step, "call scaler.step(optimizer), not optimizer.step()"),
                 (chapter_norm_step, "you clipped to 0.0001"),
                 (calls_the_reference_step, "the checker's own reference")),
          hint="write step(model, optimizer, scaler, x, y, max_norm): zero_grad; forward and loss under "
               "torch.autocast('cpu', dtype=torch.float16); scaler.scale(loss).backward(); scaler.unscale_"
               "(optimizer); clip_grad_norm_(model.parameters(), max_norm); scaler.step(optimizer); scaler.update().")
def check_amp_clip(step_fn):
    """Run the learner's step on a case drawn now (some steps overflow) and name its first step that differs from
    the reference's."""
    if not callable(step_fn):
        raise Mistake("answer with the function itself: answer = my_amp_step")
    case, want = amp_case()
    got = _learner_run(step_fn, case, want)
    wrong = diagnose(got, want, case)
    if wrong:
        raise Mistake(autocast_mistake(got) or wrong)
    return True
