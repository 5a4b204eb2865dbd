"""Chapter 01's live-rank cells as one script a launcher starts: join the group, run the four collectives."""
import argparse
import os

import torch

from dslab import this_rank
from dslab.comm import wire

parser = argparse.ArgumentParser(description="broadcast, all_reduce, all_gather, reduce_scatter on every rank")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser.add_argument("--numel", type=int, default=4)   # values per rank; divisible by world_size, for reduce-scatter
args = parser.parse_args()
rank, world_size = this_rank.init()     # deepspeed.init_distributed(): gloo on CPU, nccl on NVIDIA GPUs

import deepspeed.comm as ds_comm   # the same calls as torch.distributed, plus DeepSpeed's comms logger
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator

assert args.numel % world_size == 0, f"numel={args.numel} must be divisible by world_size={world_size}"
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
device = get_accelerator().device_name(local_rank)   # "cpu", or "cuda:<local rank>": nccl needs GPU tensors
if device != "cpu":
    get_accelerator().set_device(local_rank)

x = torch.arange(args.numel, dtype=torch.float32, device=device) + 10 * rank   # rank r holds [10r, 10r+1, ...]
out = {"rank": rank, "input": x.tolist(), "backend": torch_dist.get_backend(), "env": wire.launcher_env()}

b = x.clone()
ds_comm.broadcast(b, src=0)                 # rank 0's tensor overwrites everyone's
out["broadcast"] = b.tolist()

s = x.clone()
ds_comm.all_reduce(s)                       # element-wise sum over ranks, result on every rank
out["all_reduce"] = s.tolist()

parts = [torch.empty_like(x) for _ in range(world_size)]
ds_comm.all_gather(parts, x)                # every rank's tensor, in rank order, on every rank
out["all_gather"] = torch.cat(parts).tolist()

chunk = torch.empty(args.numel // world_size, device=device)
ds_comm.reduce_scatter_fn(chunk, x)         # the sum, cut in world_size chunks: rank r keeps chunk r
out["reduce_scatter"] = chunk.tolist()

this_rank.print0(f"{world_size} ranks on {out['backend']}: broadcast, all_reduce, all_gather, reduce_scatter")
this_rank.save_rank_result(out)
