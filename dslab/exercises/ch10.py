"""Chapter 10 (communication): bytes per rank of a ZeRO-2 step on NCCL, and a ZeRO-2 config that sends only what the
ZeRO paper counts.

Solutions: notebooks/solutions/10_solutions.py."""
import copy

from dslab.comm.wire import RING_FACTORS
from dslab.config.build import BUCKET_SIZE
from dslab.exercises import Mistake, exercise, expect, on_ranks, require_valid_config

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
    "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET_SIZE, "allgather_bucket_size": BUCKET_SIZE},
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
    from dslab.comm import step_bytes, zero3_fetch
    from dslab.zero import runner

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
    collectives, _ = step_bytes.deepspeed_collectives(zero3_fetch.model_trace(runner.SHAPE), 2, ds_config)
    for c in collectives:
        if c["op"] == "all_reduce":
            raise Mistake(_LEFT_OVER["all_reduce" if c["numel"] > 1 else c["dtype"]])
    return {c["op"] for c in collectives} == {"reduce", "all_gather_into_tensor"}


# ---- 10.reduce_to_owners: the learner writes ZeRO-2's "reduce to owners" with deepspeed.comm; launched ranks run it --
# reduce_to_owners(grads): grads is this rank's flat fp32 gradient buffer, cut into world_size parts as
# torch.tensor_split cuts it (rank r owns part r); one reduce per part, to its owner; returns this rank's part of the
# mean over the ranks. Checked on 2 and 3 ranks with sizes and values drawn at check time; the bytes each rank sent
# (TCP payload, dslab.comm.wire.tcp_bytes) are compared with gloo's reduce and all-reduce (dslab.comm.gloo_bytes).
OWNERS_TRIAL = f"{__name__}:owners_trial"


def draw_owners_case(world_size, rng=None):
    """A buffer size (one the world size does not divide: parts of unequal size) and a seed, chosen now."""
    import random

    rng = rng or random.SystemRandom()
    numel = rng.choice([n for n in range(20_000, 60_000, 997) if n % world_size])
    return {"world_size": world_size, "numel": numel, "seed": rng.randrange(1 << 30)}


def owners_gradients(case, rank):
    """Rank `rank`'s gradient buffer in the case (every rank can make any rank's: the reference needs them all)."""
    import torch

    return torch.randn(case["numel"], generator=torch.Generator().manual_seed(case["seed"] + rank))


def owners_bytes(case, rank):
    """What rank `rank` writes on gloo: {"reduces": one reduce per part to its owner, "all_reduce": one all-reduce of
    the whole buffer} (dslab.comm.gloo_bytes, preambles included)."""
    import torch

    from dslab.comm import gloo_bytes

    n = case["world_size"]
    parts = [t.numel() for t in torch.tensor_split(torch.empty(case["numel"]), n)]
    return {"reduces": sum(gloo_bytes.reduce(4 * size, 4, n, root=owner)[rank] for owner, size in enumerate(parts)),
            "all_reduce": gloo_bytes.all_reduce(4 * case["numel"], 4, n)[rank]}


def owners_trial(reduce_to_owners, case):
    """On every rank: the learner's reduce_to_owners on this rank's gradients; how far its answer is from the mean
    part (and from the usual wrong parts), and the bytes this rank sent while it ran."""
    import torch

    from dslab.comm import wire

    rank, n = torch.distributed.get_rank(), case["world_size"]
    everyone = [owners_gradients(case, r) for r in range(n)]
    mean = torch.stack(everyone).mean(0)
    mine = torch.tensor_split(torch.arange(case["numel"]), n)[rank]
    before = sum(sent for sent, _ in wire.tcp_bytes().values())
    out = reduce_to_owners(everyone[rank].clone())
    sent = sum(sent for sent, _ in wire.tcp_bytes().values()) - before
    if not isinstance(out, torch.Tensor):
        raise Mistake(f"return this rank's part, a tensor; your function returned {type(out).__name__}")
    out = out.detach().reshape(-1).float()
    if out.numel() != mine.numel():
        raise Mistake(f"rank {rank} returned {out.numel()} values; torch.tensor_split cuts {case['numel']} into "
                      f"{n} parts and rank {rank}'s holds {mine.numel()} (answer with this rank's part only)")

    def off(target):
        return (out - target[mine]).abs().max().item()

    return {"mean": off(mean), "sum": off(mean * n), "own": off(everyone[rank]), "sent": sent,
            "divided": {k: off(mean * n / k) for k in range(2, 9) if k != n}, **owners_bytes(case, rank)}


def diagnose_owners(case, results):
    """A Mistake naming what the learner's reduce_to_owners did wrong on this case, if anything."""
    n = case["world_size"]
    what = f"{n} ranks, {case['numel']:,} gradients"
    for rank, r in enumerate(results):
        if r["mean"] < 1e-4:
            continue
        if r["sum"] < 1e-3:
            raise Mistake(f"rank {rank}'s part is the sum over the {n} ranks ({what}): reduce adds; divide by "
                          "world_size for the mean, as DeepSpeed does (it divides before reducing)")
        divisor = next((int(k) for k, d in r.get("divided", {}).items() if d < 1e-3), None)
        if divisor is not None:
            raise Mistake(f"rank {rank}'s part is the sum over the {n} ranks divided by {divisor} ({what}): divide "
                          f"by dist.get_world_size(), {n} here, not a number written in")
        said = "still holds its own gradients" if r["own"] < 1e-6 else "is not the mean over the ranks"
        raise Mistake(f"rank {rank}'s part {said} ({what}): the sum of a reduce lands on its dst only (the other "
                      "ranks' buffers are left holding partial sums), so reduce part r to its owner, dst=r, every rank "
                      "calling every reduce, then / world_size")
    for rank, r in enumerate(results):
        if abs(r["sent"] - r["reduces"]) <= 0.02 * r["reduces"] + 200:
            continue
        if abs(r["sent"] - r["all_reduce"]) <= 0.02 * r["all_reduce"] + 200:
            raise Mistake(f"rank {rank} sent {r['sent']:,} bytes, what an all-reduce of the whole buffer sends on "
                          f"gloo; one reduce per part to its owner sends {r['reduces']:,} ({what}): every rank "
                          "received every sum, the gap of section 4 (gloo's reduce_scatter is an all-reduce too)")
        raise Mistake(f"rank {rank} sent {r['sent']:,} bytes; one reduce per part to its owner sends "
                      f"{r['reduces']:,} on gloo ({what})")


def _owners_answer(grads, dst=None, mean=True, collective="reduce", split="tensor_split"):
    """reduce_to_owners as the solution writes it, with one of the usual mistakes switched on (the wrong answers)."""
    import deepspeed.comm as dist
    import torch

    world_size, rank = dist.get_world_size(), dist.get_rank()
    parts = torch.tensor_split(grads, world_size) if split == "tensor_split" else grads.chunk(world_size)
    if collective == "all_reduce":
        dist.all_reduce(grads)
    else:
        for owner, part in enumerate(parts):
            dist.reduce(part, dst=owner if dst is None else dst)
    return parts[rank] / (world_size if mean else 1)


def _owners_all_reduce(grads):
    return _owners_answer(grads, collective="all_reduce")   # right values, twice the bytes


def _owners_sum(grads):
    return _owners_answer(grads, mean=False)


def _owners_all_to_rank0(grads):
    return _owners_answer(grads, dst=0)


def _owners_halves(grads):
    import deepspeed.comm as dist
    import torch

    parts = torch.tensor_split(grads, 2)                      # the chapter's 2 ranks, typed in
    for owner, part in enumerate(parts):
        dist.reduce(part, dst=owner)
    return parts[dist.get_rank()] / 2


@exercise("10.reduce_to_owners",
          wrong=((_owners_all_reduce, "what an all-reduce of the whole buffer sends"),
                 (_owners_sum, "is the sum over the"),
                 (_owners_all_to_rank0, "lands on its dst only"),
                 (_owners_halves, "values; torch.tensor_split cuts")),
          prepare=on_ranks.preparer(OWNERS_TRIAL, draw_owners_case, diagnose=diagnose_owners),
          hint="complete reduce_to_owners(grads): parts = torch.tensor_split(grads, world_size); for each part, "
               "deepspeed.comm.reduce(part, dst=its owner) on every rank; return parts[rank] / world_size.")
def _check_owners(reduce_to_owners):
    return on_ranks.check(OWNERS_TRIAL, reduce_to_owners, draw_owners_case, diagnose_owners)
