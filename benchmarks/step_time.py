"""Step time of a plain PyTorch DDP loop and of DeepSpeed ZeRO 0-3 (and offload) on the same model and batches.

Run on every rank by benchmarks/course_bench.py through dslab.launch.run. Each pair that is compared directly
(plain PyTorch vs ZeRO-0) lives in memory at the same time and is timed in alternating rounds, so a change in
the machine's load hits both sides alike. A step is forward + backward + gradient clipping + AdamW update.
"""
import argparse
import copy
import gc
import json
import statistics
import time

import torch

from dslab import this_rank
from dslab.config.build import make_config
from dslab.models.loading import build_model, count_parameters, tiny_config

parser = argparse.ArgumentParser(description="step time of plain PyTorch DDP and of DeepSpeed ZeRO 0-3")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser.add_argument("--micro_batch_size", type=int, default=4)
parser.add_argument("--seq_len", type=int, default=64)
parser.add_argument("--rounds", type=int, default=4)
parser.add_argument("--steps_per_round", type=int, default=3)
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--stages", type=json.loads, default=[  # a JSON list of ZeRO setups, each timed beside ZeRO-0
    {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3}, {"zero_stage": 2, "offload_optimizer": True},
    {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}])
args = parser.parse_args()
rank, world_size = this_rank.init()

import deepspeed
from torch.nn.parallel import DistributedDataParallel as DDP

this_rank.quiet()
config = tiny_config()  # the course model's shape (dslab-tiny), random weights: timing does not need training
base = build_model(config, seed=args.seed)
g = torch.Generator().manual_seed(args.seed + rank)  # each rank its own micro-batches, the same for every trainer
batches = [torch.randint(3, config.vocab_size, (args.micro_batch_size, args.seq_len), generator=g) for _ in range(4)]


def ds_config(precision, **zero):
    return make_config(precision=precision, micro_batch_size=args.micro_batch_size, world_size=world_size, **zero)


def plain(precision):
    """torch DDP + torch.optim.AdamW with DeepSpeed's hyper-parameters and clipping; bf16 through autocast."""
    cfg = ds_config("fp32")
    adamw = {k: v for k, v in cfg["optimizer"]["params"].items() if k != "torch_adam"}
    model = DDP(copy.deepcopy(base))
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    clip = cfg["gradient_clipping"]

    def step(tokens):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return step, (model, opt)


def engine_for(precision, **zero):
    """A DeepSpeed engine built from make_config (the course's configs), and its step function."""
    model = copy.deepcopy(base)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(precision, **zero))

    def step(tokens):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    return step, (engine,)


def timed(step, n, offset=0):
    """Seconds of each of n steps (all ranks start each step together)."""
    out = []
    for i in range(n):
        torch.distributed.barrier()
        start = time.perf_counter()
        step(batches[(offset + i) % len(batches)])
        out.append(time.perf_counter() - start)
    return out


def compare(trainers):
    """{name: [seconds per step]}, the trainers timed in alternating rounds after a warm-up each."""
    times = {name: [] for name in trainers}
    for name, step in trainers.items():
        timed(step, args.warmup)
    for r in range(args.rounds):
        for name, step in trainers.items():
            times[name] += timed(step, args.steps_per_round, r * args.steps_per_round)
    return times


results = {}
for precision in ("fp32", "bf16"):  # plain PyTorch and ZeRO-0 side by side
    plain_step, keep_plain = plain(precision)
    ds_step, keep_ds = engine_for(precision, zero_stage=0)
    results.update({f"{k} {precision}": v for k, v in
                    compare({"plain": plain_step, "ZeRO-0": ds_step}).items()})
    del plain_step, keep_plain
    gc.collect()
# bf16, the course's precision: each stage interleaved with the ZeRO-0 engine still in memory, so the ratio
# compares steps taken under the same load
for setup in args.stages:
    name = f"ZeRO-{setup['zero_stage']}" + (" + offload optimizer" if setup.get("offload_optimizer") else "") \
        + (" + offload params" if setup.get("offload_param") else "")
    step, keep = engine_for("bf16", **setup)
    times = compare({"ZeRO-0": ds_step, name: step})
    results[f"{name} bf16"], results[f"ZeRO-0 beside {name} bf16"] = times[name], times["ZeRO-0"]
    del step, keep
    gc.collect()

median = {k: statistics.median(v) for k, v in results.items()}
this_rank.print0("  ".join(f"{k}: {v * 1000:.0f} ms" for k, v in median.items()))
this_rank.save_rank_result({"rank": rank, "world_size": world_size, "params": count_parameters(base),
                            "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
                            "threads": torch.get_num_threads(), "seconds": results, "median": median})
