"""The collectives behind data parallelism on real ranks, a sub-group, and what one all-reduce moves."""
import torch

from dslab import comm, dist

# numel: values per rank (divisible by world_size, for reduce-scatter); groups: sub-groups as lists
# of ranks (default: each rank alone); allreduce_mb: size of the all-reduce whose traffic we count.
args = dist.recipe_args(numel=4, groups=None, allreduce_mb=4)
rank, world_size = dist.init()

import deepspeed.comm as ds_comm   # same calls as torch.distributed, plus DeepSpeed's comms logger
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator

assert args.numel % world_size == 0, f"numel={args.numel} must be divisible by world_size={world_size}"


def mine():
    """Rank r holds [10r, 10r+1, ...]: small numbers, so every result can be checked by hand."""
    return torch.arange(args.numel, dtype=torch.float32) + 10 * rank


out = {"rank": rank, "input": mine().tolist(), "backend": torch_dist.get_backend(),
       "accelerator_backend": get_accelerator().communication_backend_name(), "env": comm.launcher_env()}

x = mine()
ds_comm.broadcast(x, src=0)                 # rank 0's tensor overwrites everyone's
out["broadcast"] = x.tolist()

x = mine()
ds_comm.all_reduce(x)                       # element-wise sum over ranks, result on every rank
out["all_reduce"] = x.tolist()

parts = [torch.empty(args.numel) for _ in range(world_size)]
ds_comm.all_gather(parts, mine())           # every rank's tensor, in rank order, on every rank
out["all_gather"] = torch.cat(parts).tolist()

chunk = torch.empty(args.numel // world_size)
ds_comm.reduce_scatter_fn(chunk, mine())    # the sum, cut in world_size chunks: rank r keeps chunk r
out["reduce_scatter"] = chunk.tolist()

# Sub-groups: EVERY rank calls new_group for EVERY group (a collective call), even groups it is not in.
groups = args.groups or [[r] for r in range(world_size)]
handles = [ds_comm.new_group(g) for g in groups]
my_group = next(h for g, h in zip(groups, handles) if rank in g)
x = mine()
ds_comm.all_reduce(x, group=my_group)       # sums over the members of my group only
out["group"] = next(g for g in groups if rank in g)
out["group_rank"] = ds_comm.get_rank(group=my_group)
out["all_reduce_in_group"] = x.tolist()

# Traffic of one all-reduce: DeepSpeed's comms logger (the "comms_logger" config section) records
# message size and time; /proc/self/io counts the bytes this process wrote to its sockets.
big = torch.ones(args.allreduce_mb * 2**20 // 4)   # fp32: 4 bytes per value
ds_comm.configure(enabled=True, prof_all=True, verbose=False)
ds_comm.barrier()
before = comm.bytes_written()
ds_comm.all_reduce(big)
sent = comm.bytes_written() - before
size, (count, latencies, algbw, busbw) = next(iter(ds_comm.comms_logger.comms_dict["all_reduce"].items()))
out["traffic"] = {"message_bytes": big.numel() * 4, "logged_bytes": size, "bytes_written": sent,
                  "ms": latencies[0], "algbw_gbps": algbw[0], "busbw_gbps": busbw[0]}

dist.print0(f"{world_size} ranks on {out['backend']}: broadcast, all_reduce, all_gather, reduce_scatter, "
            f"sub-groups {groups}, one {args.allreduce_mb} MiB all_reduce")
dist.save_result(out)
