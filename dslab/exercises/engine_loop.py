"""The engine-loop exercises (03.engine_loop, 04.offload_loop): the learner writes a whole DeepSpeed training run,
and the checker runs it on 2 and on 3 launched ranks and compares the weights with plain PyTorch.

The learner's cell defines three functions (the answer is the tuple of them):

    make_model(d_in, d_out)                                  -> a torch.nn.Module, [rows, d_in] -> [rows, d_out]
    make_config(micro_batch_size, grad_accum_steps, world_size, lr)   -> the ds_config dict
    train(model, ds_config, micro_batches)                   -> deepspeed.initialize, then for each (x, y):
                                                                forward, MSE loss, engine.backward, engine.step

The checker draws the sizes now (dimensions, micro batch, accumulation steps, optimizer steps, learning rate, seed),
checks the config in this process (what DeepSpeed would refuse or silently ignore), then runs `trial` on every rank:
each rank trains the model with its own micro-batches while a spy records what the loop does with the engine (the
loss it passes to engine.backward, where the optimizer steps, who zeroes gradients, and at each accumulation boundary
the gradient the optimizer is about to step with), and the same model is trained in plain PyTorch on the whole batch
of every step (AdamW, no clipping): each boundary's gradient must be the whole batch's gradient at the same weights,
and after the run the weights must agree. `diagnose` names the first mistake it finds: in the loop (the spy) and in
the gradient before the weights, so that a mistake Adam hides (a loss divided twice, or not divided at all with
scale_wrt_gas=False, scales every gradient alike, and Adam's update barely changes) is still named.

What the loop may call backward with is judged by that gradient, not by its spelling: engine.backward(loss), or
engine.backward(loss / gradient_accumulation_steps, scale_wrt_gas=False), or loss.backward() on the engine's output
where DeepSpeed supports it (deepspeed 0.19.8, runtime/engine.py: the engine's forward hooks its output, so that a
backward through it divides by gradient_accumulation_steps and runs the engine's backward prologue and epilogue, the
gradient reduction included, when the engine has a ZeRO optimizer; without one, ZeRO stage 0 in fp32 here, the
prologue raises "Direct calls to tensor.backward() are not supported"). Every tensor the model returns is hooked: a
model that returns its loss with the tensor the loss comes from (a Hugging Face model's loss and logits) would have a
loss.backward() divided twice; here the loss is computed outside the model, from its one output.
"""
import random

from dslab.exercises import Mistake, on_ranks
from dslab.exercises.engine_spy import EngineSpy

TRIAL = "dslab.exercises.engine_loop:trial"
TOLERANCE = 2e-5     # largest weight difference to plain PyTorch accepted; a right loop measured ~1e-6 here
RATIO_RTOL = 1e-3    # loss passed to engine.backward / the micro-batch's MSE: 1 within this
GRADIENT_RTOL = 1e-4   # |boundary gradient - the whole batch's| / |the whole batch's|; a right loop measured ~1e-7
DIRECT_BACKWARD = "Direct calls to tensor.backward() are not supported"   # DeepSpeed's words, engine.py
OUTSIDE_STEP = ("optimizer stepped outside the engine: an optimizer's step() was called by your loop, not by "
                "engine.step(). The engine steps the optimizer itself, once per accumulation boundary, after "
                "reducing the gradients (and zeroes them after it): call engine.step() after every micro-batch and "
                "no optimizer.step()")
FIGHTING_ZERO_GRAD = ("zero_grad fighting the engine: your loop zeroes gradients between the micro-batches of an "
                      "accumulation window, which erases what the earlier ones added. The engine zeroes them itself "
                      "after each optimizer step: remove zero_grad() from the loop")
LOSS_BACKWARD_AT_ZERO0 = (
    "loss.backward() at ZeRO stage 0: DeepSpeed refuses a backward the engine does not run itself when it has no "
    "ZeRO optimizer (\"Direct calls to tensor.backward() are not supported\", ZeRO stage 0 in fp32 here). Call "
    "engine.backward(loss), which works at every stage. (At ZeRO stages 1-3 loss.backward() on a loss computed from "
    "the engine's output works too: DeepSpeed hooks that output to divide by gradient_accumulation_steps, and the ZeRO "
    "optimizer reduces the gradients. What engine.backward still adds there is fp16's loss scaling, which "
    "loss.backward() leaves to engine.scale(loss).)")
REFERENCE_NAMES = ("right", "clipped", "every_micro_batch", "last_micro_batch", "weight_decay", "own_data")
TASKS = {
    # 03.engine_loop: any ZeRO stage, no offload; 04.offload_loop: ZeRO-3 with optimizer and parameters on the CPU
    "accumulate": {"stage": None, "offload": False},
    "offload": {"stage": 3, "offload": True},
}


def draw_case(task, world_size, rng=None):
    """Sizes, learning rate and seed for one check, chosen now: the learner has not seen them (and never the
    chapter's 4 accumulation steps, so that a 4 written into the loop shows)."""
    rng = rng or random.SystemRandom()
    return {"task": task, "world_size": world_size, "d_in": rng.randint(3, 7), "d_out": rng.randint(1, 4),
            "micro_batch_size": rng.randint(1, 3), "grad_accum_steps": rng.choice((2, 3, 5)),
            "steps": rng.randint(2, 3),
            "lr": rng.choice([0.01, 0.02, 0.03, 0.05]), "seed": rng.randrange(1 << 30)}


def functions(answer):
    """(make_model, make_config, train) from the learner's answer; a Mistake saying what to answer otherwise."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 3 or not all(callable(f) for f in answer):
        raise Mistake("answer with your three functions: answer = (make_model, make_config, train)")
    return tuple(answer)


# ---------------------------------------------------------------------------------------------- the config

def _zero(cfg):
    zero = cfg.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


def _device(zero, what):
    block = zero.get(f"offload_{what}")
    return block.get("device", "none") if isinstance(block, dict) else "none"


def check_learner_config(answer, case):
    """In this process, before any rank starts: the learner's make_config for this case, as DeepSpeed reads it."""
    from dslab.config.check import check_config as problems_of

    _, make_config, _ = functions(answer)
    micro, accum, world_size, lr = (case["micro_batch_size"], case["grad_accum_steps"], case["world_size"],
                                    case["lr"])
    try:
        cfg = make_config(micro, accum, world_size, lr)
    except (RuntimeError, ValueError) as err:
        if "process group" not in str(err):
            raise
        raise Mistake("make_config asked torch.distributed for the world size, but the checker also calls it here, "
                      "where no process group exists: use its world_size argument") from None
    if not isinstance(cfg, dict):
        raise Mistake(f"make_config returned a {type(cfg).__name__}: return the ds_config, a dict")
    said = f"make_config({micro}, {accum}, {world_size}, {lr})"
    total = cfg.get("train_batch_size")
    if total == micro * world_size and cfg.get("gradient_accumulation_steps", 1) == 1:
        raise Mistake(f"no accumulation boundary where the task puts it: {said} gives train_batch_size {total} = "
                      f"{micro} x {world_size} ranks, so DeepSpeed accumulates nothing and steps the optimizer after "
                      f"every micro-batch instead of every {accum}: set gradient_accumulation_steps from the "
                      "grad_accum_steps argument, and train_batch_size = micro x accumulation x world size")
    if isinstance(total, int) and total != micro * accum * world_size:
        guesses = ((micro * accum, "leaves out the world size"),
                   (micro * accum * 2, "takes the world size as 2 (the chapter's), not the world_size argument"),
                   (micro * world_size, "leaves out the accumulation steps"))
        why = next((text for value, text in guesses if value == total), "is not their product")
        raise Mistake(f"wrong batch triple: {said} gives train_batch_size {total}, but micro batch {micro} x "
                      f"{accum} accumulation steps x {world_size} ranks = {micro * accum * world_size}; your "
                      f"train_batch_size {why}. Compute it from the arguments (or leave it out).")
    problems = problems_of(cfg, world_size=world_size, device="cpu")
    if problems:   # what DeepSpeed would refuse, or silently ignore
        raise Mistake(f"dslab.config.check.check_config finds in {said}:\n  " + "\n  ".join(map(str, problems[:3])))
    if cfg.get("train_micro_batch_size_per_gpu", micro) != micro:
        raise Mistake(f"{said} gives train_micro_batch_size_per_gpu {cfg['train_micro_batch_size_per_gpu']}: each "
                      f"micro-batch train() receives holds {micro} rows; use the micro_batch_size argument")
    resolved_accum = cfg.get("gradient_accumulation_steps")
    if resolved_accum is None:
        resolved_accum = (total // (micro * world_size)) if isinstance(total, int) else 1
    if resolved_accum != accum:
        raise Mistake(f"no accumulation boundary where the task puts it: {said} makes DeepSpeed accumulate "
                      f"{resolved_accum} micro-batch(es) per optimizer step, so it steps the optimizer after every "
                      f"{resolved_accum} instead of every {accum}: set gradient_accumulation_steps from the "
                      "grad_accum_steps argument")
    if float(cfg.get("gradient_clipping", 1.0)) != 0.0:
        raise Mistake(f"gradient_clipping is {cfg.get('gradient_clipping', '1.0, DeepSpeed’s default when the key is absent')}"
                      ": the engine clips the gradient norm, plain PyTorch here does not. Set \"gradient_clipping\": "
                      "0.0 to train as the reference does")
    for section in ("bf16", "fp16"):
        if isinstance(cfg.get(section), dict) and cfg[section].get("enabled"):
            raise Mistake(f"{section} is enabled: the reference trains in fp32, so the weights cannot agree; leave "
                          f"the \"{section}\" section out")
    optimizer = cfg.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.get("params") or {}
        if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
            raise Mistake(f"the optimizer is {optimizer.get('type')!r}: the reference trains with AdamW")
        if params.get("lr") != lr:
            raise Mistake(f"{said} sets lr {params.get('lr')}: use the lr argument ({lr})")
        if params.get("weight_decay", 0.0) != 0.0:
            raise Mistake(f"weight_decay is {params['weight_decay']}: the reference uses none; set 0.0")
    task = TASKS[case["task"]]
    zero = _zero(cfg)
    stage = zero.get("stage", 0)
    if task["stage"] is not None and stage != task["stage"]:
        raise Mistake(f"zero_optimization.stage is {stage}: this run partitions the parameters too, stage "
                      f"{task['stage']}")
    devices = {what: _device(zero, what) for what in ("optimizer", "param")}
    if task["offload"]:
        for what, where in (("optimizer", "Adam's states and the fp32 master weights"),
                            ("param", "the parameter partitions")):
            if devices[what] != "cpu":
                raise Mistake(f"zero_optimization.offload_{what} does not send {where} to the CPU "
                              f"(device {devices[what]!r}): set \"offload_{what}\": {{\"device\": \"cpu\"}}")
        if not isinstance(optimizer, dict):
            raise Mistake("offload without a CPU optimizer: with offload_optimizer DeepSpeed updates the weights "
                          "with its DeepSpeedCPUAdam, which it builds from the config's \"optimizer\" section; a torch "
                          "optimizer passed to deepspeed.initialize is refused. Put {\"type\": \"AdamW\", \"params\": "
                          "{\"lr\": lr}} in the config")
    elif "cpu" in devices.values():
        raise Mistake("this run offloads nothing: leave offload_optimizer and offload_param out")
    return cfg


# ---------------------------------------------------------------------------------------------- on each rank

def _data(case, world_size):
    """Every rank's micro-batches, step by step: window s holds micro x accumulation x world_size rows."""
    import torch

    micro, accum, steps = case["micro_batch_size"], case["grad_accum_steps"], case["steps"]
    rows = micro * accum * world_size
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(rows * steps, case["d_in"], generator=g)
    y = torch.randn(rows * steps, case["d_out"], generator=g)
    return x, y, rows


def _micro_batches(case, world_size, rank):
    x, y, rows = _data(case, world_size)
    micro, accum = case["micro_batch_size"], case["grad_accum_steps"]
    mine = []
    for step in range(case["steps"]):
        for m in range(accum):
            first = step * rows + (rank * accum + m) * micro
            mine.append((x[first:first + micro].clone(), y[first:first + micro].clone()))
    return mine


def _reference(model, case, world_size, rank, variant):
    """Plain PyTorch from the same start: AdamW(lr), no weight decay, one step per window of the whole batch; or the
    run a known mistake makes (variant)."""
    import torch
    import torch.nn.functional as F

    x, y, rows = _data(case, world_size)
    micro, accum = case["micro_batch_size"], case["grad_accum_steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=case["lr"],
                                  weight_decay=0.01 if variant == "weight_decay" else 0.0)

    def step(parts):
        optimizer.zero_grad()
        F.mse_loss(model(torch.cat([x[p] for p in parts])), torch.cat([y[p] for p in parts])).backward()
        if variant == "clipped":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # DeepSpeed's default gradient_clipping
        optimizer.step()

    def micro_batch(s, r, m):
        first = s * rows + (r * accum + m) * micro
        return slice(first, first + micro)

    for s in range(case["steps"]):
        if variant in ("right", "clipped", "weight_decay"):
            step([slice(s * rows, (s + 1) * rows)])
        elif variant == "every_micro_batch":
            for m in range(accum):
                step([micro_batch(s, r, m) for r in range(world_size)])
        elif variant == "last_micro_batch":
            step([micro_batch(s, r, accum - 1) for r in range(world_size)])
        elif variant == "own_data":
            step([micro_batch(s, rank, m) for m in range(accum)])
    return model


def _flat(parameters):
    import torch

    return torch.cat([p.detach().float().flatten() for p in parameters])


def _window_gradient(start, weights, case, world_size, step):
    """Plain PyTorch's gradient of the mean loss over window `step`'s whole batch (every rank's micro-batches), at
    `weights` (flat): what the optimizer should step with at that accumulation boundary."""
    import copy

    import torch
    import torch.nn.functional as F

    x, y, rows = _data(case, world_size)
    model = copy.deepcopy(start)
    torch.nn.utils.vector_to_parameters(weights, model.parameters())
    model.zero_grad(set_to_none=True)
    window = slice(step * rows, (step + 1) * rows)
    F.mse_loss(model(x[window]), y[window]).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
                      for p in model.parameters()])


def _gradient_checks(start, spy, case, world_size):
    """For each accumulation boundary the spy saw (one per optimizer step of the task, else nothing to compare):
    {"rel": |g - r| / |r|, "scale": the s that makes s x r closest to g, "fit": |g - s r| / |g|}, with g the
    gradient the optimizer was about to step with and r the whole batch's at the same weights."""
    if spy.capture_failed:
        raise RuntimeError(f"reading the gradient at an accumulation boundary failed: {spy.capture_failed}")
    if len(spy.windows) != case["steps"]:
        return []
    found = []
    for step, (weights, got) in enumerate(spy.windows):
        want = _window_gradient(start, weights, case, world_size, step)
        if got.numel() != want.numel():
            return []
        scale = float(got @ want / (want @ want)) if float(want @ want) > 0 else 0.0
        found.append({"rel": float((got - want).norm() / max(float(want.norm()), 1e-30)), "scale": scale,
                      "fit": float((got - scale * want).norm() / max(float(got.norm()), 1e-30))})
    return found


def trial(make_model, make_config, train, case):
    """On each rank: the learner's run under the spy, then the references; what `diagnose` needs, as JSON."""
    import copy

    import deepspeed
    import torch
    import torch.distributed as torch_dist

    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    micro_batches = _micro_batches(case, world_size, rank)
    cfg = make_config(case["micro_batch_size"], case["grad_accum_steps"], world_size, case["lr"])
    torch.manual_seed(case["seed"] + 1)
    model = make_model(case["d_in"], case["d_out"])
    if not isinstance(model, torch.nn.Module):
        raise Mistake(f"make_model returned a {type(model).__name__}: return a torch.nn.Module")
    start = copy.deepcopy(model)
    before = _flat(start.parameters())
    with EngineSpy(model, micro_batches, namespaces=[f.__globals__ for f in (make_model, make_config, train)
                                                    if hasattr(f, "__globals__")]) as spy:
        try:
            train(model, cfg, micro_batches)
        except Exception as exc:
            # DeepSpeed often fails after such a mistake (ZeRO's step() outside the engine finds no reduced
            # gradients): name the mistake, not the error it led to
            if spy.outside_steps:
                raise Mistake(OUTSIDE_STEP) from None
            if spy.fighting_zero_grads:
                raise Mistake(FIGHTING_ZERO_GRAD) from None
            if DIRECT_BACKWARD in str(exc):
                raise Mistake(LOSS_BACKWARD_AT_ZERO0) from None
            if "client provided optimizer" in str(exc):   # DeepSpeed refuses a torch optimizer with offload
                raise Mistake("offload without a CPU optimizer: DeepSpeed refuses a torch optimizer passed to "
                              "deepspeed.initialize when the optimizer is offloaded (ZeRO-Offload updates with its "
                              "DeepSpeedCPUAdam). Put the optimizer in the config instead: {\"type\": \"AdamW\", "
                              "\"params\": {\"lr\": lr}}") from None
            raise
    parameters = list(model.parameters())
    with deepspeed.zero.GatheredParameters(parameters):   # whole weights under ZeRO-3; nothing to do below it
        after = _flat(parameters)
    if after.numel() != before.numel():
        raise Mistake(f"the model has {after.numel()} weights after train() and {before.numel()} before: train the "
                      "model you are given")
    diffs = {}
    for variant in REFERENCE_NAMES:
        reference = _reference(copy.deepcopy(start), case, world_size, rank, variant)
        diffs[variant] = float((after - _flat(reference.parameters())).abs().max())
    spread = after.clone()
    torch_dist.all_reduce(spread, op=torch_dist.ReduceOp.MAX)
    lowest = after.clone()
    torch_dist.all_reduce(lowest, op=torch_dist.ReduceOp.MIN)
    return {"spy": spy.summary(), "diffs": diffs, "moved": float((after - before).abs().max()),
            "rank_spread": float((spread - lowest).abs().max()), "world_size": world_size,
            "gradients": _gradient_checks(start, spy, case, world_size)}


# ---------------------------------------------------------------------------------------------- verdict

def _near(values, target, rtol=RATIO_RTOL):
    return bool(values) and all(abs(v - target) <= rtol * abs(target) for v in values)


def _gradient_mistake(case, results):
    """(scaled, what is wrong) when the gradient the optimizer stepped with at an accumulation boundary is not the
    whole batch's at the same weights; scaled: it is the whole batch's times one number (a loss divided wrong).
    None when every boundary's gradient is right, or when none could be compared (other checks name that)."""
    found = results[0]["gradients"]
    if not found or all(g["rel"] <= GRADIENT_RTOL for g in found):
        return None
    accum, micro = case["grad_accum_steps"], case["micro_batch_size"]
    first = next(g for g in found if g["rel"] > GRADIENT_RTOL)
    scale = first["scale"]
    if any(g["fit"] > GRADIENT_RTOL for g in found) or scale <= 0:
        return False, (f"the gradient the optimizer stepped with at the accumulation boundary differs from the whole "
                       f"batch's at the same weights by {first['rel']:.2g} of its size: pass engine.backward each "
                       "micro-batch's mean squared error, F.mse_loss(engine(x), y), and call engine.step() after "
                       "every micro-batch")
    spy = results[0]["spy"]
    ratios = [x for r in results for x in r["spy"]["ratios"]]
    flags = set(spy["scale_wrt_gas"])
    measured = f"the gradient at each accumulation boundary is {scale:.3g} x the whole batch's"
    if spy["backwards"] == 0:   # loss.backward() on the engine's output: DeepSpeed's hook divides by accum
        if abs(scale * accum - 1) < 1e-3:
            return True, (f"{measured}: you divided the loss by {accum} before loss.backward(), and DeepSpeed's hook "
                          "on the engine's output divides by gradient_accumulation_steps again. Call backward on the "
                          "mean loss as it is (or engine.backward(loss))")
        return True, (f"{measured}: call backward on each micro-batch's mean squared error as it is, "
                      "engine.backward(F.mse_loss(engine(x), y))")
    divisor = round(1 / ratios[0]) if ratios and 0 < ratios[0] < 1 else None
    divided = bool(divisor and divisor > 1 and _near(ratios, 1 / divisor))
    if flags == {False}:        # engine.backward(..., scale_wrt_gas=False): the loop divides, or nobody does
        if ratios and _near(ratios, 1.0):
            return True, (f"{measured} ({accum} micro-batches summed): engine.backward(loss, scale_wrt_gas=False) "
                          f"does not divide by gradient_accumulation_steps ({accum}), and the loss you pass is not "
                          "divided either. Leave scale_wrt_gas at its default (True), or pass loss / "
                          "gradient_accumulation_steps when you switch it off (Adam's step barely shows it; the "
                          "gradient and clipping do)")
        if divided:
            return True, (f"{measured}: with scale_wrt_gas=False you divided the loss by {divisor}, but a window here "
                          f"adds {accum} micro-batches: divide by engine.gradient_accumulation_steps() ({accum}), "
                          "not a number written in")
    elif flags == {True}:
        if divided:
            return True, (f"the loss is divided twice: you passed engine.backward the micro-batch's loss / {divisor}, "
                          f"and engine.backward divides by gradient_accumulation_steps ({accum}) itself; {measured}. "
                          "Pass the mean loss as it is")
        if ratios and _near(ratios, micro * case["d_out"]):
            return True, ("the loss passed to engine.backward is the sum of the squared errors: use their mean "
                          f"(F.mse_loss's default reduction), as the whole-batch reference does; {measured}")
    said = f" is {ratios[0]:.3g} x the micro-batch's mean squared error" if ratios else ""
    return True, (f"{measured}: the loss you pass to engine.backward{said}. Pass F.mse_loss(engine(x), y) as it is "
                  "to engine.backward(loss), which divides it by gradient_accumulation_steps")


def diagnose(case, results):
    """Nothing when every rank's weights agree with plain PyTorch after the run; else a Mistake naming the mistake."""
    n, accum, steps, micro = (case["world_size"], case["grad_accum_steps"], case["steps"], case["micro_batch_size"])
    windows = f"{steps} optimizer steps of {accum} micro-batches on {n} ranks"
    spy = results[0]["spy"]
    if spy["initialized"] == 0:
        raise Mistake("train() never called deepspeed.initialize: build the engine from the model and the config "
                      "inside train(): engine, optimizer, _, _ = deepspeed.initialize(model=model, "
                      "model_parameters=model.parameters(), config=ds_config)")
    if spy["initialized"] > 1:
        raise Mistake(f"train() called deepspeed.initialize {spy['initialized']} times: call it once, before the loop; "
                      "each call builds a new engine and optimizer")
    if spy["passes"] == 0:
        raise Mistake("no backward pass reached the model: call engine.backward(loss) on each micro-batch's loss "
                      "(the loss of the engine's output, F.mse_loss(engine(x), y))")
    if any(r["spy"]["outside_steps"] for r in results):
        raise Mistake(OUTSIDE_STEP)
    if spy["steps"] < spy["passes"]:
        raise Mistake(f"engine.step() was called {spy['steps']} times for {spy['passes']} micro-batches: call it "
                      "after every micro-batch. The engine counts micro-batches in step() and steps the optimizer "
                      "only at the accumulation boundary, so calling it only there leaves it counting wrong")
    if any(r["spy"]["fighting_zero_grads"] for r in results):
        raise Mistake(FIGHTING_ZERO_GRAD)
    gradient_mistake = _gradient_mistake(case, results)
    if gradient_mistake and gradient_mistake[0]:   # a scaled gradient: Adam's weights would barely show it
        raise Mistake(gradient_mistake[1])
    if TASKS[case["task"]]["offload"] and spy["optimizer"] != "DeepSpeedCPUAdam":
        raise Mistake(f"offload without a CPU optimizer: the offloaded optimizer states were updated by "
                      f"{spy['optimizer']}, not by DeepSpeed's DeepSpeedCPUAdam. Leave the optimizer to DeepSpeed: an "
                      "\"optimizer\" section in the config, no torch optimizer passed to deepspeed.initialize")
    if spy["boundaries"] != steps:
        raise Mistake(f"the engine stepped the optimizer {spy['boundaries']} times for {windows}: no accumulation "
                      f"boundary every {accum} micro-batches; call engine.step() once after each micro-batch")
    if max(r["rank_spread"] for r in results) > TOLERANCE:
        raise Mistake("the ranks ended with different weights: their gradients were never averaged. Let the engine "
                      "do it: engine.backward(loss) and engine.step() on every rank")
    if results[0]["moved"] == 0.0:
        raise Mistake("no weight changed: train() must train the model it is given (deepspeed.initialize(model=model, "
                      "...)), not a new one")
    diffs = results[0]["diffs"]
    if diffs["right"] <= TOLERANCE and not gradient_mistake:
        return
    closest = min((variant for variant in diffs if variant != "right"), key=diffs.get)
    if diffs[closest] <= TOLERANCE:
        said = {
            "clipped": "the gradients were clipped to norm 1.0 (DeepSpeed's default gradient_clipping): the reference "
                       "does not clip; set \"gradient_clipping\": 0.0",
            "every_micro_batch": "no accumulation boundary: the optimizer stepped after every micro-batch",
            "last_micro_batch": "zero_grad fighting the engine: only the last micro-batch of each window reached the "
                                "optimizer, the earlier ones were erased",
            "weight_decay": "weight decay 0.01 (torch.optim.AdamW's default) was applied: the reference uses none; "
                            "set weight_decay 0.0",
            "own_data": "each rank trained on its own micro-batches only: the gradients were not averaged across "
                        "ranks; use engine.backward and engine.step",
        }[closest]
        raise Mistake(f"after {windows} your weights match a run where {said}")
    if gradient_mistake:
        raise Mistake(gradient_mistake[1])
    raise Mistake(f"after {windows} your weights differ from plain PyTorch's (AdamW, the whole batch per step) by "
                  f"up to {diffs['right']:.2g}: check the loss (the micro-batch's mean squared error, passed to "
                  "engine.backward as it is) and that the loop calls engine.step() after every micro-batch")


# ---------------------------------------------------------------------------------------------- the checker

def check(answer, task):
    """03.engine_loop (task "accumulate") and 04.offload_loop (task "offload"): True, or a Mistake."""
    functions(answer)
    return on_ranks.check(TRIAL, tuple(answer), lambda world_size: draw_case(task, world_size), diagnose,
                          before=check_learner_config)


def prepare(answers, task):
    """Run many answers on 2 and on 3 ranks at once (one launch per world size), for the checks that follow."""
    fit = []
    for answer in answers:
        try:
            functions(answer)
        except Mistake:
            continue
        fit.append(tuple(answer))
    for i, world_size in enumerate(on_ranks.WORLD_SIZES):
        case = draw_case(task, world_size)
        runnable = []
        for answer in fit:
            try:
                check_learner_config(answer, case)
            except Exception:      # refused before any rank starts: nothing to run
                continue
            runnable.append(answer)
        if runnable:   # in a batch, what diagnose refused on 2 ranks does not run on 3: the check stops there
            on_ranks.run(TRIAL, runnable, world_size, case, judge=(diagnose, on_ranks.WORLD_SIZES[:i]))
