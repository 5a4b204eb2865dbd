"""The training loop on a DeepSpeed engine, shared by pretraining (`dslab build-base`) and fine-tuning."""
import contextlib
import io
import os
import sys
import time


@contextlib.contextmanager
def silenced():
    """Discard what the block prints, Python's and child processes' alike (file descriptors 1 and 2).

    The first deepspeed.init_distributed probes which C++ ops can build (a failed `-laio` link test on
    machines without libaio) and prints "... built successfully": noise that differs between machines.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = (os.dup(1), os.dup(2)), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def init_single_process(quiet=False):
    """Make this process rank 0 of a world of 1, so deepspeed.initialize works in a notebook kernel or CLI.

    quiet: discard the C++ op probe's output (see `silenced`).
    """
    import torch.distributed as tdist
    from dslab import dist
    from dslab.launch import free_port, port_is_free
    if tdist.is_available() and tdist.is_initialized():
        return
    # The variables the deepspeed launcher would set for a single rank; existing values win.
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    # A MASTER_PORT inherited from a parent that ran this too may be in use by now; alone in its world, this
    # process is the rendezvous server itself, so any free port serves.
    if os.environ["WORLD_SIZE"] == "1" and not port_is_free(int(os.environ["MASTER_PORT"]), os.environ["MASTER_ADDR"]):
        os.environ["MASTER_PORT"] = str(free_port())
    with silenced() if quiet else contextlib.nullcontext():
        dist.init()


def default_progress():
    """Show progress bars only where someone watches a terminal (never in nbval or CI logs)."""
    return sys.stderr.isatty() and not os.environ.get("CI")


def train(engine, batches, steps, desc="train", progress=None, log_every=1, on_step=None):
    """Run `steps` optimizer steps of causal-LM training on a DeepSpeed engine.

    batches: an iterator of dicts of tensors (input_ids, labels, optional attention_mask); the engine takes
    gradient_accumulation_steps() micro-batches per optimizer step, and the loss of each micro-batch is
    divided by that count inside engine.backward, so the step sees the mean over the big batch.
    Returns the loss log: one {"step", "loss", "lr", "seconds"} dict per optimizer step (loss = mean of
    its micro-batches, as a float) every `log_every` steps.
    """
    from tqdm.auto import tqdm

    accum = engine.gradient_accumulation_steps()
    device = engine.device
    log = []
    engine.train()
    start = time.perf_counter()
    bar = tqdm(total=steps, desc=desc, disable=not (default_progress() if progress is None else progress))
    for step in range(1, steps + 1):
        total = 0.0
        for _ in range(accum):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            loss = engine(**batch).loss
            engine.backward(loss)  # DeepSpeed scales by 1/accum and keeps gradients until the boundary
            engine.step()          # updates weights only on the accumulation boundary
            total += loss.item()
        loss_value = total / accum
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
            labels = batch["labels"]
            n = int((labels[:, 1:] != -100).sum())  # tokens that have a target after the shift
            total += model(**batch).loss.float().item() * n
            count += n
    return total / max(count, 1)
