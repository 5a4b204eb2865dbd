"""What starting ranks costs, and what sharing them saves: the benchmark behind the test suite's shared live ranks.

    .venv/bin/python benchmarks/rank_startup.py [--repeats 3] [--world-size 2]

Prints, each the median of --repeats runs on this machine:
- the import time of each module a rank imports, each in a fresh interpreter (torch, deepspeed, transformers, ...);
- one `launch.run("hello")`: the deepspeed launcher, N ranks that import torch and DeepSpeed and join a process
  group, their results collected;
- starting N live ranks (`live.start`), then one call on them (`ranks.apply`) once they run;
and the ratios that matter: a launch / a call on running ranks, and a launch / the imports alone.
"""
import argparse
import contextlib
import io
import statistics
import subprocess
import sys
import time

RANK_IMPORTS = ["torch", "deepspeed", "transformers", "peft", "dslab.this_rank", "dslab.training.sft"]


def import_seconds(module):
    """Seconds a fresh interpreter takes to import `module` (interpreter start-up subtracted)."""
    def timed(code):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        return time.perf_counter() - start

    return timed(f"import {module}") - timed("pass")


def median_of(repeats, fn):
    return statistics.median(fn() for _ in range(repeats))


def launch_seconds(world_size):
    from dslab import launch

    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):   # the command line it prints
        launch.run("hello", world_size=world_size, stream=False)
    return time.perf_counter() - start


def sum_of_ranks_is_right(world_size):
    """What the live-rank call runs: the same all-reduce as the hello recipe."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item() == world_size * (world_size - 1) / 2


def live_seconds(world_size, repeats):
    from dslab import live

    start = time.perf_counter()
    ranks = live.start(world_size=world_size)
    ranks.apply(_join_group)
    started = time.perf_counter() - start
    calls = []
    for _ in range(repeats):
        t = time.perf_counter()
        assert all(ranks.apply(sum_of_ranks_is_right, world_size))
        calls.append(time.perf_counter() - t)
    ranks.stop()
    return started, statistics.median(calls)


def _join_group():
    import deepspeed

    deepspeed.init_distributed()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()

    imports = {m: median_of(args.repeats, lambda m=m: import_seconds(m)) for m in RANK_IMPORTS}
    for module, seconds in imports.items():
        print(f"import {module:22s} {seconds:6.2f} s   (fresh interpreter, each import alone)")
    rank_imports = max(imports.values())  # each module's time includes what it imports (torch, ...)
    launch = median_of(args.repeats, lambda: launch_seconds(args.world_size))
    started, call = live_seconds(args.world_size, args.repeats)
    print(f"launch.run('hello') on {args.world_size} ranks {launch:6.2f} s")
    print(f"live.start({args.world_size}) + init      {started:6.2f} s   (once per test session)")
    print(f"one call on running ranks       {call:6.3f} s")
    print(f"ratio  a launch / a call on live ranks:  {launch / call:8.1f}x")
    print(f"ratio  a launch / the slowest rank import: {launch / rank_imports:6.2f}x")


if __name__ == "__main__":
    main()
