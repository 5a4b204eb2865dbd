"""Floating-point formats and mixed precision: dtype tables, rounding fates, loss-scale traces, bf16 speed."""
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
from dslab.exercises import exercise, same  # noqa: E402  (after the functions the checkers use)

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
