"""LoRA: attach adapters, summarise what trains, save them (ZeRO-3 aware, atomic), merge them into the base.

Reading, checking and loading a saved adapter is dslab.models.loading (`load_model(adapter=...)`, `read_adapter`).
"""
import contextlib
import os
from pathlib import Path

from dslab.models import loading
from dslab.files import atomic_dir, check_writable
from dslab.messages import say
from dslab.noise import bound
from dslab.models.loading import ADAPTER_WEIGHTS, DTYPES, AdapterError, check_adapter_state, is_adapter_key

# Every linear layer of a Qwen2/Llama block (PEFT's and ms-swift's "all-linear"), not the output head.
# lm_head scores every token of every answer (and is tied to the input embeddings here): an adapter there
# learns a new name faster but pushes the name into unrelated answers too (chapter 05 measures it).
# The MLP of every layer. Measured on dslab-tiny (benchmarks/self_cognition.py, data/README.md): adapters on the
# attention projections too learn the identity as well but leave fewer general answers right, because identity
# answers teach attention to ignore the question, and general answers need it ("the capital of France").
DEFAULT_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Token ids the merge check feeds to both models (any ids below the vocabulary size do).
PROBE_LENGTH = 24


class MergeError(RuntimeError):
    """The merged model does not reproduce base + adapter; nothing was written."""


# ----------------------------------------------------------------------------------------------------
# Attach and count
# ----------------------------------------------------------------------------------------------------
def mlp_linear_names(model):
    """The names of the linear layers in every block's MLP, found by module type (a module whose class name ends in
    "MLP": Qwen2 and Qwen3, Llama, Mistral, Gemma, Phi-3 all name theirs so), whatever the model calls the layers:
    DEFAULT_TARGETS on dslab-tiny and on Llama-style models, ("gate_up_proj", "down_proj") on Phi-3."""
    import torch

    names = []
    for module in model.modules():
        if type(module).__name__.endswith("MLP"):
            names += [n for n, child in module.named_children() if isinstance(child, torch.nn.Linear) and n not in names]
    return tuple(names)


def resolve_targets(model, target_modules=None):
    """The layer names that get adapters: `target_modules` as given, checked against the model, or by default (None)
    the MLP's linear layers found by type (mlp_linear_names). Raises AdapterError naming the fix when nothing
    would get an adapter."""
    found = mlp_linear_names(model)
    if target_modules is None:
        if not found:
            raise AdapterError(say("lora.no_mlp", model=type(model).__name__))
        return found
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if not set(target_modules) & leaves:
        raise AdapterError(say("lora.no_target", targets=" ".join(target_modules), model=type(model).__name__,
                               found=" ".join(found) or "?"))
    return tuple(target_modules)


def attach_lora(model, r=16, alpha=32, target_modules=None, dropout=0.0):
    """Wrap `model` with fresh LoRA adapters: W x + (alpha/r)·B·A x, with A random, B zero, W frozen.
    target_modules: layer names; None (the default) adapts the MLP of every block, found by type."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(resolve_targets(model, target_modules)), task_type="CAUSAL_LM", bias="none")
    return get_peft_model(model, config)


def targets_of(model_path=None, target_modules=None):
    """resolve_targets for the checkpoint at `model_path`, from its config alone (built on the meta device: no weights
    are read): checked, and what a run will adapt printed, before any rank starts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(loading.resolve_model(model_path))
    with torch.device("meta"):
        return resolve_targets(AutoModelForCausalLM.from_config(config), target_modules)


def _numel(p):
    # Under ZeRO-3 a parameter's .data is an empty placeholder; ds_numel keeps the full size.
    return getattr(p, "ds_numel", p.numel())


def trainable_summary(model):
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
# Save (ZeRO-3 aware, atomic)
# ----------------------------------------------------------------------------------------------------
def _zero3_params(model):
    return [p for p in model.parameters() if hasattr(p, "ds_id")]


def adapter_state_dict(model):
    """The adapter's tensors as PEFT saves them (CPU copies). Under ZeRO-3 every rank must call this.

    ZeRO-3 keeps only a 1/world_size shard of each parameter per rank and leaves `p.data` an empty
    placeholder; reading the state dict without gathering yields size-0 tensors. GatheredParameters
    all-gathers the adapter parameters for the duration of the block.
    """
    from peft import get_peft_model_state_dict

    lora_params = [p for n, p in model.named_parameters() if is_adapter_key(n)]
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
    check_adapter_state(state, where=say("adapter.where_saving"))
    if rank == 0:
        config = model.peft_config["default"]
        with atomic_dir(output_dir) as tmp:
            config.save_pretrained(str(tmp))
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / ADAPTER_WEIGHTS),
                      metadata={"format": "pt"})
            check_adapter_state(load_file(str(tmp / ADAPTER_WEIGHTS)), where=say("adapter.where_written"))
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
                raise AdapterError(say("lora.placeholders", example=empty[0]))
            with atomic_dir(output_dir) as tmp:
                model.save_pretrained(str(tmp))
                tokenizer.save_pretrained(str(tmp))


# ----------------------------------------------------------------------------------------------------
# Merge
# ----------------------------------------------------------------------------------------------------
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


def merge(model=None, adapter_dir=None, output_dir=None, tolerance=1e-4, dtype="fp32", verbose=True):
    """Merge a LoRA adapter into its base model and save a plain HF model, verified before it is written.

    Checks, in order: the adapter is real (no size-0 or foreign tensors); in float32, the merged model's
    logits equal base+adapter logits within `tolerance`; saved in `dtype` and read back with plain
    transformers, it has exactly the weights that were saved (and, in float32, the same logits). Only then
    is the temp directory renamed to `output_dir`. Returns what was checked ("saved_dtype": torch's name).

    dtype: "fp32" by default, which keeps the merge within float32 rounding. "bf16" halves the file but rounds
    W + dW to 8 significant bits: a small LoRA update dW can largely vanish into W's rounding (chapter 06 measures
    it). Only the unmerged adapter keeps dW exactly as trained. "dtype_rounding" is measured on the saved weights
    read back and run in float32, so it is the merge's rounding alone.
    """
    import torch
    from transformers import AutoModelForCausalLM

    show = print if verbose else (lambda *a, **k: None)
    if not tolerance >= 0:   # a negative (or nan) tolerance would refuse every merge with a misleading comparison
        raise MergeError(say("number.at_least", name="tolerance", least=0, value=tolerance))
    check_writable(output_dir)
    saved_dtype = loading.torch_dtype(dtype)
    # float32: the check below sees the merge's error only
    with_adapter = loading.load_model(model, adapter=adapter_dir)
    tokenizer = loading.load_tokenizer(model, adapter=adapter_dir)
    ids = probe_ids(with_adapter.get_base_model().config.vocab_size)
    with torch.no_grad():
        reference = with_adapter(input_ids=ids).logits
    adapter_params = sum(p.numel() for n, p in with_adapter.named_parameters() if "lora_" in n)
    merged = with_adapter.merge_and_unload()  # W <- W + (alpha/r)·B·A, LoRA modules removed
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - reference).abs().max().item()
    if not diff <= tolerance:
        raise MergeError(f"merged logits differ from base+adapter by {diff:.3g} (> {tolerance}); nothing written")
    show(f"merged logits match base+adapter: max |diff| {bound(diff, tolerance)}")
    merged = merged.to(saved_dtype)
    weights = {k: v.clone() for k, v in merged.state_dict().items()}
    with atomic_dir(output_dir) as tmp:
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=saved_dtype, use_safetensors=True).eval()
        back = reloaded.state_dict()
        if back.keys() != weights.keys() or not all(torch.equal(back[k], weights[k]) for k in weights):
            raise MergeError("the merged model read back from disk has other weights; nothing written")
        with torch.no_grad():  # upcast first: this measures the rounding of the saved weights, not bf16 arithmetic
            rounding = (reloaded.float()(input_ids=ids).logits - reference).abs().max().item()
        if dtype == "fp32" and not rounding <= tolerance:
            raise MergeError(f"the merged model read back from disk differs by {rounding:.3g}; nothing written")
    # float32: rounding noise, shown as the bound it was checked against; bf16: the merge's rounding, a result
    shown = bound(rounding, tolerance) if dtype == "fp32" else f"{rounding:.1e}"
    show(f"saved in {DTYPES[dtype]}, read back with plain transformers: same weights "
         f"(run in float32: max |logit diff| to base+adapter {shown}); wrote {output_dir}")
    return {"max_abs_diff": diff, "saved_dtype": DTYPES[dtype], "dtype_rounding": rounding,
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

    torch.manual_seed(seed)
    adapted = attach_lora(loading.load_model(), target_modules=DEFAULT_TARGETS + ("lm_head",))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(adapted, f"{tmp}/adapter")
        for dtype in ("fp32", "bf16"):
            report = merge(None, f"{tmp}/adapter", f"{tmp}/merged-{dtype}", dtype=dtype, verbose=False)
            rows.append({"merge": f"dslab merge, saved in {report['saved_dtype']}", "max |logit diff|": report["dtype_rounding"]})
        naive = PeftModel.from_pretrained(loading.load_model(), f"{tmp}/adapter").merge_and_unload()  # head still tied
        ids = probe_ids(naive.config.vocab_size)
        rows.append({"merge": "merge_and_unload into the tied head", "max |logit diff|": max_logit_diff(naive, adapted, ids)})
    return rows


def dir_size(path):
    """Total bytes of the files in a directory tree."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())

