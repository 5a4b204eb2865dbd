"""Instructor solutions for notebooks/03_gradient_accumulation.ipynb (checked by tests/test_exercises.py)."""

# 03.grad_accum_steps: 512 = 4 x gradient_accumulation_steps x 16  ->  8.
grad_accum_steps = 512 // (4 * 16)


# 03.fix_loop: divide each micro-batch's (mean) loss by the number of micro-batches, then backward
# (summing them instead leaves k x the big batch's gradient; the checker says so).
def fix_loop(model, micro_batches):
    for micro_batch in micro_batches:
        loss = model(**micro_batch).loss / len(micro_batches)
        loss.backward()


# 03.token_loss: sum of this micro-batch's token losses over the tokens of the whole window;
# HF causal LMs do exactly that when given num_items_in_batch.
def token_loss(model, micro_batch, window_targets):
    import torch
    return model(**micro_batch, num_items_in_batch=torch.tensor(window_targets)).loss


# 03.engine_loop: a whole DeepSpeed run with accumulation. The config says the batch triple from the arguments
# (train_batch_size = micro x accumulation x world size) and trains as plain PyTorch does (no clipping, no weight
# decay, fp32); the loop passes each micro-batch's mean loss to engine.backward (which divides it by the
# accumulation steps) and calls engine.step() after every micro-batch (the engine steps the optimizer at the boundary
# and zeroes the gradients itself).
def make_model(d_in, d_out):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(d_in, 16), torch.nn.ReLU(), torch.nn.Linear(16, d_out))


def make_config(micro_batch_size, grad_accum_steps, world_size, lr):
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
    }


def train(model, ds_config, micro_batches):
    import deepspeed
    import torch.nn.functional as F

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in micro_batches:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return engine


SOLUTIONS = {
    "03.grad_accum_steps": grad_accum_steps,
    "03.fix_loop": fix_loop,
    "03.token_loss": token_loss,
    "03.engine_loop": (make_model, make_config, train),
}
