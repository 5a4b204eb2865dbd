"""Train the same model under several ZeRO setups; measure each rank's bytes, losses, step time and traffic."""
from dslab import this_rank
from dslab.zero import memory, runner

# setups: a list of {"zero_stage": S, "offload_optimizer": bool, "offload_param": bool}, run one after another;
# a setup may also set "grad_accum_steps", "comms" (log collectives in the last step) and "config" (merged
# into the DeepSpeed config by make_config). The same function runs on live ranks in chapter 04.
args = this_rank.recipe_args(setups=[{"zero_stage": 2}], model=None, shape={}, steps=3, grad_accum_steps=2,
                        micro_batch_size=2, seq_len=32, lr=1e-3, seed=0, comms=False)
result = runner.run_setups(**vars(args))
for setup, out in zip(args.setups, result["runs"]):
    if out["memory"]:
        this_rank.print0(f"{runner.describe_setup(out['zero_stage'], out['offload_optimizer'], out['offload_param'])}: "
                    f"rank 0 holds {memory.human(out['memory']['total'])} of model states")
this_rank.save_result(result)
