"""Hangs (dslab.hangs.watcher): a job in which no rank makes progress is stopped after every rank's stack is shown
with the collective it waits in; a job that computes silently for longer than the timeout is left alone."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from dslab import launch, live
from dslab.hangs import watcher
from support import assert_no_strays

# torch only (no DeepSpeed import in the ranks), so the launch costs little more than the launcher itself.
SKIPS_AN_ALL_REDUCE = """
import torch
import torch.distributed as torch_dist
from dslab import this_rank
torch_dist.init_process_group("gloo")
x = torch.ones(4)
torch_dist.all_reduce(x)                  # both ranks
print(f"rank {this_rank.rank()}: first all_reduce done", flush=True)
if this_rank.rank() == 0:
    torch_dist.all_reduce(x)              # rank 1 skips this one: rank 0 waits here
torch_dist.barrier()                      # rank 1 waits here; gloo never pairs it with rank 0's all_reduce
"""

# Rank 0 evaluates for `seconds` without printing while rank 1 waits at the barrier: slow, not hung.
COMPUTES_SILENTLY = """
import argparse
import time
import torch
import torch.distributed as torch_dist
from dslab import this_rank
parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=10.0)
args = parser.parse_args()
torch_dist.init_process_group("gloo")
start = time.monotonic()
if this_rank.rank() == 0:
    a = torch.randn(128, 128)
    while time.monotonic() - start < args.seconds:
        a = torch.tanh(a @ a)
torch_dist.barrier()
this_rank.save_rank_result({"rank": this_rank.rank(), "waited": time.monotonic() - start})
"""

# Both ranks wait for torch's build lock, as every process that loads a DeepSpeed op does while another one builds it.
WAITS_FOR_A_BUILD = """
import argparse
from torch.utils.file_baton import FileBaton
from dslab import this_rank
parser = argparse.ArgumentParser()
parser.add_argument("--lock")
FileBaton(parser.parse_args().lock).wait()
this_rank.save_rank_result({"rank": this_rank.rank()})
"""

SLEEPER = """
import sys, time
def wait_here():
    print("ready", flush=True)
    time.sleep(120)
def burn():
    print("ready", flush=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        pass
{"sleep": wait_here, "burn": burn}[sys.argv[1]]()
"""


def _script(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _line_of(source, text):
    """The 1-based line number of the line of `source` that contains `text`."""
    return next(i for i, line in enumerate(textwrap.dedent(source).splitlines(), 1) if text in line)


def _child(tmp_path, what):
    path = tmp_path / "sleeper.py"
    path.write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, str(path), what], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_cli_hang_timeout_shows_every_rank_and_its_collective_then_stops_the_job(tmp_path):
    script = _script(tmp_path, "skips_an_all_reduce.py", SKIPS_AN_ALL_REDUCE)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dslab.cli", "launch", "--world-size", "2", "--hang-timeout", "10",
                           "--run-dir", str(tmp_path / "runs"), str(script)],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert_no_strays(script)
    err = proc.stderr
    assert proc.returncode != 0, proc.stdout + err
    assert elapsed < 90, f"the hang took {elapsed:.0f} s to be reported"
    assert "first all_reduce done" in proc.stdout     # the first collective worked on both ranks
    assert "no rank made progress for 10 s" in err
    rank0 = re.search(r"^  rank 0 \(pid \d+\): (.*)$", err, re.M).group(1)
    rank1 = re.search(r"^  rank 1 \(pid \d+\): (.*)$", err, re.M).group(1)
    skipped, barrier = _line_of(SKIPS_AN_ALL_REDUCE, "rank 1 skips"), _line_of(SKIPS_AN_ALL_REDUCE, "rank 1 waits")
    assert rank0.startswith("blocked in all_reduce (") and f"called from {script.name}:{skipped}" in rank0, rank0
    assert rank1.startswith("blocked in barrier (") and f"called from {script.name}:{barrier}" in rank1, rank1
    assert "The ranks disagree on which collective comes next" in err
    # both stacks, as py-spy reads them: rank 0's inside torch.distributed's all_reduce
    stacks = err[err.index("--- rank 0 (pid"):]
    rank0_stack, rank1_stack = stacks.split("--- rank 1 (pid")
    assert re.search(r"^    all_reduce \(torch/distributed/distributed_c10d\.py:\d+\)$", rank0_stack, re.M)
    assert f"<module> ({script.name}:{skipped})" in rank0_stack
    assert re.search(r"^    barrier \(torch/distributed/distributed_c10d\.py:\d+\)$", rank1_stack, re.M)
    saved = (tmp_path / "runs" / script.stem / "logs" / "hang.txt").read_text()
    assert rank0 in saved and rank1 in saved


def test_a_rank_computing_silently_for_twice_the_timeout_is_not_stopped(tmp_path):
    script = _script(tmp_path, "computes_silently.py", COMPUTES_SILENTLY)
    result = launch.run(str(script), world_size=2, stream=False, run_dir=tmp_path / "runs", timeout=120,
                        hang_timeout=5, seconds=10.0)
    assert_no_strays(script)
    assert [r["rank"] for r in result.results] == [0, 1]
    rank0, rank1 = (r["waited"] for r in result.results)
    assert rank0 >= 10.0 and rank1 > 7.5   # rank 0 computed for 2x the timeout; rank 1 waited silently all along


def test_ranks_waiting_for_an_op_another_process_builds_are_not_hung_and_a_left_lock_is_named(tmp_path):
    script, lock = _script(tmp_path, "waits_for_a_build.py", WAITS_FOR_A_BUILD), tmp_path / "op" / "lock"
    lock.parent.mkdir()
    # a build outside the job, as torch runs one: ninja, holding the lock, which goes when the build ends
    (lock.parent / "build.ninja").write_text(f"rule build\n  command = sleep 12 && rm {lock}\nbuild op.so: build\n")
    lock.touch()
    builder = subprocess.Popen([shutil.which("ninja"), "-C", str(lock.parent)], stdout=subprocess.DEVNULL)
    try:
        result = launch.run(str(script), world_size=2, stream=False, run_dir=tmp_path / "runs", timeout=120,
                            hang_timeout=4, lock=str(lock))
    finally:
        builder.wait(timeout=60)
    assert [r["rank"] for r in result.results] == [0, 1]   # they waited 12 s, 3x the hang timeout, and went on
    # a lock that no build holds (a build killed halfway leaves it): that wait never ends, and the report says why
    lock.touch()
    with pytest.raises(launch.LaunchError) as failed:
        launch.run(str(script), world_size=2, stream=False, run_dir=tmp_path / "again", timeout=120, hang_timeout=4,
                   lock=str(lock))
    assert_no_strays(script)
    assert "no rank made progress for 4 s" in str(failed.value)
    assert str(failed.value).count("waiting for another process to finish a JIT build of a C++ op") == 2


# In a process of its own: live.start is idempotent within a process, and this test stops its ranks.
LIVE_RANKS = """
import json, sys, time
from dslab import live

def join():
    import torch.distributed as torch_dist

    torch_dist.init_process_group("gloo")
    return torch_dist.get_rank()

def slow(seconds):   # rank 0 computes, silently, while rank 1 waits at the barrier
    import time

    import torch
    import torch.distributed as torch_dist

    start = time.monotonic()
    if torch_dist.get_rank() == 0:
        a = torch.randn(128, 128)
        while time.monotonic() - start < seconds:
            a = torch.tanh(a @ a)
    torch_dist.barrier()
    return time.monotonic() - start

def skip():
    import torch
    import torch.distributed as torch_dist

    x = torch.ones(4)
    if torch_dist.get_rank() == 0:
        torch_dist.all_reduce(x)
    torch_dist.barrier()

ranks = live.start(world_size=2, hang_timeout=5)
out = {"ranks": ranks.apply(join), "slow": ranks.apply(slow, 10.0), "report_after_slow": ranks.hang_report}
start = time.monotonic()
try:
    ranks.apply(skip)
except RuntimeError as exc:
    out["error"], out["error_after"] = str(exc), time.monotonic() - start
deadline = time.monotonic() + 150   # the watch stops the cluster once ipyparallel has failed the task
while (ranks.processes() or not ranks.stopped) and time.monotonic() < deadline:
    time.sleep(0.5)
out.update(report=ranks.hang_report, stopped=ranks.stopped, left=[p.pid for p in ranks.processes()],
           stopped_after=time.monotonic() - start)
try:
    ranks.pull("x")
except RuntimeError as exc:
    out["after"] = str(exc)
ranks.stop()
print(json.dumps(out))
"""


def test_live_ranks_a_slow_task_runs_and_a_hung_one_is_reported_and_stopped(tmp_path):
    script = _script(tmp_path, "live_hang.py", LIVE_RANKS)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["ranks"] == [0, 1]
    assert out["slow"][0] >= 10.0 and out["slow"][1] > 7.5   # rank 0 computed 2x the timeout, rank 1 waited
    assert out["report_after_slow"] is None                    # and the watch let them
    assert "no rank made progress" in out["error"] and out["error_after"] < 40
    report = out["report"]
    assert re.search(r"^  rank 0 \(pid \d+\): blocked in all_reduce \(.*\), called from .*\(skip\)$", report, re.M)
    assert re.search(r"^  rank 1 \(pid \d+\): blocked in barrier \(.*\), called from .*\(skip\)$", report, re.M)
    assert report in proc.stderr                      # printed where the task was waiting
    assert out["stopped"] and out["left"] == []
    # each engine's nanny tells the controller its engine died: no wait for the heartbeat to give up (about 30 s)
    assert out["stopped_after"] - out["error_after"] < 15
    assert "stopped after a hang" in out["after"]


def test_py_spy_reads_a_child_process_and_says_where_it_waits(tmp_path):
    proc = _child(tmp_path, "sleep")
    try:
        threads = watcher.read_stack(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    collective, where = watcher.where_blocked(threads, proc.pid)
    assert collective is None
    assert where == f"in no collective: at sleeper.py:{_line_of(SLEEPER, 'time.sleep(120)')} (wait_here)"
    assert "    wait_here (sleeper.py:" in watcher.format_threads(threads, proc.pid)


def test_progress_is_cpu_over_the_window_or_output(tmp_path):
    sleeping, burning = _child(tmp_path, "sleep"), _child(tmp_path, "burn")
    try:
        def one_rank(proc):
            return lambda: {0: [psutil.Process(proc.pid)]}

        watches = {"sleeping": watcher.ProgressWatch(2, one_rank(sleeping)),
                   "burning": watcher.ProgressWatch(2, one_rank(burning)),
                   "sleeping but printing": watcher.ProgressWatch(2, one_rank(sleeping))}
        start, stalled = time.monotonic(), {}
        while time.monotonic() - start < 4.5:
            watches["sleeping but printing"].output()
            for name, watch in watches.items():
                if name not in stalled and watch.stalled():
                    stalled[name] = time.monotonic() - start
            time.sleep(0.1)
    finally:
        for proc in (sleeping, burning):
            proc.kill()
            proc.wait()
    assert list(stalled) == ["sleeping"], stalled
    assert 2.0 <= stalled["sleeping"] < 4.5
    assert watches["sleeping"].window_cpu[0] < 0.1 * 2
    assert watches["burning"].window_cpu[0] > 0.05 * 2


def test_ranks_that_have_all_exited_are_not_hung():
    # Seen in CI: both ranks had finished, the launcher took over 5 s to exit, and the quiet window read as a hang.
    now, alive, me = [0.0], [True], psutil.Process()
    watch = watcher.ProgressWatch(2, lambda: {0: [me], 1: [me]} if alive[0] else {}, clock=lambda: now[0])
    assert not watch.stalled()
    alive[0] = False
    for now[0] in range(1, 10):
        assert not watch.stalled()


def test_frames_name_the_collective_whoever_issues_it():
    site = "/venv/lib/python3.11/site-packages"
    # frames as py-spy reported them for the two hangs of dslab/recipes/hang_demo.py
    torch_all_reduce = {"name": "all_reduce", "filename": f"{site}/torch/distributed/distributed_c10d.py",
                        "short_filename": "torch/distributed/distributed_c10d.py", "line": 3252}
    logger = {"name": "_exception_logger.<locals>.wrapper", "filename": f"{site}/torch/distributed/c10d_logger.py",
              "short_filename": "torch/distributed/c10d_logger.py", "line": 83}
    zero3_wait = {"name": "AllGatherCoalescedHandle.wait",
                  "filename": f"{site}/deepspeed/runtime/zero/partition_parameters.py",
                  "short_filename": "deepspeed/runtime/zero/partition_parameters.py", "line": 765}
    backend = {"name": "TorchBackend.all_gather_into_tensor", "filename": f"{site}/deepspeed/comm/torch.py",
               "short_filename": "deepspeed/comm/torch.py", "line": 300}
    mine = {"name": "<module>", "filename": "/home/me/train.py", "short_filename": "train.py", "line": 12}
    assert [watcher.collective_of(f) for f in (torch_all_reduce, logger, zero3_wait, backend, mine)] == \
        ["all_reduce", None, "all_gather", "all_gather_into_tensor", None]
    threads = [{"os_thread_id": 7, "frames": [zero3_wait, logger, mine]}]
    assert watcher.where_blocked(threads, 7) == (
        "all_gather", ("blocked in all_gather (deepspeed/runtime/zero/partition_parameters.py:765), "
                       "called from train.py:12 (<module>)"))


def test_a_bad_hang_timeout_is_refused_before_anything_starts(tmp_path):
    already = live.running()  # another test module's live ranks may be up
    with pytest.raises(launch.LaunchError, match="positive number of seconds"):
        launch.run("collectives", world_size=2, run_dir=tmp_path, hang_timeout=0)
    assert list(tmp_path.iterdir()) == []   # refused before the run folder was made
    assert all("positive number of seconds" in watcher.unready(bad) for bad in (-5, "20", True, None))
    assert watcher.unready(0.5) is None
    with pytest.raises(ValueError, match="positive number of seconds"):
        live.start(world_size=2, hang_timeout=0)
    assert live.running() is already  # none started


def test_the_process_group_timeout_is_lengthened_only_when_it_would_fire_first():
    assert watcher.deepspeed_timeout_env(20, {}) == {}                       # DeepSpeed's 10 minutes come later
    assert watcher.deepspeed_timeout_env(600, {}) == {"DEEPSPEED_TIMEOUT": "12"}
    assert watcher.deepspeed_timeout_env(600, {"DEEPSPEED_TIMEOUT": "5"}) == {}   # the user's choice stands


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user")
def test_a_stack_py_spy_may_not_read_is_a_clear_error(tmp_path):
    proc = _child(tmp_path, "sleep")   # ours (root); py-spy below runs as nobody and may not trace it
    try:
        probe = (f"from dslab.hangs import watcher\ntry:\n    watcher.read_stack({proc.pid})\n"
                 "except watcher.StackUnreadable as exc:\n    print(exc)\n")
        out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
                              "-c", probe], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    finally:
        proc.kill()
        proc.wait()
    assert "py-spy failed: Permission Denied" in out.stdout, out.stdout + out.stderr
    assert "ptrace" in out.stdout and "kernel.yama.ptrace_scope" in out.stdout
