"""Chapter 09's pieces: which "auto" values the real Trainer fills (dslab.training.hf_bridge), what a rank holds, and the
`accelerate launch` layout dslab.launch reads. Chapter 09 runs dslab/recipes/hf_sft.py on 2 ranks under ZeRO-2 and
ZeRO-3, resumed by `accelerate launch` with the same losses, and asserts each result."""
import json

import pytest

from dslab import launch
from dslab.models import loading
from dslab.training import hf_bridge
from dslab.launch.commands import accelerate_layout

# Distinct values, so that each "auto" shows which argument it was filled from.
ARGS = {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 5, "learning_rate": 7e-4,
        "max_grad_norm": 0.7, "adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-7, "weight_decay": 0.01,
        "warmup_steps": 0.1, "bf16": True}


def _every_auto():
    """A config with "auto" at every key of AUTO_SOURCES, plus one the Trainer never fills."""
    config = {"zero_optimization": {"stage": 3, "allgather_bucket_size": "auto"}}
    for key in hf_bridge.AUTO_SOURCES:
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = "auto"
    config["optimizer"]["type"], config["scheduler"]["type"] = "AdamW", "WarmupDecayLR"
    return config


def test_auto_sources_name_what_the_trainer_fills():
    resolved = hf_bridge.flatten(hf_bridge.resolve_for_trainer(_every_auto(), hidden_size=128, steps=50, **ARGS))
    expected = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5, "train_batch_size": 15,
                "gradient_clipping": 0.7, "optimizer.params.lr": 7e-4, "optimizer.params.betas": [0.8, 0.95],
                "optimizer.params.eps": 1e-7, "optimizer.params.weight_decay": 0.01,
                "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 7e-4,
                "scheduler.params.warmup_num_steps": 5, "scheduler.params.total_num_steps": 50,
                "fp16.enabled": False, "bf16.enabled": True, "zero_optimization.reduce_bucket_size": 128 * 128,
                "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 128 * 128),
                "zero_optimization.stage3_param_persistence_threshold": 10 * 128}
    assert set(expected) == set(hf_bridge.AUTO_SOURCES)
    assert {key: resolved[key] for key in expected} == expected
    assert resolved["zero_optimization.allgather_bucket_size"] == "auto"  # not the Trainer's: left for DeepSpeed


def test_a_literal_that_disagrees_is_refused_naming_both_values():
    config = {**_every_auto(), "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ValueError, match="ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=3"):
        hf_bridge.resolve_for_trainer(config, **ARGS)
    from transformers.integrations.deepspeed import deepspeed_config

    assert deepspeed_config() is None  # no ZeRO-3 config left live for a later from_pretrained


def test_resolved_autos_lists_each_auto_and_each_added_key():
    rows = hf_bridge.resolved_autos({"a": "auto", "b": {"c": "auto", "d": 1}},
                                    {"a": 2, "b": {"c": 3, "d": 1}, "e": True})
    assert [(r["key"], r["in the file"], r["resolved"]) for r in rows] == [("a", "auto", 2), ("b.c", "auto", 3),
                                                                           ("e", "(absent)", True)]


def test_held_bytes_of_a_model_without_zero():
    model = loading.load_model(dtype="bf16")
    held = hf_bridge.held_bytes(model)
    n = sum(p.numel() for p in model.parameters())
    assert held["whole_numel"] == held["model_numel"] == held["held_numel"] == n and held["partition_numel"] == 0
    assert held["held_bytes"] == 2 * n


def test_accelerate_layout_reads_options_then_the_config_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 8\nmachine_rank: 1\n")
    assert accelerate_layout(["accelerate", "launch", "--config_file", str(config)]) == (8, 4, 1)
    with_option = ["accelerate", "launch", "--config_file", str(config), "--num_processes", "4"]
    assert accelerate_layout(with_option) == (4, 2, 1)
    assert accelerate_layout(["accelerate", "launch"]) == (1, 1, 0)
    with pytest.raises(launch.LaunchError, match="only `accelerate launch"):
        launch.run_commands("accelerate config")
