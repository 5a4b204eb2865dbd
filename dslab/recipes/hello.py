"""Your first multi-rank job: every rank says who it is, and one all-reduce proves the ranks can talk."""
import argparse
import socket

import torch

from dslab import this_rank
from dslab.comm import wire

parser = argparse.ArgumentParser(description="every rank says who it is; one all-reduce")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
args = parser.parse_args()              # this recipe takes no other argument
rank, world_size = this_rank.init()     # join the process group the launcher prepared (gloo on CPU, nccl on GPU)

import deepspeed.comm as ds_comm   # DeepSpeed's wrapper over torch.distributed: the same calls
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator

# Every rank contributes rank + 1. After all_reduce (SUM by default) every rank holds
# 1 + 2 + ... + world_size: the ranks exchanged data, not just started side by side.
x = torch.tensor([rank + 1.0])
ds_comm.all_reduce(x)
this_rank.print0(f"hello from {world_size} ranks: all_reduce(rank + 1) = {x.item():g}")

this_rank.save_rank_result({
    "rank": rank,
    "world_size": world_size,
    "all_reduce_sum": x.item(),
    "accelerator": get_accelerator().device_name(),   # what DeepSpeed picked: "cpu" or "cuda"
    "backend": torch_dist.get_backend(),              # the communication library: gloo, nccl, ...
    "host": socket.gethostname(),
    "env": wire.launcher_env(),                       # RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...
})
