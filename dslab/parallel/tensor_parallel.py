"""Tensor-parallel training with DeepSpeed AutoTP: what each rank holds, what it sends, and a one-process twin.

`"tensor_parallel": {"autotp_size": T}` in a ds_config makes deepspeed.initialize split a Hugging Face model's
linear layers across groups of T ranks (deepspeed/runtime/engine.py, where the engine partitions for AutoTP):
column-split layers (DeepSpeed's LinearLayer: q/k/v, gate/up) keep a slice of the output features, row-split layers
(LinearAllreduce: o_proj, down_proj) a slice of the input features and all-reduce their partial sums. For
dslab-tiny the tied embedding and output head are split by vocabulary rows too (VocabParallelEmbedding /
VocabParallelLinear, with a loss that never gathers the logits): transformers adds "embed_tokens":
"embedding_rowwise" to the model's runtime tp_plan, and DeepSpeed shards the output head tied to that embedding
with it. The world's other dimension is data parallel, in DeepSpeed's sense: world_size / T model replicas (one per
tensor-parallel group), each with its own data, and T data-parallel groups of world_size / T ranks (one rank of each
replica, holding the same slices), which average gradients and over which ZeRO shards.

The training itself (the "tensor_parallel" config, the loop, reading the grid from deepspeed.utils.groups) is the
learner's, in chapter 11; what is here measures it: the shards a rank holds, the collectives it ran, and the same
training in one process to compare losses with.
"""
from dslab import compat

# DeepSpeed's tensor-parallel layer classes (deepspeed/module_inject/layers.py) and how each splits its weight.
SPLITS = {"LinearLayer": "output features (column)", "LinearAllreduce": "input features (row), then all-reduce",
          "VocabParallelEmbedding": "vocabulary rows", "VocabParallelLinear": "vocabulary rows (tied to the embedding)"}


def corpus_batches(count, micro_batch_size=2, seq_len=64):
    """`count` token batches [micro_batch_size, seq_len] of the kit's own text (data/corpus/valid.txt, in order)."""
    from dslab import data
    from dslab.models import loading

    documents = [d.strip() for d in data.read_corpus(data.CORPUS_DIR / "valid.txt")][:200]
    blocks = data.lm_blocks(loading.load_tokenizer(), documents, seq_len)
    needed = count * micro_batch_size
    if len(blocks) < needed:
        raise ValueError(f"the corpus sample holds {len(blocks)} blocks of {seq_len} tokens; {needed} were asked for")
    return [blocks[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(count)]


def train_one_process(model, steps, lr=1e-3):
    """Plain PyTorch AdamW on a Hugging Face causal LM; `steps` is a list of lists of token batches.

    Each step averages the losses of its batches (what data-parallel ranks do together: each runs one batch, the
    gradients are averaged) and steps once. Returns each step's list of per-batch losses.
    """
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    out = []
    for batches in steps:
        losses = [model(input_ids=tokens, labels=tokens).loss for tokens in batches]
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append([loss.item() for loss in losses])
    return out


def replica_batches(steps, replicas, micro_batch_size=2, seq_len=64):
    """`steps` lists of `replicas` corpus batches: step s gives model replica d (the ranks with data-parallel rank d)
    batch s * replicas + d."""
    batches = corpus_batches(steps * replicas, micro_batch_size, seq_len)
    return [batches[s * replicas:(s + 1) * replicas] for s in range(steps)]


def shard_census(module):
    """What this rank holds of a model AutoTP has split.

    Returns {"layers": [{"name", "class", "local", "full"} for each tensor-parallel layer], "split_local",
    "split_full": parameters of those layers here / in the whole model, "replicated": parameters every rank keeps
    whole (norms, the bias of a row-split layer), "local": all parameters here}. Shared tensors are counted once.
    """
    layers, seen = [], set()
    split_local = split_full = 0
    for name, child in module.named_modules():
        kind = type(child).__name__
        if kind not in SPLITS:
            continue
        weight = child.weight
        # DeepSpeed's layers keep the unsplit shape they were built from
        full = compat.autotp_full_weight_shape(child) or tuple(weight.shape)
        layers.append({"name": name, "class": kind, "local": tuple(weight.shape), "full": full})
        if id(weight) in seen:
            continue  # the output head tied to the embedding: one tensor
        seen.add(id(weight))
        split_local += weight.numel()
        split_full += _numel(full)
        bias = getattr(child, "bias", None)
        if bias is not None and kind == "LinearLayer":  # a column-split layer splits its bias too
            seen.add(id(bias))
            split_local += bias.numel()
            split_full += full[0]
    unique = {id(p): p for p in module.parameters()}
    local = sum(p.numel() for p in unique.values())
    replicated = sum(p.numel() for key, p in unique.items() if key not in seen)
    return {"layers": layers, "split_local": split_local, "split_full": split_full, "replicated": replicated,
            "local": local}


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def collectives(raw):
    """{record name: {"calls", "bytes"}} from the comms logger's records (deepspeed.comm.comms_logger.get_raw_data()).

    A record's name is the op ("all_reduce"), followed by " | [Caller Func: ...]" when the logger's debug option
    is on. "bytes" adds up each call's message size as the logger records it (the tensor the op was called with).
    """
    out = {}
    for name, by_size in raw.items():
        entry = out.setdefault(name, {"calls": 0, "bytes": 0})
        for size, record in by_size.items():
            entry["calls"] += record[0]
            entry["bytes"] += size * record[0]
    return out


def forget_groups():
    """Let the next engine in this process build its own parallel groups: what a new process would give.

    DeepSpeed keeps the grid of an engine that had one in module-level state (deepspeed/utils/groups.py): a
    PipelineEngine's topology as `groups.mpu`, AutoTP's tensor x data mesh (AutoTP's mesh set-up returns at once
    when a tensor-parallel group exists). An engine initialized later in the same process reads them even without a
    grid of its own: a ZeRO engine after a pipeline takes the stages for model parallelism and fails
    (engine.py, `self.mpu.get_model_parallel_rank()` on None), and a second AutoTP engine keeps the first one's size.
    The process groups themselves stay; only DeepSpeed's pointers to them are cleared (dslab.compat).
    """
    compat.forget_parallel_groups()
