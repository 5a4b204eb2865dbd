"""Training loops a learner writes for the engine-loop exercises (03.engine_loop, 04.offload_loop): the right one and
the usual mistakes, one each, as the exercises' known wrong answers. Each `train(model, ds_config, micro_batches)`
is the right loop with one thing changed; `small_model(d_in, d_out)` is a model for them."""


def small_model(d_in, d_out):
    """A small MLP, [rows, d_in] -> [rows, d_out]."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(d_in, 8), torch.nn.Tanh(), torch.nn.Linear(8, d_out))


def train(model, ds_config, micro_batches):
    """The right loop: initialize once; per micro-batch the mean loss to engine.backward, then engine.step()."""
    import deepspeed
    import torch.nn.functional as F

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in micro_batches:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return engine


def train_loss_divided_twice(model, ds_config, micro_batches):
    import deepspeed
    import torch.nn.functional as F

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in micro_batches:
        loss = F.mse_loss(engine(x), y) / ds_config["gradient_accumulation_steps"]   # engine.backward divides too
        engine.backward(loss)
        engine.step()
    return engine


def train_optimizer_step(model, ds_config, micro_batches):
    import deepspeed
    import torch.nn.functional as F

    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for i, (x, y) in enumerate(micro_batches, 1):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        if i % ds_config["gradient_accumulation_steps"] == 0:
            optimizer.step()                                  # plain PyTorch's habit: a second update
    return engine


def train_zero_grad(model, ds_config, micro_batches):
    import deepspeed
    import torch.nn.functional as F

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in micro_batches:
        engine.zero_grad()                                    # erases the micro-batches before this one
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    return engine


def train_loss_backward(model, ds_config, micro_batches):
    import deepspeed
    import torch.nn.functional as F

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in micro_batches:
        F.mse_loss(engine(x), y).backward()                   # not through the engine
        engine.step()
    return engine


def train_step_at_boundary(model, ds_config, micro_batches):
    import deepspeed
    import torch.nn.functional as F

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for i, (x, y) in enumerate(micro_batches, 1):
        engine.backward(F.mse_loss(engine(x), y))
        if i % ds_config["gradient_accumulation_steps"] == 0:
            engine.step()                                     # plain PyTorch's habit: step once per window
    return engine


def train_client_optimizer(model, ds_config, micro_batches):
    import deepspeed
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)   # not DeepSpeedCPUAdam
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    for x, y in micro_batches:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    return engine
