"""How ZeRO-1/2 splits the flat parameter buffer among the ranks and reduces each bucket of gradients, read from
DeepSpeed 0.19.8's source.

partition_size(...)       the elements of the flat buffer each rank owns (padded to a multiple of 2N, split in N)
destination_slices(...)   the elements of one reduce bucket that each rank owns, in the order DeepSpeed meets them
bucket_reductions(...)    how ZeRO-1/2 reduces one bucket (stage_1_and_2.py, average_tensor), as the ds_config says:
      "reduce_scatter": false            one all-reduce of the bucket (gradient_reduction_w_predivide)
      "use_multi_rank_bucket_allreduce": true (the default)
                                         one all-reduce of the bucket too (allreduce_and_scatter): every rank
                                         receives every reduced gradient and keeps only its own partition's
      "use_multi_rank_bucket_allreduce": false
                                         one reduce per rank that owns part of the bucket, to that rank only
                                         (allreduce_no_retain with rank=dst): the paper's reduce-scatter, in N pieces
dslab.comm.step_bytes.deepspeed_collectives turns these into the collectives of one step.
"""
import itertools


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
