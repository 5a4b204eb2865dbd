"""Train the same model under several ZeRO setups; measure each rank's bytes, losses, step time and traffic."""
import argparse
import json

from dslab import this_rank
from dslab.zero import memory, runner

parser = argparse.ArgumentParser(description="the same model under several ZeRO setups, measured")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
# A JSON list of {"zero_stage": S, "offload_optimizer": bool, "offload_param": bool}, run one after another; a setup
# may also set "grad_accum_steps", "comms" (log collectives in the last step) and "config" (merged into the
# DeepSpeed config by make_config). The same function runs on live ranks in chapter 04.
parser.add_argument("--setups", type=json.loads, default=[{"zero_stage": 2}])
parser.add_argument("--model", default=None)  # a local checkpoint (default: a random model of --shape)
parser.add_argument("--shape", type=json.loads, default={})  # tiny_config overrides, a JSON object
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--grad_accum_steps", type=int, default=2)
parser.add_argument("--micro_batch_size", type=int, default=2)
parser.add_argument("--seq_len", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--comms", action="store_true")  # log every setup's collectives in its last step
args = parser.parse_args()
result = runner.run_setups(args.setups, shape=args.shape, model=args.model, steps=args.steps,
                           grad_accum_steps=args.grad_accum_steps, micro_batch_size=args.micro_batch_size,
                           seq_len=args.seq_len, lr=args.lr, seed=args.seed, comms=args.comms)
for out in result["runs"]:
    if out["memory"]:
        setup = runner.describe_setup(out["zero_stage"], out["offload_optimizer"], out["offload_param"])
        this_rank.print0(f"{setup}: rank 0 holds {memory.human(out['memory']['total'])} of model states")
this_rank.save_rank_result(result)
