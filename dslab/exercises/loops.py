"""Training loops a learner writes for the engine-loop exercises (03.engine_loop, 04.offload_loop), for their known
wrong answers: `train` is the right loop, and with `mistake=` the same loop with one usual mistake (each one a
`functools.partial`, which travels to the ranks as it is); `small_model(d_in, d_out)` is a model for them and
`config(...)` the ds_config they run with."""
import functools

# What each mistake changes in the right loop (the checker must name each one).
MISTAKES = {
    "loss divided": "passes the loss / gradient_accumulation_steps to engine.backward, which divides it again",
    "optimizer step": "steps the optimizer deepspeed.initialize returned, after the engine's step, at each window end",
    "zero_grad": "zeroes the gradients before every micro-batch, as a plain PyTorch loop does",
    "loss.backward": "calls loss.backward() instead of engine.backward(loss) (right at ZeRO 1-3, refused at 0)",
    "no gas scaling": "calls engine.backward(loss, scale_wrt_gas=False) and does not divide the loss itself",
    "step at boundary": "calls engine.step() only at the end of each accumulation window",
    "client optimizer": "builds a torch AdamW itself and hands it to deepspeed.initialize",
}


def small_model(d_in, d_out):
    """A small MLP, [rows, d_in] -> [rows, d_out]."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(d_in, 8), torch.nn.Tanh(), torch.nn.Linear(8, d_out))


def config(micro_batch_size, grad_accum_steps, world_size, lr, zero=None, optimizer=True, **top):
    """A ds_config that trains as plain PyTorch does (fp32, AdamW, no clipping): ZeRO stage 1 unless `zero` says
    otherwise, no "optimizer" section if not `optimizer`, `top` keys replaced or added."""
    cfg = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum_steps,
           "train_batch_size": micro_batch_size * grad_accum_steps * world_size, "gradient_clipping": 0.0,
           "zero_optimization": zero or {"stage": 1}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}
    cfg.update(top)
    return {key: value for key, value in cfg.items() if value is not None}


def train(model, ds_config, micro_batches, mistake=None):
    """The right loop (mistake=None): initialize once; per micro-batch the mean loss to engine.backward, then
    engine.step(). Or the loop with one of MISTAKES."""
    import deepspeed
    import torch
    import torch.nn.functional as F

    if mistake is not None and mistake not in MISTAKES:
        raise ValueError(f"unknown mistake {mistake!r}; known: {', '.join(MISTAKES)}")
    own = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0) if mistake == "client optimizer" else None
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=own, config=ds_config,
                                                   model_parameters=None if own else model.parameters())
    accum = ds_config.get("gradient_accumulation_steps", 1)
    for i, (x, y) in enumerate(micro_batches, 1):
        if mistake == "zero_grad":
            engine.zero_grad()
        loss = F.mse_loss(engine(x), y)
        if mistake == "loss divided":
            loss = loss / accum
        if mistake == "loss.backward":
            loss.backward()
        elif mistake == "no gas scaling":
            engine.backward(loss, scale_wrt_gas=False)
        else:
            engine.backward(loss)
        if mistake != "step at boundary" or i % accum == 0:
            engine.step()
        if mistake == "optimizer step" and i % accum == 0:
            optimizer.step()
    return engine


def with_mistake(mistake):
    """train with one of MISTAKES: a wrong answer's third function."""
    return functools.partial(train, mistake=mistake)
