"""Why fp16 training needs loss scaling, and how torch's GradScaler and DeepSpeed's loss scaler do it.

  underflow_experiment()    tiny gradients vanish in fp16 (not in bf16); multiplying the loss by a scale saves them
  amp_runs(), run_amp_step  the AMP loop on the CPU: torch.autocast(fp16) with a GradScaler (chapter 02's exercise)
  trace_grad_scaler()       the scale step by step when gradients overflow: halve and skip, grow after good steps
  trace_deepspeed_scaler()  the same for DeepSpeed's DynamicLossScaler (hysteresis, loss_scale_window)
  trace_deepspeed_fp16()    DeepSpeed's fp16 optimizer skipping steps for real, where the accelerator allows fp16
Formats are named as everywhere in dslab: "fp32", "fp16", "bf16" (dslab.models.loading.torch_dtype converts).
"""
import contextlib

from dslab.models.loading import torch_dtype


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


def gradients(x, targets, make_layer, dtype="fp32", scale=1.0):
    """Weight gradient and output gradient of an MSE loss, in fp32 or under torch.autocast in "fp16" or "bf16".

    The loss is multiplied by `scale` before backward and the weight gradient divided by it after
    (in fp32), exactly what a loss scaler does. Returns (weight_grad fp32, output_grad as computed).
    """
    import torch
    layer = make_layer()
    seen = {}
    autocast = torch.autocast("cpu", dtype=torch_dtype(dtype)) if dtype != "fp32" else contextlib.nullcontext()
    with autocast:
        y = layer(x)  # (batch, d_out); fp16/bf16 under autocast
    y.register_hook(lambda g: seen.setdefault("dy", g.detach().clone()))
    loss = torch.nn.functional.mse_loss(y.float(), targets)
    (loss * scale).backward()
    return layer.weight.grad.float() / scale, seen["dy"]


def underflow_experiment(scale=2.0**16, **problem):
    """fp32 reference vs fp16 unscaled vs fp16 loss-scaled vs bf16 on the nearly-fit problem."""
    x, targets, make_layer = nearly_fit_problem(**problem)
    ref_w, ref_dy = gradients(x, targets, make_layer)
    rows = {}
    for label, dtype, s in (("fp32", "fp32", 1.0), ("fp16", "fp16", 1.0), ("fp16 x scale", "fp16", scale),
                            ("bf16", "bf16", 1.0)):
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


def reference_amp_clip_step(model, optimizer, scaler, x, y, max_norm, scale=True, unscale_first=True, clip=True,
                            update=True):
    """The 02.amp_clip solution (scale the loss, unscale_, clip, scaler.step, update), or one of the known mistakes:
    no loss scaling (scale=False), clipping the still-scaled gradients (unscale_first=False), no clipping
    (clip=False), no scaler.update() (update=False)."""
    import torch
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    if not scale:  # the loop that circulates: fp16 autocast and clipping, but no GradScaler at all
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        return loss
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    if update:
        scaler.update()
    return loss


def same_weights(a, b):
    """True if two state dicts hold the same tensors to float32 rounding (rtol 1e-6)."""
    import torch
    return all(torch.allclose(a[k], b[k], rtol=1e-6, atol=0.0) for k in b)


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


def deepspeed_scaler(**fp16):
    """DeepSpeed's own DynamicLossScaler, built from an "fp16" config section the way the engine builds it."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    from dslab.this_rank import init_single_process

    init_single_process(quiet=True)  # the scaler asks deepspeed.comm for the rank: make this process rank 0 of 1
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
    """The same spiky training under DeepSpeed's own fp16 ZeRO optimizer; one row per step.

    Runs where the accelerator allows fp16 (every CUDA GPU; the CPU accelerator only on CPUs with oneDNN fp16,
    AVX512-FP16 / AMX-FP16); elsewhere deepspeed.initialize raises ValueError. Rows: step, scale used, skipped (the engine counted
    an overflow and did not update), scale after the step, loss. `fp16` sets the config's fp16 keys.
    """
    import deepspeed
    import torch

    from dslab.config.build import make_config
    from dslab.this_rank import init_single_process

    init_single_process(quiet=True)  # deepspeed.initialize needs a process group: this process, rank 0 of 1
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
