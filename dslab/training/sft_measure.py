"""What chapter 05 measures in the notebook's own process, beside the training: the cost of gradient checkpointing
(activations kept, layers recomputed), model states of LoRA vs a full fine-tune as the slides tabulate them, and
perplexity on held-out text (how much general language a fine-tune keeps).

What each rank of a run measures is dslab.training.sft's (`activation_bytes`, `model_states`, `save_run_result`).
"""
import time

from dslab import data
from dslab.training import sft


def checkpointing_cost(model, batch, repeats=3):
    """{"activation_bytes", "layer_forwards", "seconds"} of one training step (forward + backward).

    layer_forwards counts decoder-layer forward calls: with checkpointing each layer runs twice
    (once in forward, once recomputed in backward); that recomputation is the speed cost.
    """
    import re

    # Count each decoder layer's MLP: it runs inside the layer's forward, also when checkpointing recomputes
    # it (a hook on the layer itself sees only the outer call in transformers' checkpointing wrapper).
    layers = [m for n, m in model.named_modules() if re.search(r"layers\.\d+$", n)]
    calls = [0]
    hooks = [getattr(layer, "mlp", layer).register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
             for layer in layers]
    try:
        nbytes = sft.activation_bytes(model, batch)
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


def checkpointing_table(micro_batch_size=8):
    """Chapter 05's gradient-checkpointing measurement as table rows (for the slides): dslab-tiny with the default
    LoRA, one micro-batch of the SFT data, with and without checkpointing."""
    from dslab.models import loading, lora

    tokenizer = loading.load_tokenizer()
    examples = sft.tokenize(tokenizer, sft.load_chats())
    batch = next(sft.rank_batches(examples, 0, 1, micro_batch_size, tokenizer.pad_token_id))
    model = lora.attach_lora(loading.load_model()).train()
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
    from dslab.models import loading, lora
    from dslab.zero import memory

    counts = lora.trainable_summary(lora.attach_lora(loading.load_model()))
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

    from dslab.training import loop

    docs = data.read_corpus(data.CORPUS_DIR / "valid.txt")
    blocks = data.lm_blocks(tokenizer, docs[: 4 * n_blocks], seq_len)[:n_blocks]
    return math.exp(loop.evaluate_loss(model, ({"input_ids": b, "labels": b} for b in blocks.split(8))))
