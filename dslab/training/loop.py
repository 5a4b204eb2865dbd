"""The training loop on a DeepSpeed engine (`train`) shared by pretraining (`dslab build-base`) and fine-tuning
(`dslab sft`), with the token-level loss it uses and a held-out loss (`evaluate_loss`)."""
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


def summed_token_loss(model, batch):
    """Cross-entropy summed (not averaged) over the batch's label tokens, computed in fp32."""
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _step_mean_of_micro_batches(engine, micro_batches):
    total = 0.0
    for batch in micro_batches:
        loss = engine(**batch).loss
        engine.backward(loss)  # DeepSpeed scales by 1/accum and keeps gradients until the boundary
        engine.step()          # updates weights only on the accumulation boundary
        total += loss.item()
    return total / len(micro_batches)


def _step_mean_over_tokens(engine, micro_batches):
    import torch
    import torch.distributed as tdist

    # The denominator first: every label token of the step, in all its micro-batches on every rank.
    n_tokens = torch.tensor(sum(label_tokens(b) for b in micro_batches), device=engine.device)
    tdist.all_reduce(n_tokens)
    n_tokens.clamp_(min=1)
    scale = len(micro_batches) * tdist.get_world_size()
    total = torch.zeros((), device=engine.device)
    for batch in micro_batches:
        loss = summed_token_loss(engine, batch)
        # engine.backward divides by the accumulation steps and the ranks average their gradients (/ world
        # size): undo both, so the step follows (sum of every token's loss) / (every label token).
        engine.backward(loss * scale / n_tokens)
        engine.step()
        total += loss.detach()
    tdist.all_reduce(total)
    return total.item() / n_tokens.item()


def train(engine, batches, steps, desc="train", progress=None, log_every=1, on_step=None, per_token=False):
    """Run `steps` optimizer steps of causal-LM training on a DeepSpeed engine.

    batches: an iterator of dicts of tensors (input_ids, labels, optional attention_mask); the engine takes
    gradient_accumulation_steps() micro-batches per optimizer step.
    per_token=False: each micro-batch's loss is the model's own mean over its tokens, and the step's is the
    mean of those (engine.backward divides by the accumulation steps); right when every micro-batch scores as
    many tokens, as pretraining blocks do.
    per_token=True: the step's loss is the mean over every label token of all its micro-batches and all ranks,
    so every label token weighs the same, whichever micro-batch or rank it lands in (chapter 05's script).
    Returns the loss log: one {"step", "loss", "lr", "seconds"} dict per optimizer step (loss as a float)
    every `log_every` steps.
    """
    from tqdm.auto import tqdm

    accum = engine.gradient_accumulation_steps()
    device = engine.device
    one_step = _step_mean_over_tokens if per_token else _step_mean_of_micro_batches
    log = []
    engine.train()
    start = time.perf_counter()
    bar = tqdm(total=steps, desc=desc, disable=not (default_progress() if progress is None else progress))
    for step in range(1, steps + 1):
        micro_batches = [{k: v.to(device) for k, v in next(batches).items()} for _ in range(accum)]
        loss_value = one_step(engine, micro_batches)
        if step % log_every == 0 or step == steps:
            lr = engine.get_lr()[0] if engine.get_lr() else None
            log.append({"step": step, "loss": loss_value, "lr": lr, "seconds": time.perf_counter() - start})
        bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
        bar.update(1)
        if on_step is not None:
            on_step(step, loss_value)
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
