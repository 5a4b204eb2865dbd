"""Instructor solutions for notebooks/05_lora_sft.ipynb (checked by tests/test_exercises.py)."""
from dslab import lora, models

# 05.lora_params: attach r=8 adapters to q_proj and v_proj of a model of the dslab-tiny shape and count.
model = lora.attach_lora(models.build_model(models.tiny_config()), r=8, alpha=16, target_modules=["q_proj", "v_proj"])
lora_params = lora.count_parameters(model)["trainable"]
# The same by hand: r (d_in + d_out) per adapted layer, v_proj maps 256 -> 2 KV heads x 64.
assert lora_params == 4 * (8 * (256 + 256) + 8 * (256 + 128))

# 05.ckpt_forwards: every layer runs once in forward and once more when backward recomputes it.
layers = 24
ckpt_forwards = 2 * layers

SOLUTIONS = {
    "05.lora_params": lora_params,
    "05.ckpt_forwards": ckpt_forwards,
}
