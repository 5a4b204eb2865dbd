"""One rank trains one optimizer step under a learner's DeepSpeed config and reports what it held
(dslab.zero.runner.try_config writes the config to a file and launches this)."""
import argparse
import json

import deepspeed

from dslab import this_rank
from dslab.zero import runner

parser = argparse.ArgumentParser(description="one optimizer step under a DeepSpeed config")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser = deepspeed.add_config_arguments(parser)  # --deepspeed_config FILE: the config to try
args = parser.parse_args()
with open(args.deepspeed_config) as f:
    this_rank.save_rank_result(runner.try_step(json.load(f)))
