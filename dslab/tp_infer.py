"""Tensor-parallel inference with deepspeed.init_inference (AutoTP), and the `dslab infer --tp N` path.

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

DTYPES = ("float32", "bfloat16", "float16")


class TPInferenceError(RuntimeError):
    """Tensor-parallel inference cannot run as asked; the message says why and what to do."""


def torch_dtype(name):
    """torch dtype for "float32" / "bfloat16" / "float16"."""
    import torch

    if name not in DTYPES:
        raise TPInferenceError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


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

    names = set()
    for policy in replace_policies:
        policy(None)  # instantiating fills _orig_layer_class (None when that model library is missing)
        classes = policy._orig_layer_class
        for cls in classes if isinstance(classes, list) else [classes]:
            if cls is not None:
                names.add(cls.__name__)
    return sorted(names)


def has_gpu():
    """True when DeepSpeed's accelerator is a CUDA GPU."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cuda"


def kernel_inject_problem(model=None, dtype="float16"):
    """Why kernel injection cannot run here (a message), or None when it can."""
    if not has_gpu():
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

    from dslab import infer

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


def load_model(model=None, adapter=None, dtype="float32"):
    """(model, tokenizer); a LoRA adapter is merged first (AutoTP splits plain linear layers, not LoRA wrappers)."""
    from dslab import models

    m = models.load_model(model, dtype=torch_dtype(dtype))
    if adapter:
        from dslab import lora

        m = lora.apply_adapter(m, adapter).merge_and_unload()
    return m, models.load_tokenizer(model)


# ----------------------------------------------------------------------------------------------------
# `dslab infer --tp N` / `--kernel-inject`
# ----------------------------------------------------------------------------------------------------
def run(prompts, tp=2, model=None, adapter=None, dtype="float32", kernel_inject=False, max_new_tokens=64,
        chat=False, system=None, temperature=0.0, benchmark_tokens=0, logits=False, timeout=None, stream=False):
    """Generate on `tp` ranks with dslab/recipes/tp_infer.py; returns rank 0's result dict.

    logits=True: rank 0 also saves generate_with_logits' logits; its result's "logits_file" names the file.
    stream=None shows what the ranks print (the config first), False nothing.
    """
    from dslab import launch

    if not prompts:
        raise TPInferenceError("give at least one prompt")
    if kernel_inject:
        problem = kernel_inject_problem(None, dtype)
        if problem:
            raise TPInferenceError(problem)
    elif dtype == "float16" and not has_gpu():
        raise TPInferenceError("float16 inference needs a GPU here; use --dtype bfloat16 or float32 on CPU")
    options = dict(model=model, adapter=adapter, dtype=dtype, kernel_inject=kernel_inject, max_new_tokens=max_new_tokens,
                   chat=chat, system=system, temperature=temperature, benchmark_tokens=benchmark_tokens, logits=logits)
    defaults = dict(model=None, adapter=None, dtype="float32", kernel_inject=False, max_new_tokens=64, chat=False,
                    system=None, temperature=0.0, benchmark_tokens=0, logits=False)  # the recipe's; only changes pass
    kwargs = {k: v for k, v in options.items() if v != defaults[k]}
    result = launch.run("tp_infer", world_size=tp, timeout=timeout, stream=stream, prompts=list(prompts), **kwargs)
    return result.rank0


def _cli(args, fallback):
    """`dslab infer`: plain HF generation (fallback) unless --tp > 1 or --kernel-inject."""
    if args.tp < 1:
        print("error: --tp must be at least 1", file=sys.stderr)
        return 2
    if args.tp == 1 and not args.kernel_inject:
        return fallback(args)
    from dslab import dist, infer, launch

    prompts = infer.read_prompts(args)
    if not prompts:
        print("dslab infer: give at least one --prompt TEXT or a --prompts-file", file=sys.stderr)
        return 2
    dist.quiet()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the launcher's command line; stdout keeps only the answers
            result = run(prompts, tp=args.tp, model=args.model, adapter=getattr(args, "adapter", None),
                         dtype=args.dtype, kernel_inject=args.kernel_inject, max_new_tokens=args.max_new_tokens,
                         chat=args.chat, system=args.system, temperature=args.temperature)
    except (TPInferenceError, launch.LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, TPInferenceError) else 1
    infer.print_completions(result["prompts"], result["completions"], args.json)
    return 0


def add_arguments(parser, fallback):
    """Add --tp and --kernel-inject to `dslab infer` and route those runs here; others go to `fallback`."""
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks: split the model across N processes with DeepSpeed AutoTP")
    parser.add_argument("--kernel-inject", action="store_true",
                        help="replace transformer blocks with DeepSpeed's fused CUDA kernels (GPU only)")
    parser.set_defaults(func=lambda args: _cli(args, fallback))


# ----------------------------------------------------------------------------------------------------
# Chapter 07 exercises (checked by dslab.exercises; solutions in notebooks/solutions/07_solutions.py)
# ----------------------------------------------------------------------------------------------------
def _register_exercises():
    from dslab.exercises import exercise, expect

    # dslab-tiny: 4 blocks, each with one all-reduce after o_proj and one after down_proj (AutoTP).
    expect("07.allreduces_per_token", 8, wrong=(4, 2, 16, 7),
           hint="AutoTP puts an all-reduce after each row-split layer: o_proj and down_proj in every block. "
                "Count the blocks (model.config.num_hidden_layers).")
    # v_proj of dslab-tiny is 256 -> 128 (2 KV heads x 64); split by output features over tp=2.
    expect("07.v_proj_shard", [64, 256], wrong=([128, 128], [128, 256], [64, 128], [256, 64]),
           hint="a torch Linear's weight is [out_features, in_features]; AutoTP splits v_proj by output features, "
                "so each of the 2 ranks keeps half of the rows.")
    exercise("07.init_inference", hint="make_engine(model) must return deepspeed.init_inference(model, ...)",
             wrong=WRONG_INIT_INFERENCE)(check_init_inference)


def _wrong_init_inference(**kwargs):
    def make_engine(model):
        import deepspeed

        return deepspeed.init_inference(model, **kwargs)
    return make_engine


def _wrong_kwargs():
    import torch

    return ({}, {"dtype": torch.bfloat16}, {"dtype": torch.float32, "tensor_parallel": {"tp_size": 2}},
            {"dtype": torch.float32, "replace_with_kernel_inject": True})


WRONG_INIT_INFERENCE = tuple(_wrong_init_inference(**kw) for kw in _wrong_kwargs()) + (lambda model: model,)


def check_init_inference(make_engine):
    """Run the learner's `make_engine(model)` in this process (a world of 1) on dslab-tiny and compare its greedy
    answer and logits with plain Hugging Face generation in float32; name what is wrong."""
    import copy

    import torch
    from deepspeed.inference.engine import InferenceEngine

    from dslab import infer, models, train
    from dslab.exercises import Mistake

    train.init_single_process(quiet=True)
    tokenizer, model = models.load_tokenizer(), models.load_model().eval()
    ids = tokenizer(infer.prompt_text(tokenizer, "Who are you?", chat=True), return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected_logits = model(**ids).logits
    try:
        engine = make_engine(copy.deepcopy(model))
    except ValueError as err:
        if "float16" in str(err):
            raise Mistake(f"DeepSpeed says: {err}. init_inference's dtype defaults to torch.float16, which the CPU "
                          "accelerator refuses: pass dtype=torch.float32") from None
        if "world size" in str(err):
            raise Mistake(f"DeepSpeed says: {err}. tensor_parallel={{'tp_size': 2}} needs 2 ranks and this is one "
                          "process: tp_size 1 here (tp=2 runs on 2 ranks through the launcher)") from None
        raise
    if not isinstance(engine, InferenceEngine):
        raise Mistake(f"that returned a {type(engine).__name__}: return the InferenceEngine that "
                      "deepspeed.init_inference(model, ...) gives back")
    if engine._config.replace_with_kernel_inject:
        raise Mistake("replace_with_kernel_inject=True asks for DeepSpeed's fused GPU kernels; there are none for "
                      "Qwen2 and no GPU here, so DeepSpeed leaves the model's layers as they were. Use "
                      "replace_with_kernel_inject=False (AutoTP: the model's own layers)")
    dtype = next(engine.module.parameters()).dtype
    with torch.no_grad():
        logits = engine(**ids).logits
        output = engine.module.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    diff = (logits.float() - expected_logits).abs().max().item()
    if dtype != torch.float32:
        raise Mistake(f"the engine converted the weights to {dtype}: its logits differ from float32 Hugging Face by "
                      f"{diff:.2g}. Pass dtype=torch.float32 to compare with plain generation")
    if not torch.equal(output, expected) or diff > 1e-5:
        raise Mistake(f"the engine's greedy answer or logits differ from Hugging Face's (max |logit diff| {diff:.2g})")
    return True


_register_exercises()


def plot_speed(rows):
    """Bar chart of tokens/s per setup; rows: [{"setup", "tokens_per_s", "latency_ms"}]. Returns (Figure, rows)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([r["setup"] for r in rows], [r["tokens_per_s"] for r in rows], color=["#888", "#4a7", "#27a"][: len(rows)])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("greedy generation on this machine (machine-dependent)")
    fig.tight_layout()
    return fig, rows
