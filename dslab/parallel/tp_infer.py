"""Tensor-parallel inference with deepspeed.init_inference (AutoTP); `dslab infer --tp N` runs it on N ranks.

AutoTP splits every linear layer of a decoder block across the tensor-parallel ranks:
- q/k/v, gate/up projections are split by output features (columns of the math, rows of the weight):
  each rank computes its own slice of heads / hidden units, no communication;
- o_proj and down_proj are split by input features: each rank computes a partial sum, and one
  all-reduce adds the partial sums (DeepSpeed's LinearAllreduce). Two all-reduces per block.
Kernel injection (replace_with_kernel_inject=True) instead swaps whole blocks for fused CUDA kernels;
it needs a GPU and a model family DeepSpeed has an injection policy for. Both belong to DeepSpeed's first
inference engine (init_inference); its current serving path is DeepSpeed-FastGen (deepspeed/inference/v2),
served through DeepSpeed-MII.
"""
import contextlib
import hashlib
import io
import json
import os
import sys
import time

from dslab import compat
from dslab.models.loading import DTYPES


class TPInferenceError(RuntimeError):
    """Tensor-parallel inference cannot run as asked; the message says why and what to do."""


# ----------------------------------------------------------------------------------------------------
# Same inputs on every rank
# ----------------------------------------------------------------------------------------------------
def prompts_digest(prompts):
    """A short fingerprint of a list of prompts (order and every character count)."""
    return hashlib.sha256(json.dumps(list(prompts), ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def same_prompts_on_every_rank(prompts):
    """Check that every rank holds exactly rank 0's prompts; TPInferenceError on every rank if not.

    AutoTP ranks hold slices of the same layers and meet in an all-reduce inside every block: ranks fed
    different tokens would add up partial sums of different sentences (garbage) or hang when one stops early.
    """
    import torch.distributed as tdist

    mine = list(prompts)
    gathered = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, (prompts_digest(mine), mine))
    reference_digest, reference = gathered[0]
    bad = [r for r, (digest, _) in enumerate(gathered) if digest != reference_digest]
    if bad:
        r = bad[0]
        other = gathered[r][1]
        where = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
        detail = (f"prompt {where}: rank 0 has {reference[where]!r}, rank {r} has {other[where]!r}"
                  if where < min(len(reference), len(other)) else
                  f"rank 0 has {len(reference)} prompts, rank {r} has {len(other)}")
        raise TPInferenceError(f"ranks {bad} were given other prompts than rank 0 ({detail}). Tensor-parallel ranks "
                               "must run the same tokens: read the prompts once (e.g. on rank 0) and broadcast them.")
    return reference


# ----------------------------------------------------------------------------------------------------
# Kernel injection: where it is possible
# ----------------------------------------------------------------------------------------------------
def kernel_inject_families():
    """Names of the transformer block classes DeepSpeed has a kernel-injection policy for."""
    from deepspeed.module_inject.replace_policy import replace_policies

    return sorted({cls.__name__ for policy in replace_policies for cls in compat.kernel_policy_layer_classes(policy)})


def accelerator_is_cuda():
    """True when DeepSpeed's accelerator is a CUDA GPU (what its fused inference kernels need)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"


def kernel_inject_problem(model=None, dtype="fp16"):
    """Why kernel injection cannot run here (a message), or None when it can."""
    if not accelerator_is_cuda():
        from deepspeed.accelerator import get_accelerator

        return (f"kernel injection needs a CUDA GPU: DeepSpeed's fused inference kernels are CUDA code, and this "
                f"machine's accelerator is {get_accelerator().device_name()!r}. Drop --kernel-inject: AutoTP "
                "(the default) runs the model's own PyTorch layers, split across ranks, on any device.")
    if model is not None:
        from deepspeed.module_inject.auto_tp import AutoTP

        blocks = {type(m).__name__ for m in AutoTP.get_module_list(model)}
        if not blocks & set(kernel_inject_families()):
            return (f"DeepSpeed has no kernel-injection policy for {', '.join(sorted(blocks))} (it has one for "
                    f"{', '.join(kernel_inject_families())}). Drop --kernel-inject and use AutoTP.")
    # The injected blocks have float16, bfloat16 and float32 kernels (ops/transformer/inference/op_binding: one
    # *_fp16 / *_bf16 / *_fp32 function per op) and int8 weights; nothing to refuse here by dtype.
    return None


# ----------------------------------------------------------------------------------------------------
# init_inference and what AutoTP did to the model
# ----------------------------------------------------------------------------------------------------
def check_kernel_inject(model, dtype):
    """TPInferenceError (saying why and what to use instead) when kernel injection cannot run for this model here."""
    problem = kernel_inject_problem(model, dtype)
    if problem:
        raise TPInferenceError(problem)


@contextlib.contextmanager
def captured_output():
    """Send fd 1 and 2 (Python and subprocess output alike) to a temp file; replay it if .failed is set."""
    import tempfile
    from types import SimpleNamespace

    state = SimpleNamespace(failed=False)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                yield state
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if state.failed:
                tmp.seek(0)
                sys.stderr.write(tmp.read().decode("utf-8", "replace") + out.getvalue())


def autotp_policy(model):
    """What AutoTP's parser picks for a (not yet split) model: {block class: [linears followed by an all-reduce]}."""
    from deepspeed.module_inject.auto_tp import AutoTP

    return {cls.__name__: sorted(names) for cls, names in AutoTP.tp_parser(model)}


_KINDS = {
    "LinearLayer": "split by output features (no communication)",
    "LinearAllreduce": "split by input features, then all-reduce",
    "LmHeadLinearAllreduce": "split by input features, then all-reduce",
    "Linear": "not split (full copy on every rank)",
}


def layer_table(model, block=0):
    """[{"name", "class", "weight", "kind"}] for the linear layers of decoder block `block` and the output head."""
    rows = []
    prefix = f".layers.{block}."
    for name, module in model.named_modules():
        kind = _KINDS.get(type(module).__name__)
        if kind is None or not (prefix in name or name.endswith("lm_head")):
            continue
        weight = getattr(module, "weight", None)
        rows.append({"name": name.split(prefix)[-1], "class": type(module).__name__,
                     "weight": list(weight.shape) if weight is not None else None, "kind": kind})
    return rows


def print_layer_table(rows):
    """The layer table as aligned text."""
    for r in rows:
        print(f"{r['name']:<18} {r['class']:<22} weight {str(r['weight']):<12} {r['kind']}")


# ----------------------------------------------------------------------------------------------------
# Generation and timing
# ----------------------------------------------------------------------------------------------------
def generate_with_logits(model, tokenizer, prompts, max_new_tokens=64, chat=False, temperature=0.0, system=None):
    """{"completions", "new_tokens", "logits"}: each prompt's completion, how many text tokens it has, and the logits
    of one forward pass over prompt + completion ([tokens, vocab], float32, on the CPU).

    The forward pass re-reads the generated sequence (teacher forcing), so two setups that generated the same
    tokens can be compared number by number, not only by their arg-max.
    """
    import torch

    from dslab.models import infer

    special = set(tokenizer.all_special_ids)
    completions, new_tokens, logits = [], [], []
    for start, out in infer.sequences(model, tokenizer, prompts, max_new_tokens, chat, temperature, system):
        generated = out[0, start:]
        completions.append(tokenizer.decode(generated, skip_special_tokens=True).strip())
        new_tokens.append(sum(t not in special for t in generated.tolist()))  # <|im_end|> is not text
        with torch.no_grad():
            logits.append(model(input_ids=out).logits[0].float().cpu())
    return {"completions": completions, "new_tokens": new_tokens, "logits": logits}


def timed_generate(model, tokenizer, prompts, new_tokens=32, repeats=1):
    """Latency and tokens/s of greedy generation of exactly `new_tokens` tokens per prompt (best of `repeats`)."""
    import torch

    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [tokenizer(p, return_tensors="pt", add_special_tokens=False) for p in prompts]
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            for ids in encoded:  # min = max new tokens: every run generates the same amount of work
                model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=pad_id)
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    tokens = new_tokens * len(prompts)
    return {"seconds": best, "latency_ms": 1000 * best / len(prompts), "tokens": tokens, "tokens_per_s": tokens / best}


# ----------------------------------------------------------------------------------------------------
# On N ranks: `dslab infer --tp N` / `--kernel-inject`
# ----------------------------------------------------------------------------------------------------
def generate_tensor_parallel(prompts, tp=2, model=None, adapter=None, dtype="fp32", kernel_inject=False,
                             max_new_tokens=64, chat=False, system=None, temperature=0.0, benchmark_tokens=0,
                             logits=False, timeout=None, stream=False):
    """Generate with the model split over `tp` ranks (dslab/recipes/tp_infer.py); returns rank 0's result dict.

    dtype: "fp32", "bf16" or "fp16". logits=True: rank 0 also saves generate_with_logits' logits; its result's
    "logits_file" names the file. stream=None shows what the ranks print (the config first), False nothing.
    A model folder or adapter that cannot be loaded raises loading.ModelError here, before any rank starts.
    """
    from dslab import launch
    from dslab.models import infer, loading

    if not prompts:
        raise TPInferenceError("give at least one prompt")
    infer.check_generation(max_new_tokens, temperature)  # ValueError
    loading.check_model(model, adapter)  # reads and checks the adapter too
    if dtype not in DTYPES:
        raise TPInferenceError(f"dtype {dtype!r} is not one of {', '.join(map(repr, DTYPES))}")
    if kernel_inject:
        problem = kernel_inject_problem(None, dtype)
        if problem:
            raise TPInferenceError(problem)
    elif dtype == "fp16" and not accelerator_is_cuda():
        raise TPInferenceError("float16 inference needs a GPU here; use --dtype bfloat16 or float32 on CPU")
    options = dict(model=model, adapter=adapter, dtype=dtype, kernel_inject=kernel_inject, max_new_tokens=max_new_tokens,
                   chat=chat, system=system, temperature=temperature, benchmark_tokens=benchmark_tokens, logits=logits)
    defaults = dict(model=None, adapter=None, dtype="fp32", kernel_inject=False, max_new_tokens=64, chat=False,
                    system=None, temperature=0.0, benchmark_tokens=0, logits=False)  # the recipe's; only changes pass
    kwargs = {k: v for k, v in options.items() if v != defaults[k]}
    result = launch.run("tp_infer", world_size=tp, timeout=timeout, stream=stream, prompts=list(prompts), **kwargs)
    return result.rank0


def plot_speed(rows):
    """Bar chart of tokens/s per setup; rows: [{"setup", "tokens_per_s", "latency_ms"}]. Returns (Figure, rows)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([r["setup"] for r in rows], [r["tokens_per_s"] for r in rows], color=["#888", "#4a7", "#27a"][: len(rows)])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("greedy generation on this machine (machine-dependent)")
    fig.tight_layout()
    return fig, rows
