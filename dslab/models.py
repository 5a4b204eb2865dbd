"""The tiny local base model "dslab-tiny" and its tokenizer: build, pretrain under DeepSpeed, save, load.

Everything loads through AutoModelForCausalLM / AutoTokenizer.from_pretrained, the same code path as a real
Qwen2 checkpoint: pass a hub id such as Qwen/Qwen2-0.5B (or set DSLAB_MODEL) and nothing else changes.
"""
import json
import math
import os
import time
from pathlib import Path

from dslab.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer  # noqa: F401 (re-exported)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "dslab-tiny"
CORPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "corpus"
def resolve_model(name_or_path=None):
    """What to load: the argument, else $DSLAB_MODEL, else the committed dslab-tiny directory (a str)."""
    return str(name_or_path or os.environ.get("DSLAB_MODEL") or DEFAULT_MODEL_DIR)


def load_model(path=None, dtype=None, trust_remote_code=False):
    """A causal LM from a local HF directory or hub id; weights from safetensors only; float32 by default."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(resolve_model(path), dtype=dtype or torch.float32,
                                                 use_safetensors=True, trust_remote_code=trust_remote_code)
    return model.eval()


def load_tokenizer(path=None, trust_remote_code=False):
    """The tokenizer saved beside the model (chat template included)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model(path), trust_remote_code=trust_remote_code)


def tiny_config(**overrides):
    """A Qwen2Config of the dslab-tiny shape; keyword overrides change it (e.g. num_hidden_layers=8)."""
    from transformers import Qwen2Config
    shape = dict(
        vocab_size=10240,           # byte-level BPE: 6,763 Chinese characters + merges learned on the corpus
        hidden_size=256,
        intermediate_size=688,      # ~8/3 x hidden, rounded to a multiple of 16, as SwiGLU models do
        num_hidden_layers=4,
        num_attention_heads=4,      # head_dim 64
        num_key_value_heads=2,      # grouped-query attention, like Qwen2
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,   # the output head shares the embedding matrix: 1M fewer parameters
        bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    shape.update(overrides)
    return Qwen2Config(**shape)


def build_model(config, seed=0):
    """A randomly initialised causal LM for `config`, the same weights for the same seed."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def count_parameters(model):
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ----------------------------------------------------------------------------------------------------
# Pretraining under DeepSpeed
# ----------------------------------------------------------------------------------------------------
def pretrain_config(micro_batch_size, steps, lr, warmup):
    """The DeepSpeed config of the pretraining run: one process, bf16 compute with fp32 master weights.

    ZeRO stage 1 on a single rank partitions nothing, but keeps the fp32 master weights and Adam states
    in one flat buffer: the optimizer step is a few large ops instead of one small op per tensor
    (about 3x faster than stage 0's bf16 step on a 2-core CPU).
    """
    from dslab.config import make_config
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


def build_base(output=DEFAULT_MODEL_DIR, steps=650, seq_len=256, micro_batch_size=16, lr=2e-3, seed=0,
               vocab_size=10240, progress=None, max_docs=None):
    """Train the tokenizer, pretrain dslab-tiny under DeepSpeed, save both to `output`; returns a report dict."""
    import deepspeed
    import torch
    from dslab import corpus, data, train

    t0, cpu0 = time.perf_counter(), time.process_time()
    train_docs = corpus.read_corpus(CORPUS_DIR / "train.txt")[:max_docs]  # max_docs: quick smoke runs only
    valid_docs = corpus.read_corpus(CORPUS_DIR / "valid.txt")
    tokenizer = train_tokenizer(train_docs, vocab_size)  # every GB2312 character one token (dslab.tokenizer)
    train_blocks = data.lm_blocks(tokenizer, train_docs, seq_len)  # [n, seq_len]
    valid_blocks = data.lm_blocks(tokenizer, valid_docs, seq_len)

    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    model = build_model(config, seed=seed)
    train.init_single_process()
    ds_config = pretrain_config(micro_batch_size, steps, lr, warmup=max(1, steps // 20))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    t_train = time.perf_counter()
    log = train.train(engine, data.block_batches(train_blocks, micro_batch_size, seed=seed), steps,
                      desc="pretrain dslab-tiny", progress=progress, log_every=10)
    train_seconds = time.perf_counter() - t_train

    model = engine.module.to(torch.bfloat16)  # what the engine trained; saved as bf16 (8 MB)
    valid_loss = train.evaluate_loss(model, ({"input_ids": b, "labels": b} for b in valid_blocks.split(micro_batch_size)))
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
    (Path(output) / "build_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def save_pretrained(model, tokenizer, output):
    """Save model (safetensors), generation config and tokenizer files in Hugging Face format."""
    from transformers import GenerationConfig
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    end, eot = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # Stop at the end of a chat turn and at the end of a document; greedy unless asked otherwise.
    model.generation_config = GenerationConfig(eos_token_id=[end, eot], pad_token_id=eot, do_sample=False,
                                               max_new_tokens=64)
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)


def _cmd_build_base(args):
    """`dslab build-base`: rebuild the base model from the committed corpus."""
    # Idle OpenMP threads sleep instead of spinning: on a CPU shared with other jobs, spinning threads
    # burn the cores the others need (measured here: ~3x less CPU time per step under load).
    # Read once when torch loads, so it only takes effect if torch is not imported yet.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from dslab import corpus
    if args.regenerate_corpus:
        for path in corpus.write_all(CORPUS_DIR.parent):
            print(f"wrote {path}")
    report = build_base(args.output, steps=args.steps, seed=args.seed, progress=not args.quiet,
                        max_docs=args.max_docs)
    print(f"params {report['params']:,}  steps {report['steps']}  tokens seen {report['tokens_seen']:,}")
    print(f"valid perplexity {report['valid_perplexity']:.2f} (vocab {report['vocab_size']}, "
          f"ratio {report['valid_perplexity'] / report['vocab_size']:.5f}; unigram baseline "
          f"{report['unigram_perplexity']:.1f})")
    print(f"built in {report['seconds']:.0f} s ({report['cpu_seconds']:.0f} CPU seconds); saved to {args.output}")
    return 0


def add_commands(subparsers):
    """Register `dslab build-base`."""
    import argparse
    p = subparsers.add_parser("build-base", help="rebuild the tiny base model (tokenizer + DeepSpeed pretraining)",
                              description="Train the tokenizer and pretrain dslab-tiny on the kit's corpus under DeepSpeed.")
    p.add_argument("--output", default=str(DEFAULT_MODEL_DIR), help="where to save (default: data/dslab-tiny)")
    p.add_argument("--steps", type=int, default=650, help="optimizer steps of 16 x 256 tokens (default 650)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--max-docs", type=int, default=None, help=argparse.SUPPRESS)  # smoke tests: a corpus slice
    p.add_argument("--regenerate-corpus", action="store_true", help="rewrite data/corpus from dslab.corpus first")
    p.set_defaults(func=_cmd_build_base)
