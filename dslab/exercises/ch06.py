"""Chapter 06 (merging LoRA): merged weights, ZeRO-3 sizes, and the merge call.

Solutions: notebooks/solutions/06_solutions.py."""
from dslab.exercises import Mistake, exercise, expect
from dslab.lora import attach_lora, probe_ids

def check_merge_call(merge_fn):
    """Run the learner's `merge(peft_model)` on dslab-tiny with a trained-looking adapter; name what is wrong."""
    import torch
    from peft import PeftModel

    from dslab import models
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
