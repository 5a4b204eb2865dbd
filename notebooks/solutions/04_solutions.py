"""Instructor solutions for notebooks/04_zero.ipynb (checked by tests/test_exercises.py)."""
import runpy
from pathlib import Path

from dslab.zero import memory

# 04.zero2_gb: 13B parameters, ZeRO-2 on 16 GPUs: 2Ψ (whole 16-bit weights) + 14Ψ/16 (partitioned rest).
zero2_gb = memory.theory(13e9, world_size=16, zero_stage=2)["total"] / 1e9

# 04.min_gpus: the fewest GPUs of 24 GB that hold a 7B model's states under ZeRO-3 (16Ψ/N per GPU).
min_gpus = next(n for n in range(1, 1025) if memory.theory(7e9, n, 3)["total"] <= 24e9)

# 04.lowest_stage: the lowest stage at which 1.5B parameters fit in 16 GB per GPU on 8 GPUs.
lowest_stage = next(s for s in range(4) if memory.theory(1.5e9, 8, s)["total"] <= 16e9)

SOLUTIONS = {
    "04.zero2_gb": zero2_gb,
    "04.min_gpus": min_gpus,
    "04.lowest_stage": lowest_stage,
}

# 04.zero3_offload: ZeRO-3 with optimizer states and parameters in CPU memory (DeepSpeedCPUAdam does the update).
zero3_offload = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
}
SOLUTIONS["04.zero3_offload"] = zero3_offload


# 04.offload_loop: chapter 03's engine loop, unchanged (its make_model and train), under a ZeRO-3 config that offloads
# both the optimizer (its fp32 master weights and Adam's moments, updated by DeepSpeedCPUAdam, which DeepSpeed builds
# from the "optimizer" section) and the parameter partitions to CPU memory.
_chapter_03 = runpy.run_path(str(Path(__file__).with_name("03_solutions.py")))
make_model, make_config, train = _chapter_03["make_model"], _chapter_03["make_config"], _chapter_03["train"]


def make_offload_config(micro_batch_size, grad_accum_steps, world_size, lr):
    ds_config = make_config(micro_batch_size, grad_accum_steps, world_size, lr)
    ds_config["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                      "offload_param": {"device": "cpu"}}
    return ds_config


SOLUTIONS["04.offload_loop"] = (make_model, make_offload_config, train)
