"""Floating-point formats and mixed precision: dtype tables, fates, the AMP loop, loss scaling, master weights."""
import contextlib
import math
import time

FORMATS = ("fp32", "fp16", "bf16")
# (exponent bits, stored mantissa bits): the sign takes the last bit of each format.
LAYOUT = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7)}


def torch_dtype(name):
    """"fp32" / "fp16" / "bf16" -> the torch dtype."""
    import torch
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


# --------------------------------------------------------------------------- formats

def dtype_info(name):
    """One format's bits, range and precision, read from torch.finfo (not typed in by hand)."""
    import torch
    fi = torch.finfo(torch_dtype(name))
    exponent_bits, mantissa_bits = LAYOUT[name]
    return {
        "format": name,
        "bits": fi.bits,
        "exponent_bits": exponent_bits,
        "mantissa_bits": mantissa_bits,
        "max": fi.max,                              # largest finite value; beyond it: inf
        "smallest_normal": fi.smallest_normal,      # below it precision drops (subnormals)
        "smallest_subnormal": fi.smallest_normal * fi.eps,  # at or below half of it: 0
        "eps": fi.eps,                              # gap between 1.0 and the next value
        "decimal_digits": round(math.log10(2) * (mantissa_bits + 1), 1),
    }


def dtype_table(formats=FORMATS):
    """dtype_info for each format, as a list of rows."""
    return [dtype_info(f) for f in formats]


def cast(value, name):
    """`value` stored in format `name` and read back as a Python float."""
    import torch
    return torch.tensor(value, dtype=torch.float64).to(torch_dtype(name)).item()


def fate(value, name):
    """What storing `value` in format `name` does to it: exact, rounded, subnormal, underflow or overflow."""
    stored = cast(value, name)
    info = dtype_info(name)
    if math.isinf(stored) and not math.isinf(value):
        return "overflow"
    if stored == 0.0 and value != 0.0:
        return "underflow"
    if stored != 0.0 and abs(stored) < info["smallest_normal"]:
        return "subnormal"
    return "exact" if stored == value else "rounded"


def fate_table(values, formats=FORMATS):
    """For each value: what each format stores and the fate; rows of {"value", "<fmt>", "<fmt>_fate"}."""
    rows = []
    for value in values:
        row = {"value": value}
        for name in formats:
            row[name] = cast(value, name)
            row[f"{name}_fate"] = fate(value, name)
        rows.append(row)
    return rows


def format_table(rows, columns=None, float_format="{:.4g}"):
    """A plain-text table of a list of dicts (floats formatted, columns aligned)."""
    columns = columns or list(rows[0])

    def show(v):
        if isinstance(v, float):
            return float_format.format(v)
        return str(v)

    cells = [[str(c) for c in columns]] + [[show(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(s.rjust(w) for s, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- underflow and loss scaling

def nearly_fit_problem(batch=4096, d_in=16, d_out=1024, residual=0.04, seed=0):
    """A linear layer and targets it already fits up to small residuals: (x, targets, make_layer).

    The loss is a mean over batch x d_out = 4M elements, so each output's gradient 2*r/N is about
    1e-8: below fp16's smallest subnormal (6e-8), as for logits averaged over many tokens.
    """
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=g)

    def make_layer():
        torch.manual_seed(seed + 1)
        return torch.nn.Linear(d_in, d_out)

    with torch.no_grad():
        targets = make_layer()(x) + residual * torch.randn(batch, d_out, generator=g)
    return x, targets, make_layer


def gradients(x, targets, make_layer, dtype=None, scale=1.0):
    """Weight gradient and output gradient of an MSE loss, in fp32 or under torch.autocast(dtype).

    The loss is multiplied by `scale` before backward and the weight gradient divided by it after
    (in fp32), exactly what a loss scaler does. Returns (weight_grad fp32, output_grad as computed).
    """
    import torch
    layer = make_layer()
    seen = {}
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with autocast:
        y = layer(x)  # (batch, d_out); fp16/bf16 under autocast
    y.register_hook(lambda g: seen.setdefault("dy", g.detach().clone()))
    loss = torch.nn.functional.mse_loss(y.float(), targets)
    (loss * scale).backward()
    return layer.weight.grad.float() / scale, seen["dy"]


def underflow_experiment(scale=2.0**16, **problem):
    """fp32 reference vs fp16 unscaled vs fp16 loss-scaled vs bf16 on the nearly-fit problem."""
    import torch
    x, targets, make_layer = nearly_fit_problem(**problem)
    ref_w, ref_dy = gradients(x, targets, make_layer)
    rows = {}
    for label, dtype, s in (("fp32", None, 1.0), ("fp16", torch.float16, 1.0),
                            ("fp16 x scale", torch.float16, scale), ("bf16", torch.bfloat16, 1.0)):
        w, dy = gradients(x, targets, make_layer, dtype, s)
        rows[label] = {
            "run": label,
            "loss_scale": int(s),
            "output_grads_zero": (dy == 0).float().mean().item(),
            "weight_grad_rel_error": ((w - ref_w).norm() / ref_w.norm()).item(),
        }
    return {"rows": list(rows.values()), "by_run": rows, "reference_output_grads": ref_dy.flatten(),
            "scale": scale}


# --------------------------------------------------------------------------- the AMP loop (fp16 autocast + GradScaler)

def amp_problem(rows=4096, d_in=16, d_out=1024, offset=0.01, seed=0):
    """(x, y, new_model): a linear layer whose targets sit `offset` above its outputs, and a maker of fresh copies.

    The MSE averages rows x d_out = 4M squared errors, so each output's gradient 2 * offset / 4M is about
    5e-9: below half of fp16's smallest subnormal, so fp16 stores it as 0. The fp32 gradient is fine.
    """
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g)

    def new_model():
        torch.manual_seed(seed + 1)        # every copy starts from the same weights
        return torch.nn.Linear(d_in, d_out)

    with torch.no_grad():
        y = new_model()(x) + offset
    return x, y, new_model


def amp_runs(steps=8, lr=250.0, **problem):
    """Losses of reference loops on amp_problem: fp32, and the GradScaler loop with backward inside autocast.

    Returns {"fp32": [...], "scaler, backward inside autocast": [...]}: the first is what the fp16 loops
    should follow; the second shows what moving backward and step out of autocast changes (here: nothing).
    """
    import torch
    x, y, new_model = amp_problem(**problem)
    out = {}
    for name in ("fp32", "scaler, backward inside autocast"):
        model = new_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cpu")
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            if name == "fp32":
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            losses.append(loss.item())
        out[name] = losses
    return out


def _reference_amp_clip_step(model, optimizer, scaler, x, y, max_norm, unscale_first=True, clip=True):
    """The 02.amp_clip solution (unscale_ then clip), or a known mistake (clip scaled gradients / no clipping)."""
    import torch
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss


def run_amp_step(step_fn, steps=4, lr=60.0, max_norm=1e-4, rows=1024, d_out=256, offset=0.002):
    """Run `step_fn(model, optimizer, scaler, x, y, max_norm)` for `steps` steps on a small amp_problem.

    The gradients of each output (2 x 0.002 / (1024 x 256) = 1.5e-8) are again below what fp16 keeps.

    Returns {"weights": final state dict, "moved": did any weight change, "grad_zero": share of the last
    weight gradient that is exactly 0, "scale": the scaler's scale at the end}.
    """
    import torch
    x, y, new_model = amp_problem(rows=rows, d_out=d_out, offset=offset)
    model = new_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        step_fn(model, optimizer, scaler, x, y, max_norm)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    grad = model.weight.grad
    return {"weights": weights, "moved": any(not torch.equal(weights[k], start[k]) for k in start),
            "grad_zero": 1.0 if grad is None else (grad == 0).float().mean().item(), "scale": scaler.get_scale()}


# --------------------------------------------------------------------------- dynamic loss scaling (torch)

def _scaler_model(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def trace_grad_scaler(steps=16, spike_steps=(2, 3), init_scale=2.0**8, growth_interval=4, spike=1e4,
                      lr=1e-2, seed=0, dtype="fp16"):
    """Train a small MLP under torch.autocast(fp16) with torch.amp.GradScaler and record each step.

    At `spike_steps` the batch has corrupted targets (x `spike`): its scaled gradients exceed fp16's
    65504. Each row: step, scale used, overflow (a non-finite gradient after unscaling), skipped
    (weights bit-for-bit unchanged), scale after the update, loss. dtype="bf16" runs the same steps
    under autocast(bf16) with the scaler disabled (scale 1.0), as bf16 training does.
    """
    import torch
    model = _scaler_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=growth_interval, enabled=dtype == "fp16")
    g = torch.Generator().manual_seed(seed)
    trace = []
    for step in range(steps):
        x = torch.randn(64, 16, generator=g)
        y = torch.randn(64, 8, generator=g) * (spike if step in spike_steps else 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        with torch.autocast("cpu", dtype=torch_dtype(dtype)):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # gradients / scale, in place; notes whether any is inf/nan
        overflow = not all(torch.isfinite(p.grad).all() for p in model.parameters())
        scaler.step(optimizer)      # skipped when unscale_ found inf/nan
        scaler.update()             # halve on overflow; double after growth_interval good steps
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        trace.append({"step": step, "scale": scale, "overflow": overflow, "skipped": skipped,
                      "next_scale": scaler.get_scale(), "loss": loss.item()})
    return trace


def check_scaler_trace(trace, growth_interval, backoff=0.5, growth=2.0):
    """Problems in a GradScaler trace (empty if every step obeys the rules):

    a step is skipped exactly when it overflowed; an overflow multiplies the scale by `backoff`;
    `growth_interval` good steps in a row multiply it by `growth`; otherwise it stays.
    """
    problems, good_run = [], 0
    for row in trace:
        s, nxt = row["scale"], row["next_scale"]
        if row["skipped"] != row["overflow"]:
            problems.append(f"step {row['step']}: overflow={row['overflow']} but skipped={row['skipped']}")
        if row["overflow"]:
            good_run, expected = 0, s * backoff
        else:
            good_run += 1
            expected = s * growth if good_run == growth_interval else s
            good_run %= growth_interval
        if nxt != expected:
            problems.append(f"step {row['step']}: scale {s} -> {nxt}, expected {expected}")
    return problems


# --------------------------------------------------------------------------- dynamic loss scaling (DeepSpeed)

def _single_process_group():
    """Make this process rank 0 of 1 (DeepSpeed's scaler and engine ask deepspeed.comm for the rank)."""
    from dslab.train import init_single_process
    init_single_process(quiet=True)


def deepspeed_scaler(**fp16):
    """DeepSpeed's own DynamicLossScaler, built from an "fp16" config section the way the engine builds it."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    _single_process_group()
    section = DeepSpeedFP16Config(**{"enabled": True, "loss_scale": 0, **fp16})
    return DynamicLossScaler(**section.dynamic_loss_scale_args())


def trace_deepspeed_scaler(overflows, **fp16):
    """Feed a sequence of overflow flags to DeepSpeed's DynamicLossScaler; one row per step.

    Rows: step, scale used, overflow, hysteresis left after the step, scale after; and, if the scaler
    gave up ("loss scale already at minimum"), a final row with its error message.
    """
    scaler = deepspeed_scaler(**fp16)
    trace = []
    for step, overflow in enumerate(overflows):
        scale = scaler.cur_scale
        try:
            scaler.update_scale(bool(overflow))
        except Exception as exc:  # DeepSpeed raises a bare Exception at the minimum scale
            trace.append({"step": step, "scale": scale, "overflow": bool(overflow), "error": str(exc)})
            break
        trace.append({"step": step, "scale": scale, "overflow": bool(overflow),
                      "hysteresis": scaler.cur_hysteresis, "next_scale": scaler.cur_scale})
    return trace


def trace_deepspeed_fp16(steps=16, spike_steps=(2, 3), spike=1e4, zero_stage=1, lr=1e-2, seed=0, **fp16):
    """GPU only: the same spiky training under DeepSpeed's own fp16 ZeRO optimizer; one row per step.

    DeepSpeed refuses fp16 on the CPU accelerator. Rows: step, scale used, skipped (the engine counted
    an overflow and did not update), scale after the step, loss. `fp16` sets the config's fp16 keys.
    """
    import torch
    import deepspeed

    from dslab.config import make_config
    _single_process_group()
    model = _scaler_model(seed)
    config = make_config(zero_stage=zero_stage, precision="fp16", micro_batch_size=64, world_size=1, lr=lr,
                         gradient_clipping=0.0, fp16=fp16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(seed)
    trace = []
    for step in range(steps):
        x = torch.randn(64, 16, generator=g).to(engine.device, torch.float16)   # the engine holds fp16 weights
        y = (torch.randn(64, 8, generator=g) * (spike if step in spike_steps else 1.0)).to(engine.device)
        scale, skipped_before = engine.optimizer.loss_scale, engine.skipped_steps
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)   # multiplies by the loss scale before backward
        engine.step()           # unscales, checks for inf/nan, skips or updates, adjusts the scale
        trace.append({"step": step, "scale": float(scale), "skipped": engine.skipped_steps > skipped_before,
                      "next_scale": float(engine.optimizer.loss_scale), "loss": loss.item()})
    return trace


# --------------------------------------------------------------------------- master weights

def repeated_add(start, update, steps, name):
    """Add `update` to `start` `steps` times, storing the running value in format `name`."""
    import torch
    w = torch.tensor(start, dtype=torch_dtype(name))
    for _ in range(steps):
        w = w + torch.tensor(update, dtype=torch_dtype(name))
    return w.item()


def master_weight_summary(start, end, master):
    """How many weights moved in the fp32 master copy, how many of those the bf16 copy shows, and the RMSNorm gains.

    start, end: {name: bf16 tensor} before and after training; master: {name: fp32 master tensor} after.
    """
    import torch
    norm = [n for n in start if n.endswith("norm.weight")]                     # RMSNorm gains, 1.0 at init
    return {
        "moved_in_master": sum(int((master[n] != start[n].float()).sum()) for n in start),
        "moved_in_bf16_copy": sum(int((end[n] != start[n]).sum()) for n in start),
        # updates that the bf16 copy cannot show (yet): they wait in the master copy until they add up to a bf16 step
        "moved_in_master_only": sum(int(((master[n] != start[n].float()) & (end[n] == start[n])).sum()) for n in start),
        "norm_weights": sum(start[n].numel() for n in norm),
        "norm_weights_moved_in_master": sum(int((master[n] != 1.0).sum()) for n in norm),
        "norm_weights_moved_in_bf16": sum(int((end[n] != 1.0).sum()) for n in norm),
        # the bf16 weights the model computes with are the master copy rounded to bf16
        "bf16_copy_is_rounded_master": all(torch.equal(end[n], master[n].to(torch.bfloat16)) for n in start),
    }


def zero1_state_bytes(engine):
    """Bytes of the model states a ZeRO-1/2 bf16 engine holds on this rank, read from its tensors.

    {"weights": the 16-bit module weights, "master": this rank's fp32 master partition, "adam": Adam's
    moments for that partition, "parameters": elements in the module}.
    """
    optimizer = engine.optimizer
    inner = optimizer.optimizer                     # the torch AdamW that updates the fp32 partition
    params = list(engine.module.parameters())
    return {
        "parameters": sum(p.numel() for p in params),
        "weights": sum(p.numel() * p.element_size() for p in params),
        "master": sum(t.numel() * t.element_size() for t in optimizer.single_partition_of_fp32_groups),
        "adam": sum(v.numel() * v.element_size() for state in inner.state.values()
                    for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")),
    }


# --------------------------------------------------------------------------- speed

def matmul_gflops(name, n=2048, repeats=5, threads=None):
    """Best-of-`repeats` GFLOP/s of an n x n matmul in format `name` on this CPU (2 n^3 flops each)."""
    import torch
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(torch_dtype(name))
        b = torch.randn(n, n, generator=g).to(torch_dtype(name))
        a @ b  # warm-up: first call picks kernels and allocates
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------- exercises (chapter 02)
from dslab.exercises import Mistake, exercise, same  # noqa: E402  (after the functions the checkers use)

# 02.fp16_fates: what storing each value in fp16 does to it.
FP16_FATE_VALUES = (70000.0, 1e-9, 3e-6, 1 + 2**-12)


@exercise("02.fp16_fates", wrong=(["overflow", "underflow", "underflow", "exact"],
                                  ["rounded", "underflow", "subnormal", "rounded"],
                                  ["overflow", "subnormal", "subnormal", "exact"]),
          hint="compare each value with fp16's max (65504), smallest subnormal (6e-8: below half of it is 0), "
               "smallest normal (6.1e-5) and eps (2^-10): answer a list of 'overflow', 'underflow', "
               "'subnormal', 'rounded' or 'exact'; dslab.precision.fate(value, 'fp16') tells you after.")
def _check_fp16_fates(answer):
    return same(list(answer), [fate(v, "fp16") for v in FP16_FATE_VALUES])


# 02.deepspeed_scale: DeepSpeed's DynamicLossScaler with these fp16 settings sees these overflows.
DS_SCALE_FP16 = {"initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 2}
DS_SCALE_OVERFLOWS = (False, True, False, True, True, False, False, False, False)
# The scale after the last step. tests/test_precision.py replays the flags through DeepSpeed's own
# scaler and checks this number (the checker itself stays free of a process group).
DS_SCALE_ANSWER = 2048.0


# 1024 is what ignoring hysteresis gives, 4096 what counting the window the way torch's GradScaler does gives.
@exercise("02.deepspeed_scale", wrong=(1024.0, 4096.0, 512.0, 8192.0),
          hint="start at 2**initial_scale_power; with hysteresis 2 the first overflow only uses up one unit of "
               "hysteresis (the step is still skipped), later ones halve the scale; the scale doubles once "
               "the steps since the last overflow (not counting the step itself) reach loss_scale_window, "
               "and that refills the hysteresis.")
def _check_deepspeed_scale(answer):
    return same(answer, DS_SCALE_ANSWER)


@exercise("02.bf16_min_update", wrong=(2.0**-8, 2.0**-10, 2.0**-23, 1e-3),
          hint="bf16 keeps 7 mantissa bits; an update of exactly half the gap between 1.0 and the next bf16 "
               "value rounds back to 1.0 (ties go to the even neighbour). Check with dslab.precision.cast.")
def _check_bf16_min_update(answer):
    kept = next(2.0**-n for n in range(30, -1, -1) if cast(1.0 + 2.0**-n, "bf16") != 1.0)
    return same(answer, kept, rel=1e-9)


# 02.amp_clip: the learner writes one fp16 training step with a GradScaler and gradient clipping;
# the checker runs it for 4 steps on amp_problem and compares the weights with the reference step's.
def _no_scaler_step(model, optimizer, scaler, x, y, max_norm):
    import torch
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return loss


def _clip_scaled_step(model, optimizer, scaler, x, y, max_norm):
    return _reference_amp_clip_step(model, optimizer, scaler, x, y, max_norm, unscale_first=False)


def _unclipped_step(model, optimizer, scaler, x, y, max_norm):
    return _reference_amp_clip_step(model, optimizer, scaler, x, y, max_norm, clip=False)


def _no_update_step(model, optimizer, scaler, x, y, max_norm):
    import torch
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    return loss


def _same_weights(a, b):
    import torch
    return all(torch.allclose(a[k], b[k], rtol=1e-6, atol=0.0) for k in b)


@exercise("02.amp_clip", wrong=(_no_scaler_step, _clip_scaled_step, _unclipped_step, _no_update_step),
          hint="write step(model, optimizer, scaler, x, y, max_norm): zero_grad; forward and loss under "
               "torch.autocast('cpu', dtype=torch.float16); scaler.scale(loss).backward(); scaler.unscale_"
               "(optimizer); clip_grad_norm_(model.parameters(), max_norm); scaler.step(optimizer); scaler.update().")
def _check_amp_clip(step_fn):
    if not callable(step_fn):
        raise Mistake("answer with the function itself: answer = my_amp_step")
    try:
        got = run_amp_step(step_fn)
    except RuntimeError as exc:
        if "update()" in str(exc) or "after step()" in str(exc):
            raise Mistake("the scaler refused the second step: call scaler.update() at the end of every step "
                          "(it also halves or grows the scale)") from None
        raise Mistake(f"your step raised {type(exc).__name__}: {exc}") from None
    want = run_amp_step(_reference_amp_clip_step)["weights"]
    if _same_weights(got["weights"], want):
        return True
    if not got["moved"]:
        if got["grad_zero"] == 1.0:
            raise Mistake("every gradient was 0 and no weight moved: fp16 flushed the tiny gradients. Multiply "
                          "the loss by the scale before backward: scaler.scale(loss).backward()")
        raise Mistake("no weight moved: the optimizer never stepped. Call scaler.step(optimizer) (it unscales "
                      "the gradients and skips the step only if one is inf/nan)")
    if _same_weights(got["weights"], run_amp_step(_clip_scaled_step)["weights"]):
        raise Mistake("you clipped the gradients while they were still multiplied by the loss scale (2**16), so "
                      "the clipping cut them 65536x too much: call scaler.unscale_(optimizer) before clip_grad_norm_")
    if _same_weights(got["weights"], run_amp_step(_unclipped_step)["weights"]):
        raise Mistake("the gradients were not clipped: call torch.nn.utils.clip_grad_norm_(model.parameters(), "
                      "max_norm) between scaler.unscale_(optimizer) and scaler.step(optimizer)")
    if _same_weights(got["weights"], run_amp_step(_no_scaler_step)["weights"]):
        raise Mistake("no loss scaling: fp16 flushed the gradients to 0. Use scaler.scale(loss).backward()")
    raise Mistake("after 4 steps your weights differ from the reference step's: check the order zero_grad, "
                  "autocast forward, scaler.scale(loss).backward(), unscale_, clip, scaler.step, scaler.update")


# 02.bf16_config: the learner writes a whole DeepSpeed config for this chapter's 2-rank bf16 run.
BF16_CONFIG_TASK = {"world_size": 2, "zero_stage": 1, "micro_batch_size": 4, "grad_accum_steps": 1, "lr": 1e-3}


def _config_with(**changes):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    cfg.update(changes)
    return cfg


@exercise("02.bf16_config",
          wrong=(_config_with(fp16={"enabled": True}),                                  # both 16-bit formats
                 _config_with(train_micro_batch_size_per_gpu="4"),                      # a number as a string
                 _config_with(bf16={"enabled": False}),                                 # trains in fp32
                 _config_with(train_batch_size=4),                                      # the triple ignores the ranks
                 _config_with(zero_optimization={"stage": 2}),
                 _config_with(bfloat16={"enabled": True}, bf16=None)),
          hint="a dict with bf16 on, ZeRO stage 1, micro batch 4 per rank on 2 ranks without accumulation, "
               "and an AdamW optimizer with lr 1e-3; dslab.config.check_config(cfg, world_size=2) lists problems.")
def _check_bf16_config(cfg):
    from dslab import config
    if not isinstance(cfg, dict):
        raise Mistake(f"a DeepSpeed config is a dict (the JSON object), got {type(cfg).__name__}")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    problems = config.check_config(cfg, world_size=BF16_CONFIG_TASK["world_size"], device="cpu")
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
