"""Building dslab-tiny from scratch: train the tokenizer on the kit's corpus, pretrain under DeepSpeed, save.

What `dslab build-base` runs. Loading the result is dslab.models.loading; this module sits above it (and above
dslab.training.loop, the engine loop it shares with fine-tuning).
"""
import json
import math
import time
from pathlib import Path

from dslab.files import atomic_write_text, check_writable
from dslab.messages import say
from dslab.models.loading import DEFAULT_MODEL_DIR, build_model, count_parameters, save_pretrained, tiny_config
from dslab.tiny.tokenizer import train_tokenizer


def pretrain_config(micro_batch_size, steps, lr, warmup):
    """The DeepSpeed config of the pretraining run: one process, bf16 compute with fp32 master weights.

    ZeRO stage 1 on a single rank partitions nothing, but keeps the fp32 master weights and Adam states
    in one flat buffer: the optimizer step is a few large ops instead of one small op per tensor
    (about 3x faster than stage 0's bf16 step on a 2-core CPU).
    """
    from dslab.config.build import make_config
    return make_config(
        zero_stage=1, precision="bf16", micro_batch_size=micro_batch_size, grad_accum_steps=1, world_size=1, lr=lr,
        optimizer={"params": {"betas": [0.9, 0.95], "weight_decay": 0.1}},
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": warmup,
                                                        "warmup_type": "linear", "cos_min_ratio": 0.1}},
    )


def unigram_perplexity(train_blocks, valid_blocks, vocab_size):
    """Perplexity on valid of a model that only knows token frequencies in train (add-one smoothing)."""
    import torch
    counts = torch.bincount(train_blocks.flatten(), minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[valid_blocks.flatten()].mean().item())


def check_build(output, steps):
    """Before minutes of training: ValueError for a step count below 1, PermissionError / NotADirectoryError (with
    the fix) for an output that cannot be written."""
    if not steps >= 1:
        raise ValueError(say("number.at_least", name="steps", least=1, value=steps))
    check_writable(output)


def build_base(output=DEFAULT_MODEL_DIR, steps=650, seq_len=256, micro_batch_size=16, lr=2e-3, seed=0,
               vocab_size=10240, progress=None, max_docs=None):
    """Train the tokenizer, pretrain dslab-tiny under DeepSpeed, save both to `output`; returns a report dict."""
    check_build(output, steps)
    import deepspeed
    import torch
    from dslab import data
    from dslab.tiny import corpus
    from dslab import this_rank
    from dslab.training import loop

    t0, cpu0 = time.perf_counter(), time.process_time()
    train_docs = corpus.read_corpus(corpus.CORPUS_DIR / "train.txt")[:max_docs]  # max_docs: quick smoke runs only
    valid_docs = corpus.read_corpus(corpus.CORPUS_DIR / "valid.txt")
    tokenizer = train_tokenizer(train_docs, vocab_size)  # every GB2312 character one token (dslab.tiny.tokenizer)
    train_blocks = data.lm_blocks(tokenizer, train_docs, seq_len)  # [n, seq_len]
    valid_blocks = data.lm_blocks(tokenizer, valid_docs, seq_len)

    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    model = build_model(config, seed=seed)
    this_rank.init_single_process()
    ds_config = pretrain_config(micro_batch_size, steps, lr, warmup=max(1, steps // 20))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    t_train = time.perf_counter()
    log = loop.train(engine, data.block_batches(train_blocks, micro_batch_size, seed=seed), steps,
                      desc="pretrain dslab-tiny", progress=progress, log_every=10)
    train_seconds = time.perf_counter() - t_train

    model = engine.module.to(torch.bfloat16)  # what the engine trained; saved as bf16 (8 MB)
    valid_loss = loop.evaluate_loss(model, ({"input_ids": b, "labels": b} for b in valid_blocks.split(micro_batch_size)))
    save_pretrained(model, tokenizer, output)
    report = {
        "params": count_parameters(model), "steps": steps, "tokens_seen": steps * micro_batch_size * seq_len,
        "train_tokens": train_blocks.numel(), "valid_tokens": valid_blocks.numel(),
        "final_train_loss": log[-1]["loss"], "valid_loss": valid_loss, "valid_perplexity": math.exp(valid_loss),
        "vocab_size": len(tokenizer), "unigram_perplexity": unigram_perplexity(train_blocks, valid_blocks, len(tokenizer)),
        # wall time depends on what else the machine runs; CPU time (all threads) much less so
        "seconds": time.perf_counter() - t0, "train_seconds": train_seconds, "cpu_seconds": time.process_time() - cpu0,
        "loss_log": log,
    }
    atomic_write_text(Path(output) / "build_report.json", json.dumps(report, indent=1) + "\n")
    return report
