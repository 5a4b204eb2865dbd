"""Chapter 04 (ZeRO): per-GPU memory by stage, and a ZeRO-3 + offload config run for real.

Solutions: notebooks/solutions/04_solutions.py."""
from dslab.exercises import Mistake, exercise, expect, require_valid_config
from dslab.memory import human


# 13B parameters, 16 GPUs, ZeRO-2, bf16 + Adam: 2Ψ + 14Ψ/16 bytes per GPU, in GB (1e9 bytes).
expect("04.zero2_gb", 37.375, rel=1e-3, wrong=(208.0, 13.0, 26.0, 61.75),
       hint="ZeRO-2 keeps the 16-bit parameters whole (2 bytes each) and partitions gradients and optimizer "
            "states: 2Ψ + (2 + 12)Ψ/N. Answer in GB (1e9 bytes); dslab.memory.theory gives bytes.")
# 7B parameters under ZeRO-3 on 24 GB GPUs: 16Ψ/N <= 24e9 -> N >= 4.67, so 5.
expect("04.min_gpus", 5, wrong=(4, 8, 2, 6),
       hint="under ZeRO-3 every model state is partitioned: 16Ψ/N bytes per GPU. Find the smallest whole N "
            "with 16 x 7e9 / N <= 24e9.")
# 1.5B parameters on 8 GPUs of 16 GB: stage 0 needs 24 GB, stage 1 needs 4Ψ + 12Ψ/8 = 8.25 GB.
expect("04.lowest_stage", 1, wrong=(0, 2, 3),
       hint="compute theory(1.5e9, 8, stage)['total'] for stages 0, 1, 2, 3 and take the first that is "
            "at most 16e9 bytes.")


# 04.zero3_offload: the learner writes a ds_config for ZeRO-3 with optimizer states and parameters offloaded to
# CPU memory. dslab.config_check names what DeepSpeed would refuse or silently ignore; then the config trains
# one step on a fresh rank, and the bytes must be where the learner meant them: none on the accelerator.
def _offload_device(zero_cfg, what):
    block = zero_cfg.get(f"offload_{what}")
    return block.get("device", "none") if isinstance(block, dict) else "none"


def _offload_config(zero_cfg, zero_key="zero_optimization", **top):
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
            **top, zero_key: zero_cfg}


_CPU = {"device": "cpu"}
_ZERO3_OFFLOAD_WRONG = (  # the mistakes learners make, each named by the checker
    _offload_config({"stage": 2, "offload_optimizer": _CPU, "offload_param": _CPU}),  # offload_param below stage 3
    _offload_config({"stage": 4, "offload_optimizer": _CPU, "offload_param": _CPU}),  # no stage 4
    _offload_config({"stage": 3, "offload_optimizer": {"pin_memory": True},           # no device: "none", no offload
                     "offload_param": {"pin_memory": True}}),
    _offload_config({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": "true"},  # a string, not true
                     "offload_param": {"device": "cpu", "pin_memory": "true"}}),
    _offload_config({"stage": 3, "offload_optimizer": _CPU, "offload_param": _CPU},  # misspelled: silently ignored
                    zero_key="zero_optimisation"),
    _offload_config({"stage": 3, "offload_optimizer": _CPU, "offload_param": _CPU},  # 6 != 2 x 1 x 2 ranks
                    train_batch_size=6),
    _offload_config({"stage": 3, "offload_optimizer": _CPU}),                          # parameters not offloaded
)


@exercise("04.zero3_offload", wrong=_ZERO3_OFFLOAD_WRONG,
           hint="write a dict: zero_optimization with stage 3, offload_optimizer and offload_param, each with "
                "device \"cpu\"; a batch size, bf16 and an optimizer as in the chapter's ds_config.")
def _check_zero3_offload(cfg, world_size=2):
    require_valid_config(cfg, world_size)
    zero_cfg = cfg.get("zero_optimization") or {}
    if zero_cfg.get("stage", 0) != 3:
        raise Mistake(f"zero_optimization.stage is {zero_cfg.get('stage', 0)}: parameters are partitioned (and so "
                      "can be offloaded) only at stage 3")
    for what, why in (("optimizer", "Adam's states and the fp32 master weights stay on the accelerator"),
                      ("param", "the 16-bit parameter partitions stay on the accelerator")):
        device = _offload_device(zero_cfg, what)
        if device != "cpu":
            missing = f"offload_{what} is missing" if f"offload_{what}" not in zero_cfg else \
                f"offload_{what}.device is {device!r} (DeepSpeed's default when no device is given is \"none\")"
            raise Mistake(f"zero_optimization.{missing}: nothing is offloaded, so {why}; "
                          f"set \"offload_{what}\": {{\"device\": \"cpu\"}}")
    from dslab import zero

    try:
        ran = zero.try_config(cfg)  # one optimizer step for real, on a fresh rank
    except RuntimeError as exc:
        raise Mistake(f"DeepSpeed accepted the keys but the run failed: {exc}") from None
    held = ran["memory"]
    if ran["inner_optimizer"] != "DeepSpeedCPUAdam" or held["total"] != 0 or held["offloaded"] == 0:
        raise Mistake(f"the run kept {human(held['total'])} of model states on the accelerator with "
                      f"{ran['inner_optimizer']}; with both offloads it keeps none and updates with DeepSpeedCPUAdam")
    return True
