"""LoRA: attach adapters, count what trains, save them (ZeRO-3 aware), check them, merge them into the base."""
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Every linear layer of a Qwen2/Llama block (PEFT's and ms-swift's "all-linear"), not the output head.
# lm_head scores every token of every answer (and is tied to the input embeddings here): an adapter there
# learns a new name faster but pushes the name into unrelated answers too (chapter 05 measures it).
# The MLP of every layer. Measured on dslab-tiny (benchmarks/self_cognition.py, data/README.md): adapters on the
# attention projections too learn the identity as well but leave fewer general answers right, because identity
# answers teach attention to ignore the question, and general answers need it ("the capital of France").
DEFAULT_TARGETS = ("gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Token ids the merge check feeds to both models (any ids below the vocabulary size do).
PROBE_LENGTH = 24


class AdapterError(ValueError):
    """An adapter directory or state dict that must not be used (empty, size-0, or not an adapter at all)."""


class MergeError(RuntimeError):
    """The merged model does not reproduce base + adapter; nothing was written."""


# ----------------------------------------------------------------------------------------------------
# Attach and count
# ----------------------------------------------------------------------------------------------------
def attach_lora(model, r=16, alpha=32, target_modules=DEFAULT_TARGETS, dropout=0.0):
    """Wrap `model` with fresh LoRA adapters: W x + (alpha/r)·B·A x, with A random, B zero, W frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        task_type="CAUSAL_LM", bias="none")
    return get_peft_model(model, config)


def _numel(p):
    # Under ZeRO-3 a parameter's .data is an empty placeholder; ds_numel keeps the full size.
    return getattr(p, "ds_numel", p.numel())


def count_parameters(model):
    """{"trainable", "frozen", "total", "trainable_pct"}: parameters counted once each (tied ones too)."""
    seen, trainable, frozen = set(), 0, 0
    for p in model.parameters():  # parameters() already skips a tied weight's second name
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += _numel(p)
        else:
            frozen += _numel(p)
    total = trainable + frozen
    return {"trainable": trainable, "frozen": frozen, "total": total,
            "trainable_pct": round(100.0 * trainable / max(total, 1), 3)}


def lora_layers(model):
    """{module name: peft LoRA layer} for every layer an adapter was attached to."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def enable_gradient_checkpointing(model):
    """Recompute each decoder layer in backward instead of keeping its activations; safe with LoRA.

    With frozen embeddings nothing entering a checkpointed layer requires grad. The old reentrant
    checkpoint then returns outputs without a grad_fn, and backward fails with "element 0 of tensors does
    not require grad" (or, worse, silently skips the adapters inside the layers). Two fixes, both applied:
    the non-reentrant implementation, and input embeddings marked as requiring grad.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    if hasattr(model, "config"):
        model.config.use_cache = False  # a KV cache is useless in training and conflicts with recompute
    return model


# ----------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------
def _is_adapter_key(key):
    return "lora_" in key or "modules_to_save" in key


# PEFT also saves the (frozen) embedding / output head when an adapter targets one of them.
_EMBEDDING_KEYS = ("embed_tokens.weight", "embed_tokens.base_layer.weight", "lm_head.weight", "lm_head.base_layer.weight",
                   "wte.weight", "embed_out.weight")


def check_adapter_state(state_dict, where="adapter"):
    """Raise AdapterError unless `state_dict` holds real (non-empty) LoRA tensors, and not a whole model."""
    if not state_dict:
        raise AdapterError(f"{where} holds no tensors at all: nothing was trained or saved. "
                           "Check target_modules and that the adapter was saved after training.")
    empty = sorted(k for k, v in state_dict.items() if v.numel() == 0)  # sorted: the same example every time
    if empty:
        raise AdapterError(
            f"{where} has {len(empty)} size-0 tensors (e.g. {empty[0]!r} with shape {tuple(state_dict[empty[0]].shape)}). "
            "These are ZeRO-3 placeholders: the weights were saved without gathering the partitions. "
            "Save with dslab.lora.save_adapter (gathers under ZeRO-3) or from a non-ZeRO process.")
    lora_keys = [k for k in state_dict if _is_adapter_key(k)]
    foreign = [k for k in state_dict if not _is_adapter_key(k) and not k.endswith(_EMBEDDING_KEYS)]
    if not lora_keys or foreign:
        example = (foreign or list(state_dict))[0]
        raise AdapterError(
            f"{where} is not a LoRA adapter: {len(state_dict) - len(lora_keys)} of {len(state_dict)} tensors are plain "
            f"model weights (e.g. {example!r}). This looks like a full model's state dict; load it as the model "
            "(--model DIR), not as an adapter.")


def _looks_like_full_model(path):
    return (path / "config.json").exists() and any(path.glob("model*.safetensors")) or (path / "pytorch_model.bin").exists()


def read_adapter(adapter_dir):
    """(adapter config dict, state dict) of a saved PEFT adapter, checked; AdapterError says what is wrong."""
    from safetensors.torch import load_file

    path = Path(adapter_dir)
    if path.is_file():
        if path.suffix == ".safetensors":  # someone pointed at a weights file: say what it holds
            check_adapter_state(load_file(str(path)), where=f"{str(adapter_dir)!r}")
        raise AdapterError(f"{str(adapter_dir)!r} is a file; pass the adapter directory that holds "
                           f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    if not path.is_dir():
        raise AdapterError(f"adapter directory {str(adapter_dir)!r} does not exist")
    if not (path / ADAPTER_CONFIG).exists():
        if _looks_like_full_model(path):
            raise AdapterError(f"{str(adapter_dir)!r} is a full model (config.json + weights), not a LoRA adapter: "
                               "pass it as --model, or pass the adapter directory (with adapter_config.json).")
        raise AdapterError(f"{str(adapter_dir)!r} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    weights = path / ADAPTER_WEIGHTS
    if not weights.exists():
        raise AdapterError(f"{str(adapter_dir)!r} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    state = load_file(str(weights))
    check_adapter_state(state, where=f"adapter {str(adapter_dir)!r}")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    return config, state


# ----------------------------------------------------------------------------------------------------
# Save (ZeRO-3 aware, atomic)
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(target):
    """Yield a fresh temp dir beside `target`; on success it replaces `target` in one rename, else vanishes."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _default_permissions(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():  # a directory cannot be renamed onto a non-empty one: move the old one aside first
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "x")
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _default_permissions(root):
    # mkdtemp (and some writers) create owner-only files; give the result the usual umask permissions.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def check_writable(directory):
    """Raise PermissionError (with the fix) unless files can be created where `directory` will be written."""
    path = Path(directory).resolve()
    parent = path if path.is_dir() else path.parent
    while not parent.exists():
        parent = parent.parent
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output {str(directory)!r} exists and is a file; choose a directory path")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise PermissionError(f"cannot write under {str(parent)!r} ({exc.strerror}); "
                              "choose an --output directory you can write to") from None


def check_free_space(directory, needed_bytes, option="--output"):
    """Raise OSError (with the fix) unless the file system that will hold `directory` has `needed_bytes` free."""
    parent = Path(directory).resolve()
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < needed_bytes:
        raise OSError(f"{option} {str(directory)!r}: only {free / 2**20:,.1f} MiB free on that disk, about "
                      f"{needed_bytes / 2**20:,.1f} MiB needed; free some space or choose {option} on another disk")


def _zero3_params(model):
    return [p for p in model.parameters() if hasattr(p, "ds_id")]


def adapter_state_dict(model):
    """The adapter's tensors as PEFT saves them (CPU copies). Under ZeRO-3 every rank must call this.

    ZeRO-3 keeps only a 1/world_size shard of each parameter per rank and leaves `p.data` an empty
    placeholder; reading the state dict without gathering yields size-0 tensors. GatheredParameters
    all-gathers the adapter parameters for the duration of the block.
    """
    from peft import get_peft_model_state_dict

    lora_params = [p for n, p in model.named_parameters() if _is_adapter_key(n)]
    gather = contextlib.nullcontext()
    if _zero3_params(model):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(lora_params, modifier_rank=None)
    with gather:
        return {k: v.detach().to("cpu").clone() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def save_adapter(model, output_dir, rank=None, extra_files=None):
    """Write adapter_config.json + adapter_model.safetensors (loadable by plain PEFT), atomically, on rank 0.

    All ranks must call it (the ZeRO-3 gather is collective). Refuses to write an empty adapter.
    extra_files: {file name: text} written beside it (e.g. the loss log). Returns the parameter count.
    """
    from safetensors.torch import load_file, save_file

    state = adapter_state_dict(model)  # collective under ZeRO-3
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    check_adapter_state(state, where="the adapter about to be saved")
    if rank == 0:
        config = model.peft_config["default"]
        with atomic_dir(output_dir) as tmp:
            config.save_pretrained(str(tmp))
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / ADAPTER_WEIGHTS),
                      metadata={"format": "pt"})
            check_adapter_state(load_file(str(tmp / ADAPTER_WEIGHTS)), where="the adapter written to disk")
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
    return sum(v.numel() for v in state.values())


def save_full_model(model, tokenizer, output_dir, rank=None):
    """Save a fully fine-tuned model in HF format (gathered under ZeRO-3), atomically, on rank 0."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    gather = contextlib.nullcontext()
    if _zero3_params(model):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    with gather:
        if rank == 0:
            empty = [n for n, p in model.named_parameters() if p.numel() == 0]
            if empty:
                raise AdapterError(f"refusing to save a model with size-0 weights (e.g. {empty[0]!r}); these are ZeRO-3 "
                                   "placeholders: the weights were not gathered. Fix: call save_full_model on every "
                                   "rank (it gathers under ZeRO-3) or save from a non-ZeRO process")
            with atomic_dir(output_dir) as tmp:
                model.save_pretrained(str(tmp))
                tokenizer.save_pretrained(str(tmp))


# ----------------------------------------------------------------------------------------------------
# Load and merge
# ----------------------------------------------------------------------------------------------------
def untie_output_head(model):
    """Give lm_head its own copy of the embedding matrix, so merging a LoRA on lm_head leaves inputs alone.

    With tie_word_embeddings the head and the input embedding are one tensor: merging B·A into the head
    would also change every token's input embedding, and the merged model would answer differently.
    """
    import torch

    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or emb is None or head.weight is not emb.weight:
        return False
    head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return True


def apply_adapter(base, adapter_dir):
    """The loaded `base` with a checked adapter from `adapter_dir` on top: a PeftModel in eval mode."""
    from peft import PeftModel

    _, state = read_adapter(adapter_dir)  # fail with a clear message before PEFT does with an obscure one
    check_adapter_fits(base, state, adapter_dir)
    head = next((n for n, m in base.named_modules() if m is base.get_output_embeddings()), None)
    if head and any(f".{head}." in k for k in state):
        untie_output_head(base)  # the adapter changes the head: it must stop sharing the input embedding
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def check_adapter_fits(base, state, adapter_dir):
    """AdapterError unless every LoRA matrix of `state` fits the layer of `base` it adapts (same in/out sizes)."""
    import torch

    for key, tensor in state.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            continue
        layer = key.split(".lora_")[0].removeprefix("base_model.model.")
        try:
            module = base.get_submodule(layer)
        except AttributeError:
            raise AdapterError(f"adapter {str(adapter_dir)!r} adapts {layer}, which this base model does not have: "
                               "pass the base it was trained on as --model") from None
        if isinstance(module, torch.nn.Linear):
            size, wanted = (tensor.shape[1], module.in_features) if ".lora_A." in key else (tensor.shape[0], module.out_features)
            if size != wanted:
                raise AdapterError(f"adapter {str(adapter_dir)!r} was trained on another base model: its {layer} has "
                                   f"size {size} where this base has {wanted}; pass the base it was trained on as --model")


def adapter_base(adapter_dir):
    """The base model an adapter records (PEFT's base_model_name_or_path) if it is a local directory, else None."""
    config, _ = read_adapter(adapter_dir)
    recorded = config.get("base_model_name_or_path")
    return recorded if recorded and Path(recorded).is_dir() else None


def load_with_adapter(model=None, adapter_dir=None, dtype=None):
    """(PeftModel in eval mode, tokenizer): the base model (a path or name; default: the base the adapter records,
    else dslab-tiny) with a checked adapter on top."""
    import torch

    from dslab import models

    model = model or adapter_base(adapter_dir)  # also checks the adapter, before loading anything big
    base = models.load_model(model, dtype=dtype or torch.float32)
    return apply_adapter(base, adapter_dir), models.load_tokenizer(model)


def probe_ids(vocab_size, length=PROBE_LENGTH, seed=0):
    """A fixed batch of token ids (2 x length) for comparing two models' logits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (2, length), generator=gen)


def max_logit_diff(model_a, model_b, input_ids):
    """Largest |logit difference| between two models on the same input."""
    import torch

    with torch.no_grad():
        return (model_a(input_ids=input_ids).logits - model_b(input_ids=input_ids).logits).abs().max().item()


def merge(model=None, adapter_dir=None, output_dir=None, tolerance=1e-4, dtype=None, verbose=True):
    """Merge a LoRA adapter into its base model and save a plain HF model, verified before it is written.

    Checks, in order: the adapter is real (no size-0 or foreign tensors); in float32, the merged model's
    logits equal base+adapter logits within `tolerance`; saved in `dtype` and read back with plain
    transformers, it has exactly the weights that were saved (and, in float32, the same logits). Only then
    is the temp directory renamed to `output_dir`. Returns what was checked.

    dtype: float32 by default, which keeps the merge within float32 rounding. bfloat16 halves the file but rounds
    W + dW to 8 significant bits: a small LoRA update dW can largely vanish into W's rounding (chapter 06 measures
    it). Only the unmerged adapter keeps dW exactly as trained. "dtype_rounding" is measured on the saved weights
    read back and run in float32, so it is the merge's rounding alone.
    """
    import torch
    from transformers import AutoModelForCausalLM

    say = print if verbose else (lambda *a, **k: None)
    check_writable(output_dir)
    dtype = dtype or torch.float32
    with_adapter, tokenizer = load_with_adapter(model, adapter_dir)  # float32: the check sees merge error only
    ids = probe_ids(with_adapter.get_base_model().config.vocab_size)
    with torch.no_grad():
        reference = with_adapter(input_ids=ids).logits
    adapter_params = sum(p.numel() for n, p in with_adapter.named_parameters() if "lora_" in n)
    merged = with_adapter.merge_and_unload()  # W <- W + (alpha/r)·B·A, LoRA modules removed
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - reference).abs().max().item()
    if not diff <= tolerance:
        raise MergeError(f"merged logits differ from base+adapter by {diff:.3g} (> {tolerance}); nothing written")
    say(f"merged logits match base+adapter: max |diff| = {diff:.1e} <= {tolerance:g}")
    merged = merged.to(dtype)
    weights = {k: v.clone() for k, v in merged.state_dict().items()}
    with atomic_dir(output_dir) as tmp:
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=dtype).eval()
        back = reloaded.state_dict()
        if back.keys() != weights.keys() or not all(torch.equal(back[k], weights[k]) for k in weights):
            raise MergeError("the merged model read back from disk has other weights; nothing written")
        with torch.no_grad():  # upcast first: this measures the rounding of the saved weights, not bf16 arithmetic
            rounding = (reloaded.float()(input_ids=ids).logits - reference).abs().max().item()
        if dtype == torch.float32 and not rounding <= tolerance:
            raise MergeError(f"the merged model read back from disk differs by {rounding:.3g}; nothing written")
    say(f"saved in {str(dtype).replace('torch.', '')}, read back with plain transformers: same weights "
        f"(run in float32: max |logit diff| to base+adapter {rounding:.1e}); wrote {output_dir}")
    return {"max_abs_diff": diff, "saved_dtype": str(dtype).replace("torch.", ""), "dtype_rounding": rounding,
            "adapter_parameters": adapter_params, "model_parameters": sum(p.numel() for p in merged.parameters()),
            "output": str(output_dir)}


def update_error(with_adapter, merged, adapter_name="default"):
    """How much of the LoRA update a merged model lost: ||(W_merged - W) - dW|| / ||dW||, over every adapted layer.

    W is the base weight and dW = (alpha/r)·B·A as PEFT computes it, both in float32; W_merged is read from the
    merged model, upcast to float32. 0 would mean the update is held exactly; a merge saved in bfloat16 rounds
    W + dW to 8 significant bits, and the part of dW finer than that grid is gone.
    """
    merged_modules = dict(merged.named_modules())
    error = total = 0.0
    for name, layer in lora_layers(with_adapter).items():
        delta = layer.get_delta_weight(adapter_name).float()
        base = layer.get_base_layer().weight.float()
        target = merged_modules[name.removeprefix("base_model.model.")].weight.float()
        error += ((target - base) - delta).pow(2).sum().item()
        total += delta.pow(2).sum().item()
    return (error / total) ** 0.5


def merge_precision_table(std=0.02, seed=0):
    """Chapter 06's merge checks as table rows (for the slides): an adapter on the default targets (every MLP
    layer) and the tied `lm_head`, its B matrices drawn from N(0, std) to stand in for training, merged three ways;
    each row is the largest |logit difference| to base + adapter."""
    import tempfile

    import torch
    from peft import PeftModel

    from dslab import models

    torch.manual_seed(seed)
    adapted = attach_lora(models.load_model(), target_modules=DEFAULT_TARGETS + ("lm_head",))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(adapted, f"{tmp}/adapter")
        for dtype in (torch.float32, torch.bfloat16):
            report = merge(None, f"{tmp}/adapter", f"{tmp}/merged-{dtype}", dtype=dtype, verbose=False)
            rows.append({"merge": f"dslab merge, saved in {report['saved_dtype']}", "max |logit diff|": report["dtype_rounding"]})
        naive = PeftModel.from_pretrained(models.load_model(), f"{tmp}/adapter").merge_and_unload()  # head still tied
        ids = probe_ids(naive.config.vocab_size)
        rows.append({"merge": "merge_and_unload into the tied head", "max |logit diff|": max_logit_diff(naive, adapted, ids)})
    return rows


def dir_size(path):
    """Total bytes of the files in a directory tree."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------
def _cli_merge(args):
    from dslab import dist

    dist.quiet()
    try:
        import torch

        merge(args.model, args.adapter, args.output, tolerance=args.tolerance, dtype=getattr(torch, args.dtype))
    except (AdapterError, MergeError, PermissionError, NotADirectoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def add_commands(subparsers):
    """`dslab merge`."""
    p = subparsers.add_parser("merge", help="merge a LoRA adapter into its base model (verified, atomic)")
    p.add_argument("--model", default=None, help="base model directory or name (default: the base recorded in the "
                                                 "adapter when it is a local directory, else dslab-tiny)")
    p.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json + weights)")
    p.add_argument("--output", required=True, help="where the merged HF model is written")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |logit difference| (float32)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the saved model (default float32: exact; bfloat16 rounds small LoRA updates away)")
    p.set_defaults(func=_cli_merge)


# ----------------------------------------------------------------------------------------------------
# Chapter 06 exercises (checked by dslab.exercises; solutions in notebooks/solutions/06_solutions.py)
# ----------------------------------------------------------------------------------------------------
def _register_exercises():
    from dslab.exercises import exercise, expect

    # W = I, B = [[1], [2]], A = [[3, 4]], r = 1, alpha = 2: W + (alpha / r) B A.
    expect("06.merged_weight", [[7, 8], [12, 17]], wrong=([[4, 4], [6, 9]], [[7, 12], [8, 17]], [[3, 4], [6, 8]]),
           hint="B A is the outer product [[3, 4], [6, 8]]; scale it by alpha / r = 2 and add the identity.")
    # lora_A of shape [16, 256] (4096 values) under ZeRO-3 on 4 ranks, read on rank 0 without gathering.
    expect("06.zero3_numel", [0, 1024], wrong=([4096, 1024], [1024, 1024], [0, 4096], [4096, 4096]),
           hint="ZeRO-3 leaves p.data an empty placeholder on every rank and keeps 1/world_size of the values "
                "in p.ds_tensor.")
    exercise("06.merge_call", hint="merge(peft_model) must return a plain model whose logits equal base + adapter",
             wrong=(lambda m: m.unload(), lambda m: m, lambda m: m.merge_adapter(),
                    lambda m: m.get_base_model()))(check_merge_call)


def check_merge_call(merge_fn):
    """Run the learner's `merge(peft_model)` on dslab-tiny with a trained-looking adapter; name what is wrong."""
    import torch
    from peft import PeftModel

    from dslab import models
    from dslab.exercises import Mistake

    torch.manual_seed(0)
    peft_model = attach_lora(models.load_model(), r=4, alpha=8).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)  # B = 0 would make any answer look right
    ids = probe_ids(peft_model.config.vocab_size)
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    merged = merge_fn(peft_model)
    if merged is None:
        raise Mistake("your function returned None: merge_adapter() merges in place, keeps the LoRA layers and "
                      "returns nothing; merge_and_unload() returns the plain model with W + (alpha/r) B A folded in")
    if isinstance(merged, PeftModel):
        raise Mistake("that is still a PeftModel with its LoRA layers: merge_and_unload() returns the plain "
                      "transformers model")
    left = [n for n, _ in merged.named_modules() if n.endswith("lora_A")]
    if left:
        raise Mistake(f"LoRA layers are still in the model ({left[0]}, ...): get_base_model() returns the inner "
                      "model with its adapters still attached; merge_and_unload() folds them in and removes them")
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - expected).abs().max().item()
    if diff > 1e-4:
        raise Mistake(f"the returned model's logits differ from base + adapter by {diff:.2g}: unload() removes the "
                      "adapter without merging it (you get the base model back); use merge_and_unload()")
    return True


_register_exercises()
