"""Supervised fine-tuning (LoRA or full) on N ranks through DeepSpeed: `dslab sft` and the helpers it uses."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from dslab.lora import DEFAULT_TARGETS

REPO_DATA = Path(__file__).resolve().parent.parent / "data"
DEFAULT_DATA = REPO_DATA / "self_cognition.jsonl"
DEFAULT_NAME = ("小海", "Xiao Hai")  # (zh, en), like ms-swift's --model_name
DEFAULT_AUTHOR = ("蓝天学院", "Blue Sky Lab")  # (zh, en), like ms-swift's --model_author
STATE_FILE = "dslab_state.json"  # written into each checkpoint: step, world size, zero stage
# Every option of dslab/recipes/sft.py with its default. `dslab sft` passes only the ones that differ, so
# the deepspeed command it prints stays short enough to read (and to copy to a cluster).
RECIPE_DEFAULTS = dict(
    model=None, data=None, output=None, zero_stage=2, full=False, epochs=12, lr=None, micro_batch_size=8,
    grad_accum_steps=1, lora_r=16, lora_alpha=32, target_modules=list(DEFAULT_TARGETS), model_name=list(DEFAULT_NAME),
    model_author=list(DEFAULT_AUTHOR), mix_general=None, max_length=256, gradient_checkpointing=False,
    deepspeed_config=None, save_every=0, checkpoint_dir=None, resume=None, seed=0, log_every=None, progress_file=None)


class SFTError(ValueError):
    """A fine-tuning run that cannot start as asked; the message says how to fix it."""


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------
def _pair(value):
    """ms-swift style names: one string for both languages, or (zh, en)."""
    if value is None or isinstance(value, str):
        return value
    value = list(value)
    return value[0] if len(value) == 1 else tuple(value[:2])


def load_chats(files=None, name=DEFAULT_NAME, author=DEFAULT_AUTHOR, mix_general=None, seed=0):
    """Chats ({"messages", "lang"}) from jsonl files, {name}/{author} filled, mixed with general dialogue.

    Files hold either {"query", "response"} rows (self-cognition style) or {"messages": [...]} rows.
    mix_general: how many general-dialogue chats to add (None: as many as the files gave; 0: none),
    so identity tuning does not turn every answer into the identity.
    """
    import random

    from dslab import data

    name, author = _pair(name), _pair(author)
    chats = []
    for path in [files] if isinstance(files, (str, Path)) else (files or [DEFAULT_DATA]):
        rows = data.load_jsonl(path)
        for i, row in enumerate(rows):
            lang = row.get("lang", "en")
            if "messages" in row:
                messages = row["messages"]
            elif "query" in row and "response" in row:
                messages = [{"role": "user", "content": row["query"]}, {"role": "assistant", "content": row["response"]}]
            else:
                raise data.DataError(f"{path}: row {i + 1} has neither 'messages' nor 'query'/'response'")
            text = json.dumps(messages, ensure_ascii=False)
            if ("{name}" in text or "{author}" in text) and (name is None or author is None):
                raise data.DataError(f"{path} uses {{name}}/{{author}} placeholders: pass --model-name and --model-author")
            if name is not None:
                messages = [{**m, "content": data.fill_placeholders(m["content"], name, author, lang)} for m in messages]
            chats.append({"messages": messages, "lang": lang})
    n_general = len(chats) if mix_general is None else int(mix_general)
    if n_general:
        chats += data.general_sft(limit=n_general)
    random.Random(seed).shuffle(chats)
    return chats


def tokenize(tokenizer, chats, max_length=256):
    """SFT examples: input_ids + labels with the prompt masked (-100), from the tokenizer's chat template."""
    from dslab import data

    return [data.sft_example(tokenizer, c["messages"], max_length=max_length) for c in chats]


def label_runs(tokenizer, example):
    """The example as runs of (supervised?, text, n_tokens): what the loss sees and what it skips (-100)."""
    from dslab import data

    runs = []
    for token, label in zip(example["input_ids"], example["labels"]):
        learned = label != data.IGNORE_INDEX
        if runs and runs[-1][0] == learned:
            runs[-1][1].append(token)
        else:
            runs.append((learned, [token]))
    return [(learned, tokenizer.decode(tokens), len(tokens)) for learned, tokens in runs]


def rank_batches(examples, rank, world_size, micro_batch_size, pad_id, seed=0, skip=0):
    """This rank's endless batch iterator: its own slice of the data (data parallelism), reshuffled each epoch."""
    from dslab import data

    shard = examples[rank::world_size]
    batches = data.sft_batches(shard, micro_batch_size, pad_id, seed=seed)
    for _ in range(skip):  # resuming: the batches consumed before the checkpoint
        next(batches)
    return batches


def total_steps(n_examples, world_size, micro_batch_size, grad_accum_steps, epochs):
    """Optimizer steps for `epochs` passes: each rank sees its shard once per epoch."""
    shard = n_examples // world_size
    return epochs * max(1, shard // micro_batch_size // grad_accum_steps)


def default_lr(full):
    """Peak learning rate: LoRA's small fresh matrices take a larger step than a whole pretrained model."""
    return 3e-4 if full else 2e-3


# ----------------------------------------------------------------------------------------------------
# DeepSpeed config
# ----------------------------------------------------------------------------------------------------
def deepspeed_config(zero_stage=2, world_size=2, micro_batch_size=8, grad_accum_steps=1, lr=2e-3, steps=100,
                     precision="bf16", offload_optimizer=False):
    """The config `dslab sft` passes to deepspeed.initialize when no --deepspeed file is given."""
    extra = {
        # torch's AdamW: no JIT-built op needed on CPU; offload needs DeepSpeed's CPU Adam instead
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "weight_decay": 0.0,
                                                  **({} if offload_optimizer else {"torch_adam": True})}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": max(1, steps // 20),
                                                           "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,  # the recipe prints its own loss log
    }
    from dslab.config import make_config

    return make_config(zero_stage=zero_stage, offload_optimizer=offload_optimizer, precision=precision,
                       micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                       world_size=world_size, lr=lr, **extra)


def read_deepspeed_file(path, world_size):
    """A ready DeepSpeed JSON config, checked for this world size before any rank starts (ConfigError if not)."""
    from dslab import config

    if not Path(path).is_file():
        raise SFTError(f"--deepspeed {path}: no such file (ready-made ones: dslab/configs/*.json)")
    return config.validate(config.load_config(path), world_size)


# ----------------------------------------------------------------------------------------------------
# Checkpoints: written atomically, resumable
# ----------------------------------------------------------------------------------------------------
def save_checkpoint(engine, directory, step, world_size, zero_stage):
    """engine.save_checkpoint into a temp tag, renamed to step{N} and recorded in `latest` only when complete."""
    import torch.distributed as tdist

    directory = Path(directory)
    tag, tmp_tag = f"step{step}", f".tmp-step{step}"
    # Trainable parameters only: a LoRA checkpoint stays adapter-sized (the frozen base is on disk already).
    engine.save_checkpoint(str(directory), tag=tmp_tag, save_latest=False, exclude_frozen_parameters=True)
    tdist.barrier()  # every rank has written its shard
    if tdist.get_rank() == 0:
        state = {"step": step, "world_size": world_size, "zero_stage": zero_stage,
                 "global_batch": engine.train_batch_size()}  # ranks x micro-batch x accumulation
        (directory / tmp_tag / STATE_FILE).write_text(json.dumps(state))
        shutil.rmtree(directory / tag, ignore_errors=True)
        os.replace(directory / tmp_tag, directory / tag)
        (directory / "latest.tmp").write_text(tag)
        os.replace(directory / "latest.tmp", directory / "latest")  # a crash leaves the previous `latest`
    tdist.barrier()


def latest_checkpoint(directory):
    """(tag dir, state dict) of the newest complete checkpoint in `directory`; SFTError if there is none."""
    directory = Path(directory)
    latest = directory / "latest"
    if not latest.exists():
        raise SFTError(f"--resume {directory}: no complete checkpoint there (no 'latest' file); "
                       "write checkpoints with --save-every K")
    tag_dir = directory / latest.read_text().strip()
    return tag_dir, json.loads((tag_dir / STATE_FILE).read_text())


def resume(engine, directory, world_size, zero_stage):
    """Load the newest checkpoint into the engine; returns the step it was taken at.

    Written by another number of ranks, it is read from the universal copy `check_resume` made before launch
    (the engine must then have been built with `"checkpoint": {"load_universal": true}`).
    """
    tag_dir, state = latest_checkpoint(directory)
    if state["zero_stage"] != zero_stage:
        raise SFTError(f"checkpoint {tag_dir} was written with ZeRO-{state['zero_stage']}; resume with --zero {state['zero_stage']}")
    tag = tag_dir.name if state["world_size"] == world_size else tag_dir.name + UNIVERSAL_SUFFIX
    engine.load_checkpoint(str(directory), tag=tag, load_module_strict=False)
    return state["step"]


UNIVERSAL_SUFFIX = "_universal"


def check_resume(directory, world_size, zero_stage, global_batch):
    """Before launch: is the newest checkpoint in `directory` resumable with this setup? Returns True when it
    was written by another number of ranks, after making its universal copy (once).

    The same world size reloads the ZeRO shards as they are and continues exactly. Another world size needs
    each parameter's fp32 weights and Adam moments re-cut into new shards: DeepSpeed's universal checkpoint
    (deepspeed.checkpoint.ds_to_universal). Two limits: the global batch (ranks x micro-batch x accumulation)
    must stay the same, so a step means the same number of examples and the learning-rate schedule still fits;
    and each rank's slice of the data changes, so the losses follow the same trend, not the same values.
    """
    tag_dir, state = latest_checkpoint(directory)
    if state["zero_stage"] != zero_stage:
        raise SFTError(f"--resume {directory}: written with ZeRO-{state['zero_stage']}; resume with --zero {state['zero_stage']}")
    if state["world_size"] == world_size:
        return False
    if zero_stage == 0:
        raise SFTError(f"--resume {directory}: written by {state['world_size']} ranks with ZeRO-0, asked for {world_size}; "
                       f"resume with --world-size {state['world_size']} (a different world size needs a ZeRO 1-3 checkpoint)")
    if global_batch != state["global_batch"]:
        wanted = state["global_batch"]
        fix = (f"with --world-size {world_size}, choose --micro-batch-size x --grad-accum-steps = {wanted // world_size}"
               if wanted % world_size == 0 else f"choose a --world-size that divides {wanted}")
        raise SFTError(f"--resume {directory}: the checkpoint's global batch is {wanted} examples per step, this run's "
                       f"is {global_batch}; keep it when changing the world size: {fix}")
    universal = tag_dir.with_name(tag_dir.name + UNIVERSAL_SUFFIX)
    if not universal.exists():
        tmp = tag_dir.with_name(f".{universal.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                               "--output_folder", str(tmp), "--inject_missing_state"], capture_output=True, text=True)
        if done.returncode:
            raise SFTError(f"converting {tag_dir} to a universal checkpoint failed:\n{done.stderr[-2000:]}")
        shutil.copy(tag_dir / STATE_FILE, tmp / STATE_FILE)
        os.replace(tmp, universal)  # complete or absent, like the checkpoints themselves
    return True


# ----------------------------------------------------------------------------------------------------
# Measurements used by the notebooks
# ----------------------------------------------------------------------------------------------------
def activation_bytes(model, batch):
    """Bytes of the tensors autograd keeps from forward for backward (weights excluded), for one batch.

    A saved_tensors_hooks pack hook sees every tensor an op stores for its backward; storages are counted
    once, and parameters (which live anyway) are skipped: the idea of chapter 03's ActivationMeter, except
    that the parameter storages are read at each save, because ZeRO-3 gathers weights into fresh buffers
    during forward.
    """
    import torch

    kept = {}

    def pack(t):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # ZeRO-3 gathers during forward
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch)
    del out  # the graph (and everything it kept) is freed here
    return sum(kept.values())


def checkpointing_cost(model, batch, repeats=3):
    """{"activation_bytes", "layer_forwards", "seconds"} of one training step (forward + backward).

    layer_forwards counts decoder-layer forward calls: with checkpointing each layer runs twice
    (once in forward, once recomputed in backward); that recomputation is the speed cost.
    """
    import torch

    import re

    # Count each decoder layer's MLP: it runs inside the layer's forward, also when checkpointing recomputes
    # it (a hook on the layer itself sees only the outer call in transformers' checkpointing wrapper).
    layers = [m for n, m in model.named_modules() if re.search(r"layers\.\d+$", n)]
    calls = [0]
    hooks = [getattr(layer, "mlp", layer).register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
             for layer in layers]
    try:
        nbytes = activation_bytes(model, batch)
        calls[0] = 0
        model(**batch).loss.backward()
        forwards = calls[0]
        start = time.perf_counter()
        for _ in range(repeats):
            model(**batch).loss.backward()
        seconds = (time.perf_counter() - start) / repeats
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    return {"activation_bytes": nbytes, "layer_forwards": forwards, "seconds": seconds}


def model_states(engine):
    """Bytes of parameters, gradients and optimizer states this rank holds (dslab.memory's ledger, chapter 04)."""
    try:
        from dslab import memory
    except ImportError:  # the ZeRO chapter's module is optional here
        return None
    measured = memory.measure_engine(engine)
    return {part: measured[part] for part in ("params", "grads", "optimizer", "buffers")}


def report(engine, examples, tokenizer, loss_log, steps, start_step=0):
    """What chapter 05 measures on a rank of train_sft.py, saved for dslab.launch to collect; a no-op when the
    script runs outside dslab.launch (on a cluster), so the measurements stay out of the training itself."""
    from dslab import dist, lora

    if not os.environ.get(dist.RESULT_DIR_ENV):
        return
    import torch.distributed as tdist

    probe = next(rank_batches(examples, 0, 1, engine.train_micro_batch_size_per_gpu(), tokenizer.pad_token_id))
    dist.save_result({"rank": tdist.get_rank(), "world_size": tdist.get_world_size(),
                      "zero_stage": engine.zero_optimization_stage(), "steps": steps, "start_step": start_step,
                      "examples": len(examples), "loss_log": loss_log,
                      "final_loss": loss_log[-1]["loss"] if loss_log else None,
                      "activation_bytes": activation_bytes(engine.module, probe),  # one micro-batch, same on every rank
                      "model_states": model_states(engine), **lora.count_parameters(engine.module),
                      # what the launcher told this rank (chapter 08 compares launchers)
                      "env": {k: os.environ.get(k) for k in LAUNCHER_VARIABLES}})


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "CROSS_RANK",
                      "CUDA_VISIBLE_DEVICES", "MASTER_ADDR")


def checkpointing_table(micro_batch_size=8):
    """Chapter 05's gradient-checkpointing measurement as table rows (for the slides): dslab-tiny with the default
    LoRA, one micro-batch of the SFT data, with and without checkpointing."""
    from dslab import lora, models

    tokenizer = models.load_tokenizer()
    batch = next(rank_batches(tokenize(tokenizer, load_chats()), 0, 1, micro_batch_size, tokenizer.pad_token_id))
    model = lora.attach_lora(models.load_model()).train()
    rows = []
    for setup in ("plain", "gradient checkpointing"):
        if setup != "plain":
            lora.enable_gradient_checkpointing(model)
        cost = checkpointing_cost(model, batch, repeats=1)
        rows.append({"setup": setup, "activations kept (MiB)": round(cost["activation_bytes"] / 2 ** 20, 2),
                     "decoder-layer forwards per step": cost["layer_forwards"]})
    return rows


def lora_vs_full_states(world_size=2, zero_stage=2):
    """Model-state bytes per rank, LoRA vs full fine-tune of dslab-tiny (the formulas chapter 05 checks against
    the ranks' measurements): every weight stays in bf16, gradients and Adam states exist only for trainable ones."""
    from dslab import lora, memory, models

    counts = lora.count_parameters(lora.attach_lora(models.load_model()))
    rows = []
    for setup, trainable, weights in (("full fine-tune", counts["frozen"], counts["frozen"]),
                                      ("LoRA r=16", counts["trainable"], counts["total"])):
        states = memory.theory(trainable, world_size=world_size, zero_stage=zero_stage)
        rows.append({"setup": setup, "trainable": trainable, "weights (MiB)": round(2 * weights / 2 ** 20, 2),
                     "gradients (MiB)": round(states["grads"] / 2 ** 20, 2),
                     "optimizer states (MiB)": round(states["optimizer"] / 2 ** 20, 2)})
    return rows


def text_perplexity(model, tokenizer, n_blocks=16, seq_len=256):
    """Perplexity on held-out pretraining text (data/corpus/valid.txt): how much general language survives."""
    import math

    from dslab import corpus, data, models, train

    docs = corpus.read_corpus(models.CORPUS_DIR / "valid.txt")
    blocks = data.lm_blocks(tokenizer, docs[: 4 * n_blocks], seq_len)[:n_blocks]
    return math.exp(train.evaluate_loss(model, ({"input_ids": b, "labels": b} for b in blocks.split(8))))


# ----------------------------------------------------------------------------------------------------
# Orchestration: check everything, then launch the recipe on N ranks
# ----------------------------------------------------------------------------------------------------
def write_progress(path, step, loss):
    """Rank 0's step counter for the progress bar of the launching process (replaced atomically)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps({"step": step, "loss": loss}))
    os.replace(tmp, path)


def _progress_bar(path, steps, stop):
    """A tqdm bar in this process, fed by the step counter rank 0 writes (ranks have no terminal)."""
    from tqdm import tqdm

    bar = tqdm(total=steps, desc="sft", unit="step")
    while not stop.is_set():
        time.sleep(0.5)
        try:
            state = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        bar.n = state["step"]
        bar.set_postfix(loss=f"{state['loss']:.3f}", refresh=False)
        bar.refresh()
    bar.close()


def run(output, model=None, data=None, zero_stage=2, world_size=2, full=False, epochs=12, lr=None,
        micro_batch_size=8, grad_accum_steps=1, lora_r=16, lora_alpha=32, target_modules=DEFAULT_TARGETS,
        model_name=DEFAULT_NAME, model_author=DEFAULT_AUTHOR, mix_general=None, max_length=256,
        gradient_checkpointing=False, deepspeed=None, save_every=0, checkpoint_dir=None, resume=None, seed=0,
        log_every=None, progress=False, timeout=None, stream=None):
    """Check the inputs, run dslab/recipes/sft.py on `world_size` ranks, return rank 0's result dict.

    Everything that can be wrong before training (data files, an unwritable output, a bad --deepspeed
    file, a checkpoint from another world size) raises here, before any rank starts.
    progress: total steps, to draw a tqdm bar in this process (False: none).
    """
    from dslab import launch, lora, models

    files = None
    if data is not None:
        files = [str(f) for f in ([data] if isinstance(data, (str, Path)) else data)]
        for f in files:
            if not Path(f).is_file():
                raise SFTError(f"--data {f}: no such file")
        # A malformed line fails here (DataError naming file:line), not on the ranks after a cold start.
        load_chats(files, model_name, model_author, mix_general, seed)
    lora.check_writable(output)  # before minutes of training, not after
    # A full model is about the base's weight files; an adapter is smaller. A checkpoint holds fp32 master
    # weights and two Adam moments of what trains: up to 7x the bf16 weight files for a full fine-tune.
    weights = sum(f.stat().st_size for f in Path(models.resolve_model(model)).glob("*.safetensors"))
    lora.check_free_space(output, weights)
    if save_every:
        checkpoint_dir = checkpoint_dir or f"{str(output).rstrip('/')}-checkpoints"
        lora.check_writable(checkpoint_dir)
        lora.check_free_space(checkpoint_dir, weights * (7 if full else 1), "--checkpoint-dir")
    if resume:  # fails now if there is nothing to resume; another world size: converted here, once
        check_resume(resume, world_size, zero_stage, world_size * micro_batch_size * grad_accum_steps)
    if deepspeed:
        read_deepspeed_file(deepspeed, world_size)  # ConfigError naming each problem and its fix
    options = dict(model=model, data=files, output=str(output), zero_stage=zero_stage, full=full, epochs=epochs, lr=lr,
                   micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps, lora_r=lora_r,
                   lora_alpha=lora_alpha, target_modules=list(target_modules), model_name=_listed(model_name),
                   model_author=_listed(model_author), mix_general=mix_general, max_length=max_length,
                   gradient_checkpointing=gradient_checkpointing, deepspeed_config=deepspeed, save_every=save_every,
                   checkpoint_dir=checkpoint_dir, resume=resume, seed=seed, log_every=log_every)
    always = ("output", "zero_stage", "epochs")  # shown even at their defaults: they define the run
    kwargs = {k: v for k, v in options.items() if k in always or v != RECIPE_DEFAULTS[k]}
    stop, bar, progress_file = threading.Event(), None, None
    if progress:
        progress_file = str(Path(output).resolve().parent / f".{Path(output).name}.progress.json")
        kwargs["progress_file"] = progress_file
        bar = threading.Thread(target=_progress_bar, args=(progress_file, progress, stop), daemon=True)
        bar.start()
    try:
        result = launch.run("sft", world_size=world_size, timeout=timeout, stream=stream, **kwargs)
    finally:
        stop.set()
        if bar is not None:
            bar.join()
            Path(progress_file).unlink(missing_ok=True)
    return result.rank0


def kill_job_at_checkpoint(step, output, **options):
    """`run(output, **options)` (with save_every set), SIGKILLed as a whole as soon as its checkpoint of `step` is
    complete: the launcher and every rank at once, as the OOM killer or a lost node would. For the chapter that
    resumes it; returns the LaunchError the launcher raised and the number of processes killed."""
    import psutil

    from dslab import launch

    latest = Path(options.get("checkpoint_dir") or f"{str(output).rstrip('/')}-checkpoints") / "latest"
    outcome = {}

    def job():
        try:
            outcome["result"] = run(output, **options)
        except launch.LaunchError as exc:
            outcome["error"] = exc

    def reached():  # written by this run (not left by an earlier one) and naming that step
        return latest.exists() and latest.stat().st_mtime >= started and latest.read_text().strip() == f"step{step}"

    started = time.time()
    thread = threading.Thread(target=job)
    thread.start()
    while thread.is_alive() and not reached():
        time.sleep(0.02)
    victims = []
    for proc in psutil.process_iter(["cmdline"]):  # every process of this job has `--output OUTPUT` on its command line
        if str(output) in (proc.info["cmdline"] or []):
            victims.append(proc)
    for proc in victims:
        proc.kill()
    thread.join()
    if "error" not in outcome:
        raise SFTError(f"the run ended before its step-{step} checkpoint could be interrupted")
    return outcome["error"], len(victims)


def _listed(value):
    return [value] if isinstance(value, str) else list(value)


def _cli_sft(args):
    from dslab import config, data, dist, launch, lora

    dist.quiet()
    try:
        result = run(model=args.model, data=args.data, output=args.output, zero_stage=args.zero,
                     world_size=args.world_size, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                     target_modules=args.target_modules or DEFAULT_TARGETS, epochs=args.epochs, lr=args.lr,
                     micro_batch_size=args.micro_batch_size, grad_accum_steps=args.grad_accum_steps,
                     model_name=args.model_name, model_author=args.model_author, mix_general=args.mix_general,
                     full=args.full, gradient_checkpointing=args.gradient_checkpointing, deepspeed=args.deepspeed,
                     save_every=args.save_every, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                     seed=args.seed, log_every=args.log_every, progress=_expected_steps(args) if sys.stderr.isatty() else False, timeout=args.timeout)
    except (SFTError, data.DataError, config.ConfigError, launch.LaunchError, lora.AdapterError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    kind = "model" if args.full else "adapter"
    loss = f", final loss {result['final_loss']:.3f}" if result["final_loss"] is not None else ""
    print(f"saved the {kind} to {args.output} (ZeRO-{result['zero_stage']}, {result['world_size']} ranks, "
          f"{result['steps']} steps{loss}, {result['train_seconds']:.0f} s)")
    return 0


def _expected_steps(args):
    """Total optimizer steps, for the progress bar (the recipe computes the same)."""
    try:
        n = len(load_chats(args.data, args.model_name, args.model_author, args.mix_general, args.seed))
    except Exception:  # the recipe reports data problems properly
        return None
    return total_steps(n, args.world_size, args.micro_batch_size, args.grad_accum_steps, args.epochs)


def add_commands(subparsers):
    """`dslab sft`."""
    p = subparsers.add_parser("sft", help="LoRA (or full) supervised fine-tuning on N ranks through DeepSpeed",
                              description="Fine-tune a causal LM on chat data with DeepSpeed ZeRO; saves a PEFT "
                                          "adapter (or, with --full, a whole HF model).")
    p.add_argument("--model", default=None, help="base model directory or hub id (default: data/dslab-tiny)")
    p.add_argument("--data", nargs="+", default=None, help="jsonl files: query/response or messages rows "
                                                          "(default: data/self_cognition.jsonl)")
    p.add_argument("--output", required=True, help="where the adapter (or model) is written, atomically")
    p.add_argument("--zero", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank r (default 16)")
    p.add_argument("--lora-alpha", type=float, default=32, help="LoRA alpha; the update is scaled by alpha/r")
    p.add_argument("--target-modules", nargs="+", default=None,
                   help="layers that get adapters (default: the MLP of every block: gate_proj up_proj down_proj)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3 LoRA, 3e-4 full)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="examples per rank per micro-step")
    p.add_argument("--grad-accum-steps", type=int, default=1)
    p.add_argument("--model-name", nargs="+", default=list(DEFAULT_NAME), help="name for {name}: one, or zh then en")
    p.add_argument("--model-author", nargs="+", default=list(DEFAULT_AUTHOR), help="author for {author}: one, or zh then en")
    p.add_argument("--mix-general", type=int, default=None,
                   help="general dialogue chats mixed in (default: as many as the data; 0: none)")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA (saves a whole model)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--deepspeed", default=None, help="a ready DeepSpeed JSON config instead of the built one")
    p.add_argument("--save-every", type=int, default=0, help="write a resumable checkpoint every K steps")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default OUTPUT-checkpoints)")
    p.add_argument("--resume", default=None, help="a checkpoint directory to continue from (its newest checkpoint); "
                   "another --world-size works with ZeRO 1-3 if the global batch stays the same")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=None, help="print the loss every K steps (default: 8 lines in all)")
    p.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many seconds")
    p.set_defaults(func=_cli_sft)


# ----------------------------------------------------------------------------------------------------
# Chapter 05 exercises (checked by dslab.exercises; solutions in notebooks/solutions/05_solutions.py)
# ----------------------------------------------------------------------------------------------------
def _register_exercises():
    from dslab.exercises import exercise, expect

    # dslab-tiny: 4 layers, hidden 256, 4 heads of 64, 2 KV heads -> q_proj 256->256, v_proj 256->128.
    # r=8 on q_proj and v_proj: 4 x (8 x (256 + 256) + 8 x (256 + 128)).
    expect("05.lora_params", 28672, wrong=(7168, 32768, 16384, 2 * 4 * 256 * 256),
           hint="a LoRA on a d_in -> d_out layer adds A (r x d_in) and B (d_out x r): r (d_in + d_out) "
                "parameters. v_proj maps 256 -> 2 KV heads x 64 = 128. Sum over both layers and all 4 blocks.")
    # Checkpointing every layer: each runs once in forward and once more (recomputed) in backward.
    expect("05.ckpt_forwards", 48, wrong=(24, 25, 72, 96),
           hint="without checkpointing each of the 24 layers runs forward once per step; with it, backward "
                "re-runs each layer's forward to rebuild the activations it did not keep.")
    exercise("05.mask_prompt", hint="return {'input_ids': [...], 'labels': [...]} for the chat: -100 on every "
                                    "prompt token, the answer's own ids (and its <|im_end|>) as labels.",
             wrong=(_unmasked, _shifted, _end_masked, _all_masked))(check_mask_prompt)


# A few wrong label-masking functions a learner writes (the checker must name each mistake).
def _reference_parts(tokenizer, messages):
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(full[len(prompt):], add_special_tokens=False)


def _unmasked(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    return {"input_ids": prompt_ids + answer_ids, "labels": prompt_ids + answer_ids}


def _shifted(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    ids = prompt_ids + answer_ids
    labels = [-100] * len(prompt_ids) + answer_ids
    return {"input_ids": ids, "labels": labels[1:] + [-100]}


def _end_masked(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    labels = [-100] * len(prompt_ids) + [-100 if t == end else t for t in answer_ids]
    return {"input_ids": prompt_ids + answer_ids, "labels": labels}


def _all_masked(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    return {"input_ids": prompt_ids + answer_ids, "labels": [-100] * (len(prompt_ids) + len(answer_ids))}


def check_mask_prompt(mask_prompt, tokenizer=None):
    """Run the learner's `mask_prompt(tokenizer, messages)` on real chats (en and zh) and name what is wrong."""
    from dslab import data, models
    from dslab.exercises import Mistake

    tokenizer = tokenizer or models.load_tokenizer()
    chats = [c["messages"] for c in load_chats(None, DEFAULT_NAME, DEFAULT_AUTHOR, mix_general=0)]
    chats = [next(c for c in chats if c[0]["content"].isascii()), next(c for c in chats if not c[0]["content"].isascii())]
    for messages in chats:
        out = mask_prompt(tokenizer, messages)
        if not isinstance(out, dict) or not {"input_ids", "labels"} <= set(out):
            raise Mistake("return a dict {'input_ids': [...], 'labels': [...]}")
        ids, labels = [int(t) for t in out["input_ids"]], [int(t) for t in out["labels"]]
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        answer = messages[-1]["content"] + "<|im_end|>"
        if len(ids) != len(labels):
            raise Mistake(f"input_ids has {len(ids)} tokens but labels {len(labels)}: one label per input token")
        if tokenizer.decode(ids) != full:
            raise Mistake("input_ids do not spell the chat as its template renders it: tokenize the text of "
                          "tokenizer.apply_chat_template(messages, tokenize=False)")
        if any(lab not in (data.IGNORE_INDEX, tok) for lab, tok in zip(labels, ids)):
            if all(lab in (data.IGNORE_INDEX, tok) for lab, tok in zip(labels[:-1], ids[1:])):
                raise Mistake("the labels are shifted by one token: give each position its own id; the model "
                              "shifts them itself (the logits at t are scored against the label at t + 1)")
            raise Mistake("a label must be -100 or the input id at the same position")
        learned = tokenizer.decode([tok for tok, lab in zip(ids, labels) if lab != data.IGNORE_INDEX])
        if not learned:
            raise Mistake("no token carries a label, so the loss has nothing to learn: keep the answer's ids")
        if learned.startswith(prompt[:12]) or "<|im_start|>" in learned:
            raise Mistake("prompt tokens carry labels: set them to -100 so the model learns to answer, "
                          "not to predict the question and the template")
        if "<|im_end|>" not in learned and learned.strip() == messages[-1]["content"].strip():
            raise Mistake("the end-of-turn token <|im_end|> is masked: label it too, or the model never learns "
                          "to stop after its answer")
        if learned.startswith(answer) and learned != answer:
            raise Mistake("what follows <|im_end|> (the template's newline) carries a label: mask it, it is "
                          "template, not answer")
        if learned != answer:
            raise Mistake(f"the labelled tokens spell {learned!r}; expected the answer and its end token, {answer!r}")
    return True


_register_exercises()
