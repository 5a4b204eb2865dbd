"""Every rank runs a learner's exercise code and the checker's trial on it (dslab.exercises.on_ranks)."""
import argparse

from dslab import this_rank
from dslab.exercises import on_ranks

parser = argparse.ArgumentParser(description="run a learner's exercise code and its checker's trial")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser.add_argument("--spec", required=True)  # a JSON file: the trial, the case, the learner's answers
args = parser.parse_args()
this_rank.save_rank_result(on_ranks.serve(args.spec))
