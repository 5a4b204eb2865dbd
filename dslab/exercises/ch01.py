"""Chapter 01 (distributed basics): collectives, ring traffic, process groups, and average_gradients run on the live ranks.

Solutions: notebooks/solutions/01_solutions.py."""
from dslab.exercises import Mistake, exercise, expect

# ---- Chapter 01: distributed basics ------------------------------------------------------------
# 4 ranks, rank r holds torch.arange(8) + r; rank 2 after reduce_scatter(SUM) keeps chunk 2 of the sum.
expect("01.reduce_scatter", [22.0, 26.0], wrong=([4.0, 5.0], [16.0, 20.0], [6.0, 10.0]),
       hint="reduce_scatter computes the same element-wise sum as all_reduce, then cuts it into world_size "
            "equal chunks; rank r keeps chunk r (counting from 0).")
# 7e9 bf16 gradients (2 bytes each) all-reduced by a ring over 8 ranks: 2 (N-1)/N x 14 GB.
expect("01.ring_gb", 24.5, rel=1e-2, wrong=(14.0, 28.0, 12.25, 3.5),
       hint="message = parameters x 2 bytes (bf16); a ring all-reduce sends 2(N-1)/N times the message "
            "from every rank (dslab.comm.ring_allreduce_bytes). Answer in GB (1e9 bytes).")
# 8 ranks, tensor-parallel groups [0,1],[2,3],[4,5],[6,7]; data-parallel groups take one rank from each.
expect("01.dp_group", [1, 3, 5, 7], ordered=False, wrong=([2, 3], [0, 2, 4, 6], [3]),
       hint="find rank 3's position inside its tensor-parallel group, then take the rank at that position "
            "from every tensor-parallel group (rank 3 included).")


# ---- Exercise 01.average_gradients: the learner writes DDP's all-reduce, the live ranks run it ------------------

def _average_gradients_trial(average_gradients):
    """On each rank: gradients of a tiny model on this rank's share of a batch, then the learner's averaging."""
    import torch
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    torch.manual_seed(0)                                  # the same model and the same batch on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x, y = torch.randn(2 * world_size, 4), torch.randn(2 * world_size, 1)

    def gradients(rows):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        return [p.grad.clone() for p in model.parameters()]

    full = gradients(slice(None))                         # the whole batch: what the average must equal
    local = gradients(slice(2 * rank, 2 * rank + 2))      # this rank's share, left in p.grad as after backward()
    average_gradients(model)
    after = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return {"world_size": world_size, "full": full, "local": local, "after": after}


def _diagnose_average_gradients(results):
    """None if every rank holds the full-batch gradient; else the mistake, in words."""
    import torch

    n, count = results[0]["world_size"], len(results[0]["full"])

    def equal(grads, target):
        return all(g is not None and g.shape == t.shape and torch.allclose(g, t, rtol=1e-4, atol=1e-7)
                   for g, t in zip(grads, target))

    def everywhere(target_of):
        return all(equal(r["after"], target_of(r)) for r in results)

    if everywhere(lambda r: r["full"]):
        return None
    if any(g is None for r in results for g in r["after"]):
        raise Mistake("p.grad is None after your function: leave the averaged gradients in p.grad "
                      "(no zero_grad, no p.grad = None), the optimizer step reads them there.")
    total = [sum(r["local"][i] for r in results) for i in range(count)]
    if everywhere(lambda r: total):
        raise Mistake(f"the gradients are the sum over the {n} ranks, {n} times the mean: all_reduce adds "
                      "(ReduceOp.SUM). Divide by dist.get_world_size() afterwards, as DDP does.")
    if everywhere(lambda r: results[0]["local"]):
        raise Mistake("every rank now holds rank 0's gradients: that is a broadcast, which copies one rank's "
                      "values. An average needs every rank's gradient: all_reduce (sum), then divide by world size.")
    if everywhere(lambda r: r["local"]):
        raise Mistake("p.grad did not change on any rank. all_reduce changes the tensor it is given, in place, and "
                      "returns None; p.grad / n or p.grad.clone() is a new tensor the model never sees. "
                      "Call dist.all_reduce(p.grad), then p.grad /= world_size (or p.grad.div_(world_size)).")
    if everywhere(lambda r: [g / n for g in r["local"]]):
        raise Mistake("each rank divided its own gradients by world size without all-reducing them: no rank "
                      "saw another rank's gradients.")
    missed = [i for i in range(count) if not all(equal([r["after"][i]], [r["full"][i]]) for r in results)]
    if len(missed) < count:
        shapes = ", ".join(str(tuple(results[0]["full"][i].shape)) for i in missed)
        raise Mistake(f"{len(missed)} of the model's {count} parameters were not averaged (shapes {shapes}): "
                      "loop over every tensor of model.parameters(), biases included.")
    raise Mistake("the gradients are not the mean over the ranks of each rank's gradient. Sum them with "
                  "dist.all_reduce(p.grad) on every rank, then divide by dist.get_world_size().")


def _sum_only(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)


def _broadcast_from_rank0(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.broadcast(p.grad, src=0)


def _reduce_a_copy(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad / dist.get_world_size())


def _weights_only(model):
    import torch.distributed as dist

    for name, p in model.named_parameters():
        if name.endswith("weight"):
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@exercise("01.average_gradients", wrong=(_sum_only, _broadcast_from_rank0, _reduce_a_copy, _weights_only),
          hint="write a function average_gradients(model) that, on every rank after loss.backward(), makes each "
               "p.grad the mean over the ranks of that gradient (import torch.distributed inside it).")
def _check_average_gradients(average_gradients, timeout=120):
    """Run the learner's average_gradients on the live ranks (started here if none run) and name any mistake."""
    from ipyparallel import error

    from dslab import live
    if not callable(average_gradients):
        return False
    ranks = live.running() or live.start(world_size=2)
    try:
        results = ranks.apply_async(_average_gradients_trial, average_gradients).get(timeout)
    except error.TimeoutError:
        ranks.stop()    # ranks blocked in a collective that the others never call can only be stopped
        raise Mistake(f"your function did not finish within {timeout} s on every rank, so the ranks were stopped: "
                      "a collective called by only some ranks (inside `if rank == 0:`, say) waits forever. "
                      "Start the ranks again (run the chapter from the top) and call it on every rank.") from None
    except error.CompositeError as failed:
        ename, evalue = failed.elist[0][:2]
        raise Mistake(f"your function raised {ename}: {evalue}") from None
    return _diagnose_average_gradients(results) is None
