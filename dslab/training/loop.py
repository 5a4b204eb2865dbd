"""The training loop on a DeepSpeed engine (`train`) that pretrains dslab-tiny (`dslab build-base`), the count of a
batch's scored label tokens (`label_tokens`, which `dslab sft`'s per-token loss divides by) and a held-out loss
(`evaluate_loss`)."""
import os
import sys
import time

from dslab.data import IGNORE_INDEX


def default_progress():
    """Show progress bars only where someone watches a terminal (never in nbval or CI logs)."""
    return sys.stderr.isatty() and not os.environ.get("CI")


def label_tokens(batch):
    """How many of the batch's labels are scored: those that are not IGNORE_INDEX, after the model's one-position
    shift (the label at t is the target of the logits at t - 1, so the first label never is)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def _step_mean_of_micro_batches(engine, micro_batches):
    total = 0.0
    for batch in micro_batches:
        loss = engine(**batch).loss
        engine.backward(loss)  # DeepSpeed scales by 1/accum and keeps gradients until the boundary
        engine.step()          # updates weights only on the accumulation boundary
        total += loss.item()
    return total / len(micro_batches)


def train(engine, batches, steps, desc="train", progress=None, log_every=1):
    """Run `steps` optimizer steps of causal-LM training on a DeepSpeed engine.

    batches: an iterator of dicts of tensors (input_ids, labels, optional attention_mask); the engine takes
    gradient_accumulation_steps() micro-batches per optimizer step. Each micro-batch's loss is the model's own
    mean over its tokens, and the step's is the mean of those (engine.backward divides by the accumulation steps):
    right when every micro-batch scores as many tokens, as pretraining blocks do. (`dslab sft`'s chats do not:
    dslab/recipes/sft.py weighs every label token of a step the same.)
    Returns the loss log: one {"step", "loss", "lr", "seconds"} dict per optimizer step (loss as a float)
    every `log_every` steps.
    """
    from tqdm.auto import tqdm

    accum = engine.gradient_accumulation_steps()
    device = engine.device
    log = []
    engine.train()
    start = time.perf_counter()
    bar = tqdm(total=steps, desc=desc, disable=not (default_progress() if progress is None else progress))
    for step in range(1, steps + 1):
        micro_batches = [{k: v.to(device) for k, v in next(batches).items()} for _ in range(accum)]
        loss_value = _step_mean_of_micro_batches(engine, micro_batches)
        if step % log_every == 0 or step == steps:
            lr = engine.get_lr()[0] if engine.get_lr() else None
            log.append({"step": step, "loss": loss_value, "lr": lr, "seconds": time.perf_counter() - start})
        bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
        bar.update(1)
    bar.close()
    return log


def evaluate_loss(model, batches, max_batches=None):
    """Mean next-token loss (nats per supervised token) of a model over an iterable of batches."""
    import torch
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            n = label_tokens(batch)
            total += model(**batch).loss.float().item() * n
            count += n
    return total / max(count, 1)
