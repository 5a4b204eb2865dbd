"""Instructor solutions for notebooks/06_merge_lora.ipynb (checked by tests/test_exercises.py)."""
import torch

# 06.merged_weight: W + (alpha / r) B A with W = I, B = [[1], [2]], A = [[3, 4]], r = 1, alpha = 2.
W = torch.eye(2)
B = torch.tensor([[1.0], [2.0]])
A = torch.tensor([[3.0, 4.0]])
r, alpha = 1, 2
merged = W + (alpha / r) * B @ A

# 06.zero3_numel: a [16, 256] lora_A on 4 ranks under ZeRO-3, on rank 0 without gathering:
# p.data is an empty placeholder; p.ds_tensor holds this rank's quarter.
world_size = 4
zero3_numel = [0, 16 * 256 // world_size]



# 06.merge_call: fold W + (alpha/r) B A into every adapted weight and drop the LoRA layers.
def merge(peft_model):
    return peft_model.merge_and_unload()


SOLUTIONS = {
    "06.merged_weight": merged.tolist(),
    "06.zero3_numel": zero3_numel,
    "06.merge_call": merge,
}
