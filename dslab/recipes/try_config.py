"""One rank trains one optimizer step under a learner's DeepSpeed config and reports what it held (runner.try_config)."""
from dslab import this_rank
from dslab.zero import runner

args = this_rank.recipe_args(ds_config={})
this_rank.save_result(runner.try_step(args.ds_config))
