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


SOLUTIONS = {
    "03.grad_accum_steps": grad_accum_steps,
    "03.fix_loop": fix_loop,
    "03.token_loss": token_loss,
}
