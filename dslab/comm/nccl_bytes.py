"""What NCCL sends per rank for one collective: the GPU case, computed from its ring algorithms (no GPU needed).

On one node NCCL runs its collectives around a ring of the GPUs; for a buffer of M bytes each rank sends:
  all_reduce              2(N-1)/N x M: a reduce-scatter round of the ring, then an all-gather round
  reduce_scatter_tensor   (N-1)/N x M, M the whole input: one round, each rank keeps its reduced 1/N
  all_gather_into_tensor  (N-1) x the shard, (N-1)/N of the gathered result
  reduce                  a chain that ends at the root: every rank but the root passes M on once
  broadcast               a chain that starts at the root: every rank but the last passes M on once
These are data bytes: NCCL's protocol flags, and the tree algorithms it picks for small messages or across nodes,
change the count a little. Compare dslab.comm.gloo_bytes, which is gloo's own algorithm, headers included, to the byte.
"""
from dslab.comm.wire import RING_FACTORS
from dslab.comm.gloo_bytes import ELEMENT_BYTES

OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "reduce", "broadcast")


def collective(op, numel, dtype, world_size, root=0):
    """Bytes each rank sends for `op` on `numel` elements of `dtype` (the message as DeepSpeed's comms logger
    records it, as in dslab.comm.gloo_bytes.collective): a list, one number per rank."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")
    n, nbytes = world_size, numel * ELEMENT_BYTES[dtype]
    if n == 1:
        return [0]
    if op == "all_reduce":
        return [RING_FACTORS["all_reduce"](n) * nbytes] * n
    if op == "reduce_scatter_tensor":
        return [RING_FACTORS["reduce_scatter"](n) * nbytes] * n
    if op == "all_gather_into_tensor":
        return [(n - 1) * nbytes] * n
    last = root if op == "reduce" else (root - 1) % n   # the one rank of the chain that sends nothing
    return [0 if rank == last else nbytes for rank in range(n)]
