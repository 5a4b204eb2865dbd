"""Instructor solutions for notebooks/11_parallelism.ipynb (checked by tests/test_exercises.py)."""
from dslab import pipeline

# 11.bubble: 4 stages, 12 micro-batches: (p - 1) / (m + p - 1).
bubble = pipeline.bubble_fraction(micro_batches=12, stages=4)

# 11.min_micro_batches: the fewest micro-batches that keep 8 stages at most 10 % idle.
min_micro_batches = next(m for m in range(1, 10_000) if pipeline.bubble_fraction(m, 8) <= 0.1)

# 11.tp_dp_config: 8 ranks in tensor-parallel groups of 2 = 4 model replicas (data-parallel degree 4); ZeRO-1; micro
# batch 4; 32 distinct samples per step -> accumulation 32 / (4 x 4 replicas) = 2. DeepSpeed's batch check counts all
# 8 ranks: 4 x 2 x 8 = 64.
tp_dp_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "train_batch_size": 64,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
    "gradient_clipping": 1.0,
    "tensor_parallel": {"autotp_size": 2},
    "zero_optimization": {"stage": 1},
}

SOLUTIONS = {
    "11.bubble": bubble,
    "11.min_micro_batches": min_micro_batches,
    "11.tp_dp_config": tp_dp_config,
}
