"""Instructor solutions for notebooks/02_mixed_precision.ipynb (checked by tests/test_exercises.py)."""
from dslab.precision import formats

# 02.fp16_fates: 70000 > 65504 -> inf; 1e-9 < 2^-25 (half the smallest subnormal) -> 0;
# 3e-6 lies between the smallest subnormal (6e-8) and the smallest normal (6.1e-5);
# 1 + 2^-12 is closer to 1.0 than to 1 + 2^-10 (fp16's next value) -> rounded to 1.0.
fates = ["overflow", "underflow", "subnormal", "rounded"]
assert fates == [formats.fate(v, "fp16") for v in formats.FP16_FATE_VALUES]

# 02.deepspeed_scale: flags F T F T T F F F F, start 2^12, window 2, hysteresis 2.
# step 1: overflow, hysteresis 2 -> 1, scale stays 4096 (step skipped)
# step 3: overflow, hysteresis is 1 -> halve to 2048;  step 4: overflow -> 1024
# steps 5, 6: stable 0, 1; step 7: stable 2 = window -> double to 2048 (hysteresis refilled); step 8: stays.
deepspeed_scale = 2048.0

# 02.bf16_min_update: 7 stored mantissa bits -> the gap above 1.0 is 2^-7; 2^-8 is a tie that rounds to 1.0.
bf16_min_update = 2.0**-7
assert formats.cast(1 + bf16_min_update, "bf16") != 1.0 and formats.cast(1 + 2.0**-8, "bf16") == 1.0



# 02.amp_clip: clip the true gradients: unscale_ first (it divides them by the scale in place and notes
# inf/nan), then clip, then scaler.step (which does not unscale twice), then update.
def amp_clip_step(model, optimizer, scaler, x, y, max_norm):
    import torch
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss


# 02.bf16_config: bf16 on (fp16 off or absent), ZeRO-1, micro 4 x accumulation 1 x 2 ranks = 8, AdamW lr 1e-3.
bf16_config = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                              "torch_adam": True}},
    "gradient_clipping": 1.0,
}

SOLUTIONS = {
    "02.fp16_fates": fates,
    "02.deepspeed_scale": deepspeed_scale,
    "02.bf16_min_update": bf16_min_update,
    "02.amp_clip": amp_clip_step,
    "02.bf16_config": bf16_config,
}
