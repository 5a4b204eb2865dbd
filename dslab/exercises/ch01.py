"""Chapter 01 (distributed basics): collectives, ring traffic, process groups, and average_gradients run on 2 and 3
launched ranks.

Solutions: notebooks/solutions/01_solutions.py."""
from dslab.exercises import Mistake, exercise, expect, on_ranks

# ---- Chapter 01: distributed basics ------------------------------------------------------------
# 4 ranks, rank r holds torch.arange(8) + r; rank 2 after reduce_scatter(SUM) keeps chunk 2 of the sum.
expect("01.reduce_scatter", [22.0, 26.0],
       wrong=(([4.0, 5.0], "that is chunk 2 of rank 0's tensor alone: reduce_scatter first sums the 4 ranks' tensors "
                           "element by element, then rank 2 keeps chunk 2 of the sum"),
              ([6.0, 7.0], "that is chunk 2 of rank 2's own tensor: reduce_scatter first sums the 4 ranks' tensors, "
                           "then rank 2 keeps chunk 2 of the sum"),
              ([16.0, 20.0], "that sums arange(8) four times and leaves out each rank's + r: the sum is "
                             "4 x arange(8) + (0 + 1 + 2 + 3)"),
              ([6.0, 10.0], "that is chunk 0 of the sum, rank 0's: rank 2 keeps chunk 2 (counting from 0)"),
              ([14.0, 18.0], "that is the sum's second chunk: chunks are counted from 0, so rank 2 keeps the third"),
              ([6.0, 10.0, 14.0, 18.0, 22.0, 26.0, 30.0, 34.0],
               "that is the whole sum, what all_reduce leaves on every rank: reduce_scatter leaves each rank one "
               "chunk of it, 1/world_size")),
       hint="reduce_scatter computes the same element-wise sum as all_reduce, then cuts it into world_size "
            "equal chunks; rank r keeps chunk r (counting from 0).")
# 7e9 bf16 gradients (2 bytes each) all-reduced by a ring over 8 ranks: 2 (N-1)/N x 14 GB.
expect("01.ring_gb", 24.5, rel=1e-2,
       wrong=((14.0, "14 GB is the message itself (7e9 x 2 bytes): a ring all-reduce sends 2(N-1)/N times the "
                     "message from every rank"),
              (28.0, "28 GB is twice the message: each half of the ring (reduce-scatter, then all-gather) sends "
                     "(N-1)/N of it, not all of it, so 2(N-1)/N in all"),
              (12.25, "12.25 GB is (N-1)/N of the message: one half of the ring, a reduce-scatter or an all-gather; "
                      "an all-reduce is both halves"),
              (3.5, "3.5 GB is 2/N of the message: in each half every rank sends N-1 chunks of 1/N, so 2(N-1)/N of "
                    "the message in all"),
              (49.0, "49 GB counts 4 bytes per gradient (fp32): these gradients are bf16, 2 bytes each"),
              (196.0, "196 GB is what all 8 ranks send together: the question asks what each rank sends"),
              (24.5e9, "that is bytes: answer in GB (1e9 bytes)")),
       hint="message = parameters x 2 bytes (bf16); a ring all-reduce sends 2(N-1)/N times the message "
            "from every rank (dslab.comm.wire.ring_allreduce_bytes). Answer in GB (1e9 bytes).")
# 8 ranks, tensor-parallel groups [0,1],[2,3],[4,5],[6,7]; data-parallel groups take one rank from each.
expect("01.dp_group", [1, 3, 5, 7], ordered=False,
       wrong=(([2, 3], "[2, 3] is rank 3's tensor-parallel group; its data-parallel group takes one rank from every "
                       "tensor-parallel group"),
              ([0, 2, 4, 6], "those are the ranks at position 0 of each tensor-parallel group; rank 3 is at position "
                             "1 of [2, 3]"),
              ([3], "a data-parallel group has one rank from each of the 4 tensor-parallel groups, rank 3 included: "
                    "4 ranks"),
              ([1, 5, 7], "rank 3 belongs to its own data-parallel group: list all 4 ranks")),
       hint="find rank 3's position inside its tensor-parallel group, then take the rank at that position "
            "from every tensor-parallel group (rank 3 included).")


# ---- Exercise 01.average_gradients: the learner writes DDP's all-reduce; launched ranks (2, then 3) run it -------

TRIAL = "dslab.exercises.ch01:average_gradients_trial"


def draw_case(world_size, rng=None):
    """Sizes and a seed for one check, chosen now: a model and a batch the learner has not seen."""
    import random

    rng = rng or random.SystemRandom()
    return {"world_size": world_size, "seed": rng.randrange(1 << 30), "d_in": rng.randint(3, 6),
            "hidden": rng.randint(2, 5), "d_out": rng.randint(1, 3), "rows": rng.randint(1, 3)}


def average_gradients_trial(average_gradients, case):
    """On each rank: gradients of a small model on this rank's share of a batch, then the learner's averaging."""
    import torch
    import torch.distributed as torch_dist

    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    torch.manual_seed(case["seed"])                      # the same model and the same batch on every rank
    model = torch.nn.Sequential(torch.nn.Linear(case["d_in"], case["hidden"]), torch.nn.Tanh(),
                                torch.nn.Linear(case["hidden"], case["d_out"]))
    rows = case["rows"]
    x, y = torch.randn(rows * world_size, case["d_in"]), torch.randn(rows * world_size, case["d_out"])

    def gradients(part):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
        return [p.grad.tolist() for p in model.parameters()]

    full = gradients(slice(None))                         # the whole batch: what the average must equal
    local = gradients(slice(rows * rank, rows * rank + rows))  # this rank's share, left in p.grad as after backward()
    average_gradients(model)
    after = [None if p.grad is None else p.grad.tolist() for p in model.parameters()]
    return {"world_size": world_size, "full": full, "local": local, "after": after}


def diagnose_average_gradients(case, results):
    """Nothing if every rank holds the full-batch gradient; else a Mistake naming what happened."""
    import torch

    n = results[0]["world_size"]
    tensors = [{key: [None if g is None else torch.tensor(g) for g in r[key]] for key in ("full", "local", "after")}
               for r in results]
    count = len(tensors[0]["full"])

    def equal(grads, target):
        return all(g is not None and g.shape == t.shape and torch.allclose(g, t, rtol=1e-4, atol=1e-7)
                   for g, t in zip(grads, target))

    def everywhere(target_of):
        return all(equal(r["after"], target_of(r)) for r in tensors)

    if everywhere(lambda r: r["full"]):
        return
    if any(g is None for r in tensors for g in r["after"]):
        raise Mistake("p.grad is None after your function: leave the averaged gradients in p.grad "
                      "(no zero_grad, no p.grad = None), the optimizer step reads them there.")
    total = [sum(r["local"][i] for r in tensors) for i in range(count)]
    if everywhere(lambda r: total):
        raise Mistake(f"the gradients are the sum over the {n} ranks, {n} times the mean: all_reduce adds "
                      "(ReduceOp.SUM). Divide by dist.get_world_size() afterwards, as DDP does.")
    for wrong_n in range(1, 9):
        if wrong_n != n and everywhere(lambda r: [t / wrong_n for t in total]):
            raise Mistake(f"you divided the sum by {wrong_n}, but the check ran on {n} ranks: divide by "
                          "dist.get_world_size(), which is what the job has, not a number you chose.")
    if everywhere(lambda r: tensors[0]["local"]):
        raise Mistake("every rank now holds rank 0's gradients: that is a broadcast, which copies one rank's "
                      "values. An average needs every rank's gradient: all_reduce (sum), then divide by world size.")
    if everywhere(lambda r: r["local"]):
        raise Mistake("p.grad did not change on any rank. all_reduce changes the tensor it is given, in place, and "
                      "returns None; p.grad / n or p.grad.clone() is a new tensor the model never sees. "
                      "Call dist.all_reduce(p.grad), then p.grad /= world_size (or p.grad.div_(world_size)).")
    if everywhere(lambda r: [g / n for g in r["local"]]):
        raise Mistake("each rank divided its own gradients by world size without all-reducing them: no rank "
                      "saw another rank's gradients.")
    holding = [rank for rank, r in enumerate(tensors) if equal(r["after"], r["full"])]
    if holding:
        others = [rank for rank in range(len(tensors)) if rank not in holding]

        def ranks(which):
            return ("rank " if len(which) == 1 else "ranks ") + ", ".join(map(str, which))

        raise Mistake(f"on {n} ranks only {ranks(holding)} ended with the mean gradients, not {ranks(others)}: every "
                      "rank steps its own optimizer with its own p.grad, so every rank needs the mean. dist.reduce "
                      "leaves the sum on its dst rank only; call dist.all_reduce(p.grad) on every rank, then divide "
                      "by dist.get_world_size().")
    missed = [i for i in range(count) if not all(equal([r["after"][i]], [r["full"][i]]) for r in tensors)]
    if len(missed) < count:
        shapes = ", ".join(str(tuple(tensors[0]["full"][i].shape)) for i in missed)
        raise Mistake(f"{len(missed)} of the model's {count} parameters were not averaged (shapes {shapes}): "
                      "loop over every tensor of model.parameters(), biases included.")
    raise Mistake(f"on {n} ranks the gradients are not the mean over the ranks of each rank's gradient. Sum them "
                  "with dist.all_reduce(p.grad) on every rank, then divide by dist.get_world_size().")


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


def _divide_by_two(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2                  # the chapter's world size, hard-coded


@exercise("01.average_gradients",
          wrong=((_sum_only, "the sum over the"), (_broadcast_from_rank0, "broadcast"),
                 (_reduce_a_copy, "in place"), (_weights_only, "were not averaged"),
                 (_divide_by_two, "you divided the sum by 2, but the check ran on 3 ranks")),
          prepare=on_ranks.preparer(TRIAL, draw_case, diagnose=diagnose_average_gradients),
          hint="write a function average_gradients(model) that, on every rank after loss.backward(), makes each "
               "p.grad the mean over the ranks of that gradient (import torch.distributed inside it).")
def _check_average_gradients(average_gradients):
    """Run the learner's average_gradients on 2, then 3 launched ranks, on a model and batch drawn now."""
    if not callable(average_gradients):
        raise Mistake("answer with the function itself: answer = average_gradients")
    return on_ranks.check(TRIAL, average_gradients, draw_case, diagnose_average_gradients)
