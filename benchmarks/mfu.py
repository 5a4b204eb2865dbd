"""Training MFU of the kit's step on 2 ranks: dslab-tiny, ZeRO-2, bf16 and fp32, each rank on its share of the cores.

Run on every rank by benchmarks/course_bench.py through dslab.launch.run. Rank 0's flops profiler counts one step's
forward FLOPs, checked against dslab.flops.forward_flops; then each engine's steps are timed in alternating rounds, each
step followed by the matmul ceiling measured on the same threads (both ranks at once, as they train), so that load
which comes and goes hits steps and ceiling alike. A step is forward + backward + gradient all-reduce + AdamW.
"""
import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import torch

from dslab import this_rank
from dslab import flops
from dslab.config.build import make_config
from dslab.models.loading import load_model

parser = argparse.ArgumentParser(description="training MFU of the kit's step on every rank")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser.add_argument("--micro_batch_size", type=int, default=4)
parser.add_argument("--seq_len", type=int, default=128)
parser.add_argument("--rounds", type=int, default=4)
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
rank, world_size = this_rank.init()

import deepspeed

this_rank.quiet()
profile_file = Path(tempfile.mkdtemp(prefix="dslab-mfu-")) / "flops_profile.txt"
g = torch.Generator().manual_seed(args.seed + rank)  # each rank its own micro-batch


def engine_for(precision, profile=False):
    """An engine on the kit's model under the course's config; with profile, rank 0 profiles the last warm-up step."""
    extra = {}
    if profile:
        extra = {"flops_profiler": {"enabled": True, "profile_step": args.warmup - 1, "detailed": False,
                                    "output_file": str(profile_file)}}
    model = load_model()
    model.train()
    cfg = make_config(zero_stage=2, precision=precision, micro_batch_size=args.micro_batch_size,
                      world_size=world_size, **extra)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def step(engine, tokens):
    torch.distributed.barrier()  # every rank starts the step together
    start = time.perf_counter()
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


engines = {"bf16": engine_for("bf16", profile=True), "fp32": engine_for("fp32")}
config = engines["bf16"].module.config
tokens = torch.randint(3, config.vocab_size, (args.micro_batch_size, args.seq_len), generator=g)
threads = torch.get_num_threads()
with contextlib.redirect_stdout(io.StringIO()):  # the profiler's report goes to its file; nothing else prints
    for engine in engines.values():
        for _ in range(args.warmup):
            step(engine, tokens)
counted = engines["bf16"].flops_profiler.flops if rank == 0 else None
forward = flops.forward_flops(config, args.micro_batch_size, args.seq_len)["total"]
seconds = {name: [] for name in engines}
ceilings = {name: [] for name in engines}
for _ in range(args.rounds):
    for name, engine in engines.items():
        seconds[name].append(step(engine, tokens))
        ceilings[name].append(flops.ceiling(name, threads))
result = {"rank": rank, "world_size": world_size, "threads": threads, "micro_batch_size": args.micro_batch_size,
          "seq_len": args.seq_len, "forward_flops": forward, "profiler_flops": counted, "seconds": seconds,
          "ceilings": ceilings, "runs": {}}
for name in engines:
    fastest, best = min(seconds[name]), max(ceilings[name])
    achieved = flops.TRAIN_FACTOR * forward / fastest / 1e9
    result["runs"][name] = {"step_seconds": fastest, "achieved_gflops": achieved, "ceiling_gflops": best,
                            "mfu": achieved / best}
this_rank.print0("  ".join(f"{k}: MFU {v['mfu']:.1%} ({v['achieved_gflops']:.0f} of {v['ceiling_gflops']:.0f} GFLOP/s)"
                       for k, v in result["runs"].items()))
this_rank.save_rank_result(result)
