"""The ds_config settings and the step that change which collectives ZeRO runs, read from DeepSpeed 0.19.8's source.

dslab.comm.step_bytes.deepspeed_collectives asks this module two things:

  bucket_reductions(...)  how ZeRO-1/2 reduces one bucket of gradients (stage_1_and_2.py, average_tensor):
      "reduce_scatter": false            one all-reduce of the bucket (gradient_reduction_w_predivide)
      "use_multi_rank_bucket_allreduce": true (the default)
                                         one all-reduce of the bucket too (allreduce_and_scatter): every rank
                                         receives every reduced gradient and keeps only its own partition's
      "use_multi_rank_bucket_allreduce": false
                                         one reduce per rank that owns part of the bucket, to that rank only
                                         (allreduce_no_retain with rank=dst): the paper's reduce-scatter, in N pieces
  first_step_fetches(...)   what ZeRO-3 gathers in the first step after deepspeed.initialize
      (partitioned_param_coordinator.py): no module order is recorded yet, so nothing is prefetched and every
      module's parameters are released right after it runs: each module gathers its own in forward and again in
      backward. Before that, the forward's first hook (reset_step) checks that every rank recorded the same
      module order, still empty: TRACE_CHECK. From the second step on the order is known (dslab.comm.zero3_fetch).
"""
import itertools

from dslab.comm import zero3_fetch

# reset_step -> assert_ints_same_as_other_ranks(order): broadcasts the list's length (one int64) from rank 0, then
# the list itself, which in the first step is empty: (what, elements, dtype) as the comms logger records them.
TRACE_CHECK = (("the recorded module order's length (still 0)", 1, "int64"),
               ("the recorded module order (still empty)", 0, "int64"))


def partition_size(params, world_size):
    """Elements of ZeRO-1/2's flat parameter buffer each rank owns: padded to a multiple of 2N, then split in N."""
    return -(-params // (2 * world_size)) * 2


def destination_slices(bucket, numels, world_size):
    """[(rank, elements)] of one reduce bucket that each rank owns, in the order DeepSpeed meets them.

    bucket: parameter indexes in the order they entered the bucket; numels: every parameter's size, in the order
    of the flat buffer (model.parameters()). Rank r owns elements [r x P, (r+1) x P) of the flat buffer.
    """
    size = partition_size(sum(numels), world_size)
    starts = [0, *itertools.accumulate(numels)]
    owned = {}
    for i in bucket:
        begin, end = starts[i], starts[i] + numels[i]
        for rank in range(begin // size, (end - 1) // size + 1):   # the partitions this parameter overlaps
            owned[rank] = owned.get(rank, 0) + min(end, (rank + 1) * size) - max(begin, rank * size)
    return list(owned.items())


def bucket_reductions(bucket, numels, world_size, zero):
    """[(op, elements, root)] ZeRO-1/2 runs for one reduce bucket; zero: the zero_optimization section with
    DeepSpeed's defaults filled in. root is None for an all-reduce."""
    if not zero["reduce_scatter"] or zero["use_multi_rank_bucket_allreduce"]:
        return [("all_reduce", sum(numels[i] for i in bucket), None)]
    return [("reduce", elements, rank) for rank, elements in destination_slices(bucket, numels, world_size)]


def first_step_fetches(trace, keep=()):
    """ZeRO-3's parameter all-gathers in the first step: one per module, in forward and again in backward (lists of
    parameter indexes; keep: the persistent ones, never gathered)."""
    return zero3_fetch.fetch_calls(trace, prefetch_bucket_size=0, max_reuse_distance=0, keep=keep)
