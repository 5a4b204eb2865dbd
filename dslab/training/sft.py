"""Supervised fine-tuning (LoRA or full) on N ranks through DeepSpeed: chat data -> each rank's batches, the
DeepSpeed config, and `run`, which checks everything before it launches dslab/recipes/sft.py on the ranks.
The last section holds what each rank of a run measures and saves for the notebook (activations, model states).

Checkpoints and resuming: dslab.models.checkpoints. The command: dslab.cli.sft. What chapter 05 measures in the
kernel (checkpointing's cost, perplexity, the slides' tables): dslab.training.sft_measure. The settings of a run, their
defaults and limits: dslab.training.sft_settings.
"""
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from dslab import data, files
from dslab.models import checkpoints
from dslab.messages import say
from dslab.training import sft_settings
from dslab.training.sft_settings import DEFAULTS, default_lr  # noqa: F401  (chapter 06 calls sft.default_lr)

DEFAULT_DATA = data.DATA_DIR / "self_cognition.jsonl"
DEFAULT_NAME, DEFAULT_AUTHOR = DEFAULTS["model_name"], DEFAULTS["model_author"]  # (zh, en), like ms-swift's


class SFTError(ValueError):
    """A fine-tuning run that cannot start as asked; the message says how to fix it."""


def check_settings(values):
    """Raise SFTError naming the first setting in {name: value} whose number cannot be (a count below its least, a rate
    or scale not above 0); None means the default. Checked by `run` and by --print-equivalent, before anything is read
    or launched."""
    for s in sft_settings.SETTINGS:
        value = values.get(s.name)
        if value is None:
            continue
        if s.least is not None and not value >= s.least:
            raise SFTError(say("number.at_least", name=s.flag, least=s.least, value=value))
        if s.above_zero and not value > 0:  # NaN fails too
            raise SFTError(say("number.positive", name=s.flag, value=value))


# ----------------------------------------------------------------------------------------------------
# Data: chats -> token ids with the prompt masked -> each rank's batches
# ----------------------------------------------------------------------------------------------------
def load_chats(files=None, name=DEFAULT_NAME, author=DEFAULT_AUTHOR, mix_general=None, seed=0):
    """Chats ({"messages", "lang"}) from jsonl files, {name}/{author} filled, mixed with general dialogue.

    Files hold either {"query", "response"} rows (self-cognition style) or {"messages": [...]} rows.
    name, author: a str for both languages, or (zh, en) (see data.name_pair).
    mix_general: how many general-dialogue chats to add (None: as many as the files gave; 0: none),
    so identity tuning does not turn every answer into the identity.
    """
    import random

    name, author = data.name_pair(name), data.name_pair(author)
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
                raise data.DataError(say("sft.row_format", path=path, row=i + 1))
            text = json.dumps(messages, ensure_ascii=False)
            if ("{name}" in text or "{author}" in text) and (name is None or author is None):
                raise data.DataError(say("sft.placeholders", path=path))
            if name is not None:
                messages = [{**m, "content": data.fill_placeholders(m["content"], name, author, lang)} for m in messages]
            chats.append({"messages": messages, "lang": lang})
    n_general = len(chats) if mix_general is None else int(mix_general)
    if n_general:
        chats += data.general_sft(limit=n_general)
    random.Random(seed).shuffle(chats)
    return chats


def tokenize(tokenizer, chats, max_length=DEFAULTS["max_length"]):
    """SFT examples: input_ids + labels with the prompt masked (IGNORE_INDEX), from the tokenizer's chat template."""
    return [data.sft_example(tokenizer, c["messages"], max_length=max_length) for c in chats]


def label_runs(tokenizer, example):
    """The example as runs of (supervised?, text, n_tokens): what the loss sees and what it skips (IGNORE_INDEX)."""
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
    shard = examples[rank::world_size]
    batches = data.sft_batches(shard, micro_batch_size, pad_id, seed=seed)
    for _ in range(skip):  # resuming: the batches consumed before the checkpoint
        next(batches)
    return batches


def total_steps(n_examples, world_size, micro_batch_size, grad_accum_steps, epochs):
    """Optimizer steps for `epochs` passes: each rank sees its shard once per epoch."""
    shard = n_examples // world_size
    return epochs * max(1, shard // micro_batch_size // grad_accum_steps)


# ----------------------------------------------------------------------------------------------------
# DeepSpeed config
# ----------------------------------------------------------------------------------------------------
def deepspeed_config(zero_stage=DEFAULTS["zero_stage"], world_size=DEFAULTS["world_size"],
                     micro_batch_size=DEFAULTS["micro_batch_size"], grad_accum_steps=DEFAULTS["grad_accum_steps"],
                     lr=sft_settings.LORA_LR, steps=100, precision="bf16", offload_optimizer=False):
    """The config dslab/recipes/sft.py passes to deepspeed.initialize when no --deepspeed file is given."""
    from dslab.config.build import make_config

    extra = {
        # torch's AdamW: no JIT-built op needed on CPU; offload needs DeepSpeed's CPU Adam instead
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "weight_decay": 0.0,
                                                  **({} if offload_optimizer else {"torch_adam": True})}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": max(1, steps // 20),
                                                           "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,  # the recipe prints its own loss log
    }
    return make_config(zero_stage=zero_stage, offload_optimizer=offload_optimizer, precision=precision,
                       micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                       world_size=world_size, lr=lr, **extra)


def read_deepspeed_file(path, world_size):
    """A ready DeepSpeed JSON config, checked for this world size before any rank starts (ConfigError if not)."""
    from dslab.config import build, check

    if not Path(path).is_file():
        raise SFTError(say("config.no_file", file=f"--deepspeed {path}", bundled="dslab/config/presets/*.json"))
    return check.validate(build.load_config(path), world_size)


# ----------------------------------------------------------------------------------------------------
# The run: check everything, then launch the recipe on N ranks
# ----------------------------------------------------------------------------------------------------
def log_dir(output):
    """Where a run writing `output` keeps its per-rank logs: OUTPUT-logs, beside it (as OUTPUT-checkpoints)."""
    return Path(f"{str(output).rstrip('/')}-logs")


def write_progress(path, step, loss):
    """Rank 0's step counter for the progress bar of the launching process (replaced atomically)."""
    files.atomic_write_json(path, {"step": step, "loss": loss})


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


def run(output, progress=False, stream=None, **settings):
    """Check the inputs, run dslab/recipes/sft.py on `world_size` ranks, return rank 0's result dict.

    settings: any of dslab.training.sft_settings.SETTINGS by name (zero_stage=3, epochs=2, ...); the others keep
    their defaults, and a name that is no setting raises TypeError naming the closest one.
    Everything that can be wrong before training (data files, an unwritable output, a bad --deepspeed
    file, a checkpoint from another world size) raises here, before any rank starts.
    Beside `output` go the run's per-rank logs (OUTPUT-logs) and, with save_every, its checkpoints
    (checkpoint_dir, default OUTPUT-checkpoints). resume: a checkpoint directory, or the --output of the
    run that wrote it. progress: total steps, to draw a tqdm bar in this process (False: none).
    """
    from dslab import launch
    from dslab.models import loading, lora

    s = SimpleNamespace(**sft_settings.resolve({**settings, "output": str(output)}))
    check_settings(vars(s))
    # DataError for three names, before anything starts
    s.model_name, s.model_author = _listed(s.model_name, "--model-name"), _listed(s.model_author, "--model-author")
    if s.data is not None:
        s.data = [str(f) for f in ([s.data] if isinstance(s.data, (str, Path)) else s.data)]
        for f in s.data:
            if not Path(f).is_file():
                raise SFTError(say("data.no_file", path=f"--data {f}"))
        # A malformed line fails here (DataError naming file:line), not on the ranks after a cold start.
        load_chats(s.data, s.model_name, s.model_author, s.mix_general, s.seed)
    loading.check_model(s.model)  # ModelError: a missing folder, or weights only as a pickle
    if not s.full:
        lora.targets_of(s.model, s.target_modules)  # AdapterError: no layer of this model would get an adapter
    files.check_writable(output)  # before minutes of training, not after
    # A full model is about the base's weight files; an adapter is smaller. A checkpoint holds fp32 master
    # weights and two Adam moments of what trains: up to 7x the bf16 weight files for a full fine-tune.
    weights = sum(f.stat().st_size for f in Path(loading.resolve_model(s.model)).glob("*.safetensors"))
    files.check_free_space(output, weights)
    if s.save_every:
        s.checkpoint_dir = str(s.checkpoint_dir or checkpoints.default_dir(output))
        files.check_writable(s.checkpoint_dir, "--checkpoint-dir")
        files.check_free_space(s.checkpoint_dir, weights * (7 if s.full else 1), "--checkpoint-dir")
    if s.resume:  # fails now if there is nothing to resume; another world size: converted here, once
        s.resume = str(checkpoints.find_checkpoints(s.resume))
        checkpoints.check_resume(s.resume, s.world_size, s.zero_stage,
                                 s.world_size * s.micro_batch_size * s.grad_accum_steps)
    if s.deepspeed:
        read_deepspeed_file(s.deepspeed, s.world_size)  # ConfigError naming each problem and its fix
    # shown even at their defaults: they define the run
    kwargs = sft_settings.recipe_arguments(vars(s), always=("output", "zero_stage", "epochs"))
    stop, bar, progress_file = threading.Event(), None, None
    if progress:
        progress_file = str(Path(output).resolve().parent / f".{Path(output).name}.progress.json")
        kwargs["progress_file"] = progress_file
        bar = threading.Thread(target=_progress_bar, args=(progress_file, progress, stop), daemon=True)
        bar.start()
    try:
        result = launch.run("sft", world_size=s.world_size, timeout=s.timeout, stream=stream,
                            run_dir=log_dir(output), **kwargs)
    finally:
        stop.set()
        if bar is not None:
            bar.join()
            Path(progress_file).unlink(missing_ok=True)
    return result.rank0


def _listed(value, option):
    """A name or author as the recipe's command line carries it: a list of one or two (checked by data.name_pair)."""
    value = data.name_pair(value, option)
    return value if value is None else [value] if isinstance(value, str) else list(value)


# ----------------------------------------------------------------------------------------------------
# What each rank of a run measures for the notebooks (the training itself does not need any of it)
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


def model_states(engine):
    """Bytes of parameters, gradients and optimizer states this rank holds (dslab.zero.engine_memory, chapter 04)."""
    try:
        from dslab.zero import engine_memory
    except ImportError:  # the ZeRO chapter's module is optional here
        return None
    measured = engine_memory.measure_engine(engine)
    return {part: measured[part] for part in ("params", "grads", "optimizer", "buffers")}


# What each rank reports of its environment (chapter 08 compares what the launchers set).
REPORTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "CROSS_RANK",
                      "CUDA_VISIBLE_DEVICES", "MASTER_ADDR")


def save_run_result(engine, examples, tokenizer, loss_log, steps, start_step=0, seed=0, **extra):
    """What a rank of a fine-tuning run measured (dslab/recipes/sft.py, chapter 05's train_sft.py), saved for
    dslab.launch to collect (this_rank.save_rank_result); a no-op when the script runs outside dslab.launch (on a
    cluster), so the measurements stay out of the training itself. Every rank must call it (ZeRO-3 gathers).
    seed: the data order's, for the probe batch; extra: more fields (the recipe adds its training time)."""
    import os

    from dslab import this_rank
    from dslab.models import lora

    if not os.environ.get(this_rank.RESULT_DIR_ENV):
        return
    import torch.distributed as tdist
    from peft import get_peft_model_state_dict

    ungathered = None  # what a plain state_dict() holds of the adapter: under ZeRO-3, empty placeholders (0 elements)
    if hasattr(engine.module, "peft_config"):
        adapter = get_peft_model_state_dict(engine.module, save_embedding_layers=False)
        ungathered = sum(v.numel() for v in adapter.values())
    result = {"rank": tdist.get_rank(), "world_size": tdist.get_world_size(),
              "zero_stage": engine.zero_optimization_stage(), "steps": steps, "start_step": start_step,
              "examples": len(examples), "loss_log": loss_log, "final_loss": loss_log[-1]["loss"] if loss_log else None,
              "model_states": model_states(engine), "ungathered_adapter_numel": ungathered,
              **lora.trainable_summary(engine.module), "env": {k: os.environ.get(k) for k in REPORTED_VARIABLES},
              **extra}
    # Last, as it runs a forward: under ZeRO-3 one may leave weights gathered, which the counts above must not see.
    probe = next(rank_batches(examples, 0, 1, engine.train_micro_batch_size_per_gpu(), tokenizer.pad_token_id, seed))
    result["activation_bytes"] = activation_bytes(engine.module, probe)  # one micro-batch, the same on every rank
    this_rank.save_rank_result(result)
