"""Where a test run's CPU goes: which test file, which test, which kind of process.

Course tooling, run from the repository root on a quiet machine:

    python -m tools.profile_tests                      make test, then the report
    python -m tools.profile_tests -- make test-unit    any other command
    python -m tools.profile_tests --top 60 --json build/test-cpu.json

On 2 cores make test keeps both busy from start to end, so its wall time is its CPU time over 2: what shortens it is
less CPU, and this says where the CPU is. Every half second a sampler reads each process's user + system time
(/proc/PID/stat) and, once, its command line and the PYTEST_CURRENT_TEST it was started with (/proc/PID/environ):
pytest sets that variable for the test it runs, and every process a test starts (launchers, ranks, kernels, live
ranks) inherits it, so a process counts to the test that started it, or to the notebook for nbval's kernels. The
lanes' pytest processes themselves count to "-" (they started before any test). Only the command's own processes
count (they inherit a variable naming this run; nothing else running on the machine does). A process that lives
under half a second may be missed; the few that do are small.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
RUN_TAG = "DSLAB_PROFILED_RUN"  # set for the command, inherited by every process it starts
KINDS = (  # (kind, words in its command line), first match wins
    ("py-cpuinfo (DeepSpeed's op loads)", ("cpuinfo",)),
    ("deepspeed per-node launcher", ("deepspeed.launcher.launch",)),
    ("deepspeed runner", ("/bin/deepspeed ",)),
    ("live rank (ipyparallel)", ("ipyparallel",)),
    ("notebook kernel", ("ipykernel",)),
    ("pytest", ("pytest",)),
    ("compiler", ("cc1plus", "ninja", "/ld ")),
    ("chromium", ("chromium",)),
    ("rank or other Python process", ("python",)),
)


def sample(seen, stop, tag):
    """Until `stop` is set: {(pid, start time): [cpu seconds, command line, test]} of every process whose
    environment holds RUN_TAG=tag (None for the others, read once)."""
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2:].split()
                cpu, key = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, (pid, fields[19])
                if key not in seen:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                    seen[key] = None
                    if env.get(RUN_TAG.encode()) == tag.encode():
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                        test = env.get(b"PYTEST_CURRENT_TEST", b"-").decode(errors="replace").rsplit(" (", 1)[0]
                        seen[key] = [cpu, command, test]
                if seen[key] is not None:
                    seen[key][0] = cpu
            except (OSError, ValueError):  # gone meanwhile, or not ours to read
                pass
        stop.wait(0.5)


def kind(command):
    return next((name for name, words in KINDS if any(w in command for w in words)), "other")


def report(rows, top):
    """Text: CPU seconds in all, by kind of process, by test file (or notebook), by test."""
    by = {"kind": collections.Counter(), "file": collections.Counter(), "test": collections.Counter()}
    count = collections.Counter()
    for cpu, command, test in rows:
        by["kind"][kind(command)] += cpu
        count[kind(command)] += 1
        by["file"][test.split("::")[0]] += cpu
        by["test"][test] += cpu
    lines = [f"{sum(r[0] for r in rows):.0f} CPU-s in {len(rows)} processes", "", "by kind of process:"]
    lines += [f"{cpu:8.1f}  {count[name]:4d} x  {name}" for name, cpu in by["kind"].most_common()]
    for title, key in (("by test file or notebook (- : the lanes' own pytest and make)", "file"), ("by test", "test")):
        lines += ["", title + ":"] + [f"{cpu:8.1f}  {name}" for name, cpu in by[key].most_common(top)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40, help="how many test files and tests to list")
    parser.add_argument("--json", help="also write [cpu, command, test] per process here")
    parser.add_argument("command", nargs="*", default=["make", "test"], help="what to run (after --)")
    args = parser.parse_args(argv)
    seen, stop, tag = {}, threading.Event(), f"{os.getpid()}-{time.time_ns()}"
    sampler = threading.Thread(target=sample, args=(seen, stop, tag), daemon=True)
    sampler.start()
    started = time.monotonic()
    code = subprocess.call(args.command, env={**os.environ, RUN_TAG: tag})
    stop.set()
    sampler.join()
    rows = [row for row in seen.values() if row is not None]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    print(f"\n{' '.join(args.command)}: exit {code}, {time.monotonic() - started:.0f} s wall")
    print(report(rows, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main())
