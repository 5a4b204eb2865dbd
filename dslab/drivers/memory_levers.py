"""Train under several ds_configs (Adam, Muon, bf16 master weights / states) and read what each rank keeps."""
import argparse

from dslab import this_rank
from dslab.zero import optimizer_states

parser = argparse.ArgumentParser(description="train under several ds_configs; read what each rank keeps")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
# A JSON file of [{"name": ..., "ds_config": {...}}, ...], run one after another on the same ranks (chapter 13)
parser.add_argument("--setups", required=True)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--seq_len", type=int, default=32)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
result = optimizer_states.run_setups(args.setups, steps=args.steps, seq_len=args.seq_len, seed=args.seed)
for name, run in result["runs"].items():
    this_rank.print0(f"{name}: {run['inner_optimizer']}, optimizer states of rank 0: "
                     f"{optimizer_states.state_bytes(run['census']):,} bytes")
this_rank.save_rank_result(result)
