"""One rank trains one optimizer step under a learner's DeepSpeed config and reports what it held (runner.try_config)."""
from dslab import dist
from dslab.zero import runner

args = dist.recipe_args(ds_config={})
dist.save_result(runner.try_step(args.ds_config))
