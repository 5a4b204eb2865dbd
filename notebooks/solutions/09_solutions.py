"""Instructor solutions for notebooks/09_hf_trainer.ipynb (checked by tests/test_exercises.py)."""

# 09.train_batch_size: the Trainer fills "auto" with world_size x per-device batch x accumulation steps.
world_size, per_device, accumulation = 16, 4, 8
train_batch_size = world_size * per_device * accumulation

# 09.zero3_load_gib: bf16 = 2 bytes per parameter. Without a DeepSpeed config every rank builds the whole model;
# with a live ZeRO-3 HfDeepSpeedConfig, from_pretrained loads under deepspeed.zero.Init and each rank keeps 1/N.
params, ranks = 7.6e9, 8
whole_gib = params * 2 / 2**30
zero3_load_gib = [whole_gib, whole_gib / ranks]

# 09.ds_config: every value the TrainingArguments own left to the Trainer ("auto"); ZeRO-3 with the gather flag,
# so trainer.save_model() can write a whole model; DeepSpeed's AdamW taking its lr from --learning_rate; bf16 present
# (the Trainer fills bf16.enabled only where the key exists).
ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
}

SOLUTIONS = {
    "09.train_batch_size": train_batch_size,
    "09.zero3_load_gib": zero3_load_gib,
    "09.ds_config": ds_config,
}
