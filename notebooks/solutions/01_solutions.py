"""Instructor solutions for notebooks/01_distributed_basics.ipynb (checked by tests/test_exercises.py)."""
import torch

from dslab.comm import wire

# 01.reduce_scatter: 4 ranks, rank r holds arange(8) + r. The sum is 4*arange(8) + 6; rank 2 keeps chunk 2.
world_size = 4
total = sum(torch.arange(8.0) + r for r in range(world_size))
reduce_scatter_rank2 = total.chunk(world_size)[2]

# 01.ring_gb: 7e9 bf16 gradients (2 bytes each) on 8 ranks.
ring_gb = wire.ring_allreduce_bytes(7e9 * 2, 8) / 1e9

# 01.dp_group: TP groups of 2 consecutive ranks; a DP group takes the same position from each TP group.
tp, ranks = 2, range(8)
dp_group_of_3 = [r for r in ranks if r % tp == 3 % tp]



# 01.average_gradients: what DDP does after backward, written by hand; the checker runs it on ranks it launches.
def average_gradients(model):
    """Make every p.grad the mean over the ranks of that gradient (call on every rank after loss.backward())."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)      # the sum over the ranks, written into p.grad itself
            p.grad /= world_size         # ... divided: the mean, the full-batch gradient


SOLUTIONS = {
    "01.average_gradients": average_gradients,
    "01.reduce_scatter": reduce_scatter_rank2.tolist(),
    "01.ring_gb": ring_gb,
    "01.dp_group": dp_group_of_3,
}
