"""Gradient accumulation in DeepSpeed: micro x accumulation x ranks sequences make one step, equal to one big batch."""
import argparse

from dslab import this_rank
from dslab.training.accumulation import (batch_triples, hf_auto_batch, reference_step, small_lm, token_batch, window_runs,
                                window_setups)

parser = argparse.ArgumentParser(description="DeepSpeed's accumulated step vs one big batch")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser.add_argument("--micro_batch_size", type=int, default=2)
parser.add_argument("--grad_accum_steps", type=int, default=4)
parser.add_argument("--seq_len", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
rank, world_size = this_rank.init()

micro, gas = args.micro_batch_size, args.grad_accum_steps
base = small_lm(seed=args.seed)                                   # same seed on every rank: same weights
global_batch = token_batch(micro * gas * world_size, args.seq_len, base.config.vocab_size, seed=args.seed)
per_rank = micro * gas
mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in global_batch.items()}   # this rank's share

# Each setup: one DeepSpeed optimizer step over this rank's share, compared with one process taking the
# whole global batch (dslab.training.accumulation.engine_window shows the loop: engine(...), backward, step).
runs = window_runs(base, mine, global_batch, window_setups(micro, gas), lr=args.lr)
_, reference_grad_norm = reference_step(base, global_batch, args.lr)

# DeepSpeed derives whichever batch number is missing (and refuses a wrong product); transformers'
# Trainer fills "auto" values from its own arguments. Both read the world size of this 2-rank job.
triples = batch_triples(total=micro * gas * world_size, micro_batch_size=micro, grad_accum_steps=gas)
hf_filled = hf_auto_batch(micro_batch_size=micro, grad_accum_steps=gas)

for name, run in runs.items():
    this_rank.print0(f"{name:21s} ZeRO-{run['zero_stage']} micro {run['micro_batch_size']} x accum "
                     f"{run['grad_accum_steps']} x world {world_size} = {run['train_batch_size']}: "
                     f"step / reference step = {run['step_ratio']:.3f}")
this_rank.save_rank_result({"rank": rank, "runs": runs, "reference_grad_norm": reference_grad_norm,
                            "triples": triples, "hf_filled": hf_filled})
