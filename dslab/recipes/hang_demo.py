"""Two real hangs to catch with `dslab launch --hang-timeout S`: a collective that one rank skips, and ZeRO-3 ranks
that generate different numbers of tokens without synced_gpus.

    dslab launch --world-size 2 --hang-timeout 20 hang_demo --case skip_allreduce
    dslab launch --world-size 2 --hang-timeout 20 hang_demo --case zero3_generate
    dslab launch --world-size 2 hang_demo --case zero3_generate --synced_gpus    # the fix: it finishes
"""
import argparse

import deepspeed
import deepspeed.comm as ds_comm
import torch

from dslab import this_rank
from dslab.models import loading

parser = argparse.ArgumentParser(description="two real hangs, to catch with dslab launch --hang-timeout S")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser.add_argument("--case", choices=["skip_allreduce", "zero3_generate"], default="skip_allreduce")
parser.add_argument("--synced_gpus", action="store_true")  # zero3_generate's fix
parser.add_argument("--model", default=None)  # zero3_generate's model (default: dslab-tiny)
args = parser.parse_args()
rank, world_size = this_rank.init()   # deepspeed.init_distributed(): gloo on CPU

if args.case == "skip_allreduce":
    x = torch.ones(4)
    ds_comm.all_reduce(x)                     # every rank: x becomes [2, 2, 2, 2] on 2 ranks
    print(f"rank {rank}: first all_reduce done, x = {x.tolist()}", flush=True)
    if rank == 0:
        ds_comm.all_reduce(x)                 # rank 1 skips this one: rank 0 waits for a partner that never comes
    ds_comm.barrier()                         # rank 1 waits here; gloo never pairs it with rank 0's all_reduce

if args.case == "zero3_generate":
    ds_config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=loading.load_model(args.model), config=ds_config)
    tokenizer = loading.load_tokenizer(args.model)
    prompt = tokenizer("The weather today", return_tensors="pt")
    # Under ZeRO-3 each rank holds 1/world_size of every weight: every forward pass all-gathers each layer's
    # weights from all ranks, so all ranks must run the same number of passes. Rank 0 asks for 4 new tokens and
    # rank 1 for 16: after 4 passes rank 0 leaves generate and rank 1's 5th pass waits for rank 0's shards.
    # synced_gpus=True keeps a finished rank running dummy passes until every rank is done.
    new_tokens = 4 if rank == 0 else 16
    out = engine.module.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 synced_gpus=args.synced_gpus)
    print(f"rank {rank}: generated {out.shape[1] - prompt['input_ids'].shape[1]} tokens", flush=True)
    ds_comm.barrier()                         # rank 0 waits here; rank 1 is still inside generate

this_rank.print0(f"{args.case}: every rank finished")
