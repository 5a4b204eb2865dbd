"""One rank trains one optimizer step under a learner's DeepSpeed config and reports what it held (zero.try_config)."""
from dslab import dist, zero

args = dist.recipe_args(ds_config={})
dist.save_result(zero.try_step(args.ds_config))
