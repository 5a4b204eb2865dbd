"""Chapter 06 (merging LoRA): merged weights, ZeRO-3 sizes, and the merge call.

Solutions: notebooks/solutions/06_solutions.py."""
from dslab.exercises import Mistake, exercise, expect
from dslab.models.lora import attach_lora, probe_ids

def check_merge_call(merge_fn):
    """Run the learner's `merge(peft_model)` on dslab-tiny with a trained-looking adapter whose rank, alpha and values
    are drawn now; name what is wrong."""
    import random

    import torch
    from peft import PeftModel

    from dslab.models import loading
    if not callable(merge_fn):
        raise Mistake("answer with the function itself: answer = merge")
    rng = random.SystemRandom()
    r = rng.choice((2, 4, 8))
    torch.manual_seed(rng.randrange(1 << 30))
    # alpha / r never 1 or 2 (the usual alpha = r, alpha = 2r): a merge that hard-codes the scaling fails
    peft_model = attach_lora(loading.load_model(), r=r, alpha=r * rng.choice((0.5, 1.5, 3))).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)  # B = 0 would make any answer look right
    ids = probe_ids(peft_model.config.vocab_size)
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids).logits
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
        with torch.no_grad():
            unmerged = (merged(input_ids=ids).logits - base).abs().max().item() <= 1e-4
        if unmerged:
            raise Mistake(f"the returned model's logits differ from base + adapter by {diff:.2g}: they are the base "
                          "model's. unload() removes the adapter without merging it; use merge_and_unload()")
        raise Mistake(f"the returned model's logits differ from base + adapter by {diff:.2g}, and from the base "
                      f"model's too: the adapter went into the weights with another scaling than this adapter's "
                      f"alpha / r = {peft_model.peft_config['default'].lora_alpha / r:g}; merge_and_unload() folds "
                      "it in as W + (alpha/r) B A")
    return True


# W = I, B = [[1], [2]], A = [[3, 4]], r = 1, alpha = 2: W + (alpha / r) B A.
expect("06.merged_weight", [[7, 8], [12, 17]],
       wrong=(([[4, 4], [6, 9]], "that is W + B A, without the scaling alpha / r = 2"),
              ([[7, 12], [8, 17]], "that is the transpose: B A is B (2 x 1) times A (1 x 2), row i is B[i] x A, "
                                   "[[3, 4], [6, 8]]"),
              ([[3, 4], [6, 8]], "that is B A alone: scale it by alpha / r = 2 and add W"),
              ([[6, 8], [12, 16]], "that is the update (alpha / r) B A alone: add W, the identity"),
              ([[2.5, 2], [3, 5]], "that scales B A by r / alpha = 0.5: the scaling is alpha / r = 2")),
       hint="B A is the outer product [[3, 4], [6, 8]]; scale it by alpha / r = 2 and add the identity.")
# lora_A of shape [16, 256] (4096 values) under ZeRO-3 on 4 ranks, read on rank 0 without gathering.
expect("06.zero3_numel", [0, 1024],
       wrong=(([4096, 1024], "p.data is an empty placeholder under ZeRO-3 outside forward: 0 values; the whole "
                             "weight exists only while gathered"),
              ([1024, 1024], "p.data holds nothing outside forward: the rank's share is in p.ds_tensor only"),
              ([0, 4096], "p.ds_tensor holds this rank's partition, 1/4 of the 4096 values"),
              ([4096, 4096], "both would hold the whole weight without ZeRO-3: under it p.data is empty and "
                             "p.ds_tensor holds 1/4"),
              ([0, 0], "p.ds_tensor holds this rank's partition: 4096 / 4 values, not none")),
       hint="ZeRO-3 leaves p.data an empty placeholder on every rank and keeps 1/world_size of the values "
            "in p.ds_tensor.")
exercise("06.merge_call", hint="merge(peft_model) must return a plain model whose logits equal base + adapter",
         wrong=((lambda m: m.unload(), "unload() removes the adapter without merging it"),
                (lambda m: m, "still a PeftModel"),
                (lambda m: m.merge_adapter(), "your function returned None"),
                (lambda m: m.get_base_model(), "LoRA layers are still in the model")))(check_merge_call)
