"""Exercise 11.ulysses: the learner wraps causal attention in DeepSpeed-Ulysses' DistributedAttention; the checker runs
it on 2 and 3 launched ranks (dslab.exercises.on_ranks) with a sequence and heads drawn at check time, against attention
in one process, forward and backward, counting the all-to-alls. Registered when dslab.exercises.ch11 imports it.
"""
from dslab.exercises import Mistake, exercise, on_ranks


# 11.ulysses: ulysses_attention(q, k, v): this rank's slice of the sequence, [seq / ranks, batch, heads, head_dim]
# each, in; causal attention over the WHOLE sequence out, for this rank's positions, through DeepSpeed-Ulysses'
# DistributedAttention. Checked on 2 and 3 ranks with shapes and values drawn at check time, forward and backward,
# against attention computed in one process; the collectives are counted with DeepSpeed's comms logger.
ULYSSES_TRIAL = f"{__name__}:ulysses_trial"


def draw_ulysses_case(world_size, rng=None):
    """Sizes (heads and sequence split evenly over the ranks) and a seed for one check, chosen now."""
    import random

    rng = rng or random.SystemRandom()
    return {"world_size": world_size, "seq": world_size * rng.choice((3, 5, 8)), "batch": rng.choice((1, 2)),
            "heads": world_size * rng.choice((1, 2)), "head_dim": rng.choice((4, 8)), "seed": rng.randrange(1 << 30)}


def _attention(q, k, v, causal=True):
    """Attention of [seq, batch, heads, head_dim] tensors in one process (torch's sdpa wants [batch, heads, seq, d])."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal)
    return out.permute(2, 0, 1, 3)


def ulysses_trial(ulysses_attention, case):
    """On every rank: the learner's Ulysses attention on this rank's slice; the differences from one process
    (output and q/k/v gradients), from the usual wrong attentions, and the collectives DeepSpeed logged."""
    import deepspeed
    import torch
    from deepspeed.comm import comms_logger

    from dslab.parallel import tensor_parallel

    rank, n = torch.distributed.get_rank(), case["world_size"]
    g = torch.Generator().manual_seed(case["seed"])   # the same q, k, v on every rank: the one-process reference
    shape = (case["seq"], case["batch"], case["heads"], case["head_dim"])
    q, k, v = (torch.randn(*shape, generator=g, requires_grad=True) for _ in range(3))
    _attention(q, k, v).square().sum().backward()
    mine = slice(rank * case["seq"] // n, (rank + 1) * case["seq"] // n)
    parts = [t[mine].detach().clone().requires_grad_() for t in (q, k, v)]
    deepspeed.comm.configure(enabled=True, prof_all=True, debug=False)
    comms_logger.reset_data()
    try:
        out = ulysses_attention(*parts)
        forward = tensor_parallel.collectives(comms_logger.get_raw_data())
        if not isinstance(out, torch.Tensor):
            raise Mistake(f"return the attention output, a tensor; your function returned {type(out).__name__}")
        if tuple(out.shape) != tuple(parts[0].shape):
            raise Mistake(f"the output is {tuple(out.shape)}; this rank's positions, all heads, are "
                          f"{tuple(parts[0].shape)} [seq / ranks, batch, heads, head_dim], as q came in")
        if not out.requires_grad:
            raise Mistake("the output carries no gradient back to q, k and v (a .detach() or torch.no_grad()): the "
                          "backward must run through DistributedAttention's all-to-alls too")
        comms_logger.reset_data()
        out.square().sum().backward()
        backward = tensor_parallel.collectives(comms_logger.get_raw_data())
    finally:
        deepspeed.comm.configure(enabled=False)
        comms_logger.reset_data()
    full = _attention(q, k, v)[mine].detach()
    with torch.no_grad():
        wrong = {"not causal": _attention(q, k, v, causal=False)[mine],
                 "this rank's positions only": _attention(*(t[mine] for t in (q, k, v)))}
    grads = [None if p.grad is None else (p.grad - whole.grad[mine]).abs().max().item()
             for p, whole in zip(parts, (q, k, v))]
    return {"output": (out.detach() - full).abs().max().item(), "grads": grads,
            "like": {name: (out.detach() - w).abs().max().item() for name, w in wrong.items()},
            "forward": forward, "backward": backward}


def diagnose_ulysses(case, results):
    """A Mistake naming what the learner's ulysses_attention did wrong on this case, if anything."""
    n = case["world_size"]
    what = (f"{n} ranks, a sequence of {case['seq']} positions ({case['seq'] // n} per rank), {case['heads']} heads "
            f"of {case['head_dim']}, batch {case['batch']}")
    for rank, r in enumerate(results):
        if r["output"] > 1e-5:
            if r["like"]["not causal"] < 1e-5:
                raise Mistake(f"rank {rank}'s output is attention without the causal mask ({what}): the local "
                              "attention must be causal (is_causal=True); Ulysses gives it every position, so the "
                              "mask works as in one process")
            if r["like"]["this rank's positions only"] < 1e-5:
                raise Mistake(f"rank {rank} attended over its own {case['seq'] // n} positions only ({what}): "
                              "DistributedAttention's all-to-all gives each rank the whole sequence for heads / ranks "
                              "of the heads; call it (scatter_idx=2, the heads; gather_idx=0, the sequence)")
            raise Mistake(f"rank {rank}'s output differs from attention over the whole sequence in one process by "
                          f"{r['output']:.2g} ({what}): DistributedAttention(local_attention, group, scatter_idx=2, "
                          "gather_idx=0) on [seq, batch, heads, head_dim] slices, called with batch_dim_idx=1; the "
                          "local attention permutes to sdpa's [batch, heads, seq, head_dim] and back")
    for rank, r in enumerate(results):
        if any(x is None or x > 1e-5 for x in r["grads"]):
            raise Mistake(f"rank {rank}'s q/k/v gradients differ from one process's ({what}): the backward must run "
                          "through DistributedAttention's all-to-alls (no .detach(), no torch.no_grad())")
    ops = results[0]["forward"]
    calls = {name: op["calls"] for name, op in ops.items()}
    if calls != {"all_to_all_single": 4}:
        raise Mistake(f"the forward called {calls or 'no collective through deepspeed.comm'}: Ulysses trades q, k "
                      "and v for heads with one all-to-all each and the output back with a fourth "
                      "(DistributedAttention does it)")


def _ulysses_answer(q, k, v, causal=True, permute=True, communicate=True, scatter_idx=2, gather_idx=0):
    """ulysses_attention as the solution writes it, with one of the usual mistakes switched on (the wrong answers)."""
    import torch
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(q, k, v, *args, **kwargs):
        if not permute:   # sdpa on [seq, batch, heads, head_dim] as if it were [batch, heads, seq, head_dim]
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal)
        return out.permute(2, 0, 1, 3)

    if not communicate:
        return local_attention(q, k, v)
    attention = DistributedAttention(local_attention, torch.distributed.group.WORLD, scatter_idx=scatter_idx,
                                     gather_idx=gather_idx)
    return attention(q, k, v, batch_dim_idx=1)


def _ulysses_not_causal(q, k, v):
    return _ulysses_answer(q, k, v, causal=False)


def _ulysses_own_positions(q, k, v):
    return _ulysses_answer(q, k, v, communicate=False)       # no all-to-all: each rank alone


def _ulysses_no_permute(q, k, v):
    return _ulysses_answer(q, k, v, permute=False)


def _ulysses_detached(q, k, v):
    return _ulysses_answer(q, k, v).detach()                  # no gradient back through the all-to-alls


@exercise("11.ulysses",
          wrong=((_ulysses_not_causal, "without the causal mask"),
                 (_ulysses_own_positions, "attended over its own"),
                 (_ulysses_no_permute, "permutes to sdpa's"),
                 (_ulysses_detached, "carries no gradient")),
          prepare=on_ranks.preparer(ULYSSES_TRIAL, draw_ulysses_case, diagnose=diagnose_ulysses),
          hint="complete ulysses_attention(q, k, v): a local attention that permutes [seq, batch, heads, head_dim] to "
               "sdpa's [batch, heads, seq, head_dim], runs it with is_causal=True and permutes back; wrap it in "
               "DistributedAttention(local_attention, torch.distributed.group.WORLD, scatter_idx=2, gather_idx=0) and "
               "call that with batch_dim_idx=1.")
def _check_ulysses(ulysses_attention):
    return on_ranks.check(ULYSSES_TRIAL, ulysses_attention, draw_ulysses_case, diagnose_ulysses)
