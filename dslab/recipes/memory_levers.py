"""Train under several ds_configs (Adam, Muon, bf16 master weights / states) and read what each rank keeps."""
from dslab import this_rank
from dslab.zero import optimizer_states

# setups: [{"name": ..., "ds_config": {...}}, ...], run one after another on the same ranks (chapter 13)
args = this_rank.recipe_args(setups=[], steps=2, seq_len=32, seed=0)
result = optimizer_states.run_setups(args.setups, steps=args.steps, seq_len=args.seq_len, seed=args.seed)
for name, run in result["runs"].items():
    this_rank.print0(f"{name}: {run['inner_optimizer']}, optimizer states of rank 0: "
                f"{optimizer_states.state_bytes(run['census']):,} bytes")
this_rank.save_result(result)
