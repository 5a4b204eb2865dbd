"""Chapter 10 (communication): bytes per rank of a ZeRO-2 step on NCCL, and a ZeRO-2 config that sends only what the
ZeRO paper counts.

Solutions: notebooks/solutions/10_solutions.py."""
import copy

from dslab.comm import RING_FACTORS
from dslab.exercises import Mistake, exercise, expect, require_valid_config

# 10.nccl_zero2: 16 GPUs. DeepSpeed's default all-reduces the gradients and all-gathers the parameters; reduced to
# their owners, the gradients cost a reduce-scatter's worth, the paper's count.
_N = 16
_DEFAULT = RING_FACTORS["all_reduce"](_N) + RING_FACTORS["all_gather"](_N)
_OWNERS = RING_FACTORS["reduce_scatter"](_N) + RING_FACTORS["all_gather"](_N)
expect("10.nccl_zero2", [_DEFAULT, _OWNERS],
       wrong=(([_OWNERS, _OWNERS], "the default all-reduces the gradients, 2(N-1)/N of the buffer: only reducing "
                                   "them to their owners costs a reduce-scatter's (N-1)/N"),
              ([1.5, 1.0], "those are the factors for N = 2, chapter 10's measurement: here N = 16"),
              ([_DEFAULT, _DEFAULT], "reducing the gradients to their owners costs a reduce-scatter, (N-1)/N, not "
                                     "an all-reduce, 2(N-1)/N"),
              ([3.0, 2.0], "those drop the (N-1)/N: each rank sends (N-1)/N of the buffer per collective half, 15/16 "
                           "here"),
              ([2.625, 1.75], "those are the factors for N = 8: here N = 16")),
       hint="per rank, a ring all-reduce sends 2(N-1)/N x the buffer, a reduce-scatter and an all-gather (N-1)/N each; "
            "the default all-reduces the gradients, reduce to owners costs a reduce-scatter; both all-gather the "
            "parameters. N = 16.")

# 10.paper_zero2: the chapter's ZeRO-2 config, as a learner might change it.
_BASE = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**22, "allgather_bucket_size": 2**22},
    "comms_logger": {"enabled": True, "prof_all": True},
}


def _changed(**sections):
    """_BASE with sections merged in (a dict merges one level down, anything else replaces)."""
    cfg = copy.deepcopy(_BASE)
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


WRONG_CONFIGS = (
    _BASE,                                                                           # everything left on
    _changed(zero_optimization={"use_multi_rank_bucket_allreduce": False}),         # the two small ones left
    _changed(gradient_clipping=0.0, bf16={"check_grad_overflow": False},            # all-reduce left
             zero_optimization={"compute_grad_norm": False}),
    _changed(bf16={"check_grad_overflow": False},                                   # DeepSpeed refuses: clipping
             zero_optimization={"use_multi_rank_bucket_allreduce": False, "compute_grad_norm": False}),
    _changed(gradient_clipping=0.0, bf16={"check_grad_overflow": False},            # reduce_scatter false: all-reduce
             zero_optimization={"use_multi_rank_bucket_allreduce": False, "compute_grad_norm": False,
                                "reduce_scatter": False}),
    _changed(gradient_clipping=0.0, bf16={"check_grad_overflow": False},            # a typo DeepSpeed would ignore
             zero_optimization={"use_multi_rank_bucket_all_reduce": False, "compute_grad_norm": False}),
)

# what each left-over collective is, and the key that removes it
_LEFT_OVER = {
    "all_reduce": 'the gradients are all-reduced, so every rank receives every sum: set "zero_optimization": '
                  '{"use_multi_rank_bucket_allreduce": false} (and leave "reduce_scatter" at true)',
    "uint8": 'the 1-byte overflow flag is still all-reduced: "bf16": {"check_grad_overflow": false}',
    "fp32": 'the gradient norm is still all-reduced: "zero_optimization": {"compute_grad_norm": false}, which needs '
            '"gradient_clipping": 0',
}


# what the checker names in each of WRONG_CONFIGS, in order
_WRONG_CONFIG_WORDS = ("the gradients are all-reduced", "1-byte overflow flag", "the gradients are all-reduced",
                       'refuses "compute_grad_norm": false while clipping', 'leave "reduce_scatter" at true',
                       "unknown key 'use_multi_rank_bucket_all_reduce'")


@exercise("10.paper_zero2", wrong=tuple(zip(WRONG_CONFIGS, _WRONG_CONFIG_WORDS, strict=True)),
          hint="start from the chapter's ZeRO-2 ds_config; three keys remove the all-reduces (sections 4 and 5 "
               "name them)")
def _check_paper_zero2(ds_config):
    from dslab import comm_bytes, zero, zero3_fetch

    require_valid_config(ds_config, world_size=2, device=None)
    zero_section = ds_config.get("zero_optimization") or {}
    if zero_section.get("stage") != 2:
        raise Mistake(f'zero_optimization.stage is {zero_section.get("stage", 0)}; the exercise is about ZeRO-2')
    if not (ds_config.get("bf16") or {}).get("enabled"):
        raise Mistake('bf16 is off: the chapter measures "bf16": {"enabled": true}')
    if not (ds_config.get("comms_logger") or {}).get("enabled"):
        raise Mistake('the comms logger is off: "comms_logger": {"enabled": true, "prof_all": true} records the '
                      'collectives you want to check')
    if zero_section.get("compute_grad_norm") is False and float(ds_config.get("gradient_clipping", 1.0)) > 0:
        raise Mistake('DeepSpeed refuses "compute_grad_norm": false while clipping (its stage_1_and_2.py raises): '
                      'clipping needs the norm, so set "gradient_clipping": 0')
    collectives, _ = comm_bytes.deepspeed_collectives(zero3_fetch.model_trace(zero.SHAPE), 2, ds_config)
    for c in collectives:
        if c["op"] == "all_reduce":
            raise Mistake(_LEFT_OVER["all_reduce" if c["numel"] > 1 else c["dtype"]])
    return {c["op"] for c in collectives} == {"reduce", "all_gather_into_tensor"}
