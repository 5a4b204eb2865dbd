"""Chapter 04 (ZeRO): per-GPU memory by stage, a ZeRO-3 + offload config run for real, and a whole ZeRO-3 + offload
training run written by the learner, checked on 2 and 3 ranks.

Solutions: notebooks/solutions/04_solutions.py."""
from dslab.exercises import Mistake, engine_loop, exercise, expect, loops, require_valid_config
from dslab.zero.memory import human


# 13B parameters, 16 GPUs, ZeRO-2, bf16 + Adam: 2Ψ + 14Ψ/16 bytes per GPU, in GB (1e9 bytes).
expect("04.zero2_gb", 37.375, rel=1e-3,
       wrong=((208.0, "208 GB is 16 bytes per parameter on every GPU, the 1/N forgotten (ZeRO-0's count): ZeRO-2 "
                      "divides the gradients and optimizer states among the 16 GPUs"),
              (13.0, "13 GB is 16Ψ/16, everything partitioned: that is ZeRO-3. ZeRO-2 keeps the bf16 parameters "
                     "whole on every GPU"),
              (26.0, "26 GB counts only the bf16 parameters (2 bytes each): add the partitioned gradients and "
                     "optimizer states, 14Ψ/16"),
              (61.75, "61.75 GB is ZeRO-1 (4Ψ + 12Ψ/16): at stage 2 the gradients are partitioned too"),
              (598.0, "598 GB is what the 16 GPUs hold together: the question asks per GPU"),
              (34.81, "that is GiB (2^30 bytes): answer in GB (1e9 bytes)"),
              (37.375e9, "that is bytes: answer in GB (1e9 bytes)")),
       hint="ZeRO-2 keeps the 16-bit parameters whole (2 bytes each) and partitions gradients and optimizer "
            "states: 2Ψ + (2 + 12)Ψ/N. Answer in GB (1e9 bytes); dslab.zero.memory.theory gives bytes.")
# 7B parameters under ZeRO-3 on 24 GB GPUs: 16Ψ/N <= 24e9 -> N >= 4.67, so 5.
expect("04.min_gpus", 5,
       wrong=((4, "4 GPUs would hold 16 x 7e9 / 4 = 28 GB each, more than 24: round 4.67 up, not down"),
              (1, "1 counts 2 bytes per parameter, the bf16 weights only: training with Adam keeps 16 bytes per "
                  "parameter, and ZeRO-3 divides all of them"),
              (10, "10 is ZeRO-2's answer (2Ψ + 14Ψ/N): under ZeRO-3 the parameters are partitioned too, 16Ψ/N"),
              (6, "6 GPUs are enough, but so are 5 (22.4 GB each): the fewest is asked"),
              (8, "8 GPUs are enough, but so are 5 (22.4 GB each): the fewest is asked"),
              (112, "112 GB is what the model states take in total: divide by what one GPU holds")),
       hint="under ZeRO-3 every model state is partitioned: 16Ψ/N bytes per GPU. Find the smallest whole N "
            "with 16 x 7e9 / N <= 24e9.")
# 1.5B parameters on 8 GPUs of 16 GB: stage 0 needs 24 GB, stage 1 needs 4Ψ + 12Ψ/8 = 8.25 GB.
expect("04.lowest_stage", 1,
       wrong=((0, "stage 0 keeps all 16 bytes per parameter on every GPU: 24 GB, more than 16"),
              (2, "stage 2 fits, but stage 1 already does: 4Ψ + 12Ψ/8 = 8.25 GB per GPU"),
              (3, "stage 3 fits, but stage 1 already does: 4Ψ + 12Ψ/8 = 8.25 GB per GPU")),
       hint="compute theory(1.5e9, 8, stage)['total'] for stages 0, 1, 2, 3 and take the first that is "
            "at most 16e9 bytes.")


# 04.zero3_offload: the learner writes a ds_config for ZeRO-3 with optimizer states and parameters offloaded to
# CPU memory. dslab.config.check names what DeepSpeed would refuse or silently ignore; then the config trains
# one step on a fresh rank, and the bytes must be where the learner meant them: none on the accelerator.
def _offload_device(zero_cfg, what):
    block = zero_cfg.get(f"offload_{what}")
    return block.get("device", "none") if isinstance(block, dict) else "none"


def _offload_config(zero_cfg, zero_key="zero_optimization", **top):
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
            **top, zero_key: zero_cfg}


_CPU = {"device": "cpu"}
_ZERO3_OFFLOAD_WRONG = (  # the mistakes learners make, each named by the checker
    (_offload_config({"stage": 2, "offload_optimizer": _CPU, "offload_param": _CPU}),   # offload_param below stage 3
     "offload_param needs ZeRO stage 3"),
    (_offload_config({"stage": 4, "offload_optimizer": _CPU, "offload_param": _CPU}),   # no stage 4
     "stage must be 0, 1, 2 or 3"),
    (_offload_config({"stage": 3, "offload_optimizer": {"pin_memory": True},            # no device: "none"
                      "offload_param": {"pin_memory": True}}), "offload_optimizer.device is 'none'"),
    (_offload_config({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": "true"},  # a string
                      "offload_param": {"device": "cpu", "pin_memory": "true"}}), "written as a string"),
    (_offload_config({"stage": 3, "offload_optimizer": _CPU, "offload_param": _CPU},   # misspelled: ignored
                     zero_key="zero_optimisation"), "unknown key 'zero_optimisation'"),
    (_offload_config({"stage": 3, "offload_optimizer": _CPU, "offload_param": _CPU},   # 6 != 2 x 1 x 2 ranks
                     train_batch_size=6), "train_batch_size 6 != "),
    (_offload_config({"stage": 3, "offload_optimizer": _CPU}), "offload_param is missing"),  # parameters stay
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
    from dslab.zero import runner

    try:
        ran = runner.try_config(cfg)  # one optimizer step for real, on a fresh rank
    except RuntimeError as exc:
        raise Mistake(f"DeepSpeed accepted the keys but the run failed: {exc}") from None
    held = ran["memory"]
    if ran["inner_optimizer"] != "DeepSpeedCPUAdam" or held["total"] != 0 or held["offloaded"] == 0:
        raise Mistake(f"the run kept {human(held['total'])} of model states on the accelerator with "
                      f"{ran['inner_optimizer']}; with both offloads it keeps none and updates with DeepSpeedCPUAdam")
    return True


# 04.offload_loop: chapter 03's engine loop under ZeRO-3 with the optimizer and the parameters offloaded to the CPU
# (dslab/exercises/engine_loop.py, task "offload"). The wrong answers are the right run with one mistake each.
_BOTH_OFFLOADED = {"stage": 3, "offload_optimizer": _CPU, "offload_param": _CPU}


def _offload_loop_config(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, world_size, lr, zero=_BOTH_OFFLOADED)


def _offload_config_without_optimizer(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, world_size, lr, zero=_BOTH_OFFLOADED, optimizer=False)


def _offload_config_optimizer_only(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, world_size, lr,
                        zero={"stage": 3, "offload_optimizer": _CPU})


def _offload_config_stage2(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, world_size, lr,
                        zero={"stage": 2, "offload_optimizer": _CPU})


def _offload_config_for_two_ranks(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, 2, lr, zero=_BOTH_OFFLOADED)   # the chapter's world size


OFFLOAD_LOOP_WRONG = (
    ((loops.small_model, _offload_config_without_optimizer, loops.with_mistake("client optimizer")),
     "offload without a CPU optimizer"),
    ((loops.small_model, _offload_config_optimizer_only, loops.train), "offload_param does not send"),
    ((loops.small_model, _offload_config_stage2, loops.train), "zero_optimization.stage is 2"),
    ((loops.small_model, _offload_loop_config, loops.with_mistake("loss divided")), "the loss is divided twice"),
    ((loops.small_model, _offload_loop_config, loops.with_mistake("zero_grad")), "zero_grad fighting the engine"),
    ((loops.small_model, _offload_config_for_two_ranks, loops.train), "takes the world size as 2"),
)


@exercise("04.offload_loop", wrong=OFFLOAD_LOOP_WRONG,
          prepare=lambda answers: engine_loop.prepare(answers, "offload"),
          hint="write make_model(d_in, d_out), make_config(micro_batch_size, grad_accum_steps, world_size, lr) for "
               "ZeRO-3 with offload_optimizer and offload_param on the CPU, and train(model, ds_config, "
               "micro_batches); then answer = (make_model, make_config, train)")
def _check_offload_loop(answer):
    return engine_loop.check(answer, "offload")
