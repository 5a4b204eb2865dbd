"""The one path every launch takes: start the launcher processes (one per node), show each rank's output as it
comes, stop them all as soon as one fails, times out or is interrupted, name the rank that failed first, and
collect the results the ranks left."""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

from dslab.files import atomic_write_text
from dslab.hangs import watcher
from dslab.hangs.diagnoses import TORCH_PREFIX
from dslab.launch.guard import JOB_ENV, parent_death_signal, processes_with_env, start_guard, stop_processes
from dslab.launch.ports import remove_stale_shm_buffers
from dslab.machine import ensure_build_tools_on_path, gpu_count, threads_per_rank
from dslab.messages import say

# Where each rank leaves its JSON result (dslab.this_rank.save_rank_result); launch sets it for every rank.
RESULT_DIR_ENV = "DSLAB_RESULT_DIR"

# Lines DeepSpeed's own logger writes ("[2026-01-01 10:00:00,123] [INFO] [launch.py:...] ...") and the
# JIT-build chatter: kept in the log, hidden from the learner unless stream="all".
NOISE = re.compile(
    r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING|DEBUG)\]"
    r"|^DeepSpeed deepspeed\.ops\.\S+ built successfully"
    r"|^(Using|Emitting ninja|Building extension|Loading extension|Detected CUDA|ninja: no work)"
    r"|^\[\d+/\d+\] "
    r"|^Time to load \S+ op:"
)
# How a rank fails when another rank died first: these are echoes, not causes.
_ECHO = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash|Broken pipe|"
                   r"DistNetworkError|DistBackendError|NCCL communicator was aborted|Socket Timeout|"
                   r"failed to recv, got 0 bytes", re.I)
INHERITED_PLACE = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK",
                   "CROSS_SIZE")
STOP_GRACE_S = 5  # a stopped launcher's time to stop its ranks before everything left is killed


class LaunchError(RuntimeError):
    """A multi-rank run failed; the message holds the failing rank's traceback."""


@dataclass
class LaunchResult:
    """What a finished run left behind."""

    command: list
    returncode: int
    results: list = field(default_factory=list)  # one JSON object per rank, by rank
    log: str = ""
    run_dir: str = ""

    @property
    def rank0(self):
        return self.results[0] if self.results else None


RunDirs = namedtuple("RunDirs", "run logs results")


def fresh_run_dir(name, run_dir=None):
    """An emptied RUN_DIR/name (default ./runs, or $DSLAB_RUNS_DIR) with logs/ and results/ folders: RunDirs."""
    run = Path(run_dir or os.environ.get("DSLAB_RUNS_DIR", "runs")) / name
    shutil.rmtree(run, ignore_errors=True)
    (run / "logs").mkdir(parents=True)
    (run / "results").mkdir()
    return RunDirs(run, run / "logs", run / "results")


def rank_environment(world_size, result_dir):
    """The environment a launcher passes on to `world_size` ranks sharing this machine, results to `result_dir`."""
    # A launcher gives each rank its place itself; the place of the process starting it (a notebook kernel or a test
    # that ran DeepSpeed in-process has RANK=0, WORLD_SIZE=1, ...) must not reach the launcher, nor anything that
    # finds a job's ranks by their RANK variable (the hang watch).
    ensure_build_tools_on_path()  # the ranks build DeepSpeed's ops with the ninja installed with dslab
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_PLACE}
    env[RESULT_DIR_ENV] = str(result_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars, once per rank
    if not gpu_count():
        # CPU ranks share the cores: one rank per core slice, or they oversubscribe and crawl. The cores are those
        # this process may really use: its affinity or its cgroup's CPU quota (a container, a JupyterHub), the fewer.
        env["OMP_NUM_THREADS"] = str(threads_per_rank(world_size))
        # Idle OpenMP threads sleep instead of spinning, so ranks sharing cores don't steal each other's time.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def shower(stream, prefix=True):
    """show(rank, line) for supervise: stream None/"recipe" prints what the ranks print (DeepSpeed's own log lines
    hidden), "all" everything, False nothing; with `prefix`, each line under its rank ("[rank1] ...")."""
    def show(rank, line):
        if stream is False or (stream != "all" and NOISE.search(line)):
            return
        print(f"[rank{rank}] {line}" if prefix and rank is not None else line, flush=True)
    return show


def _rank_of(path):
    return int(re.search(r"_rank(\d+)\.log$", path).group(1))


class _Tailer(threading.Thread):
    """Follows the per-rank log files the deepspeed launcher writes and shows each new line under its rank."""

    def __init__(self, log_dir, show):
        super().__init__(daemon=True)
        self.log_dir, self.show = log_dir, show
        self.offsets, self.stop = {}, threading.Event()

    def poll(self):
        for path in sorted(glob.glob(os.path.join(self.log_dir, "*_rank*.log"))):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            # only complete lines; a partial one waits for the next poll
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            text = TORCH_PREFIX.sub("", complete.decode("utf-8", "replace"))
            for line in text.splitlines():
                self.show(_rank_of(path), line)

    def run(self):
        while not self.stop.is_set():
            self.poll()
            time.sleep(0.2)
        self.poll()


def supervise(name, commands, envs, log_dir, show, timeout=None, line_rank=None, hang_timeout=None):
    """Start one launcher per command (one per node), show every rank's output, and stop them all as soon as one
    fails, times out, hangs (no rank made progress for `hang_timeout` s: dslab.hangs.watcher) or is interrupted.
    Returns (rank_logs, launcher outputs, return codes).

    Rank output comes from the per-rank log files the deepspeed launcher writes into `log_dir`
    (--enable_each_rank_log), and from the launchers' own output through `line_rank(node, line) -> (rank, text)`
    (torchrun --tee prefixes each rank's lines), or None to leave the line out; rank None: shown, not a rank's.
    """
    if hang_timeout is not None and (problem := watcher.unready(hang_timeout)):
        raise LaunchError(problem)
    job = f"{os.getpid()}-{uuid.uuid4().hex}"
    outputs, stdout_ranks, procs, readers = [[] for _ in commands], {}, [], []

    def read(i, proc):
        for line in proc.stdout:
            outputs[i].append(line)
            found = line_rank(i, line.rstrip("\n")) if line_rank else None
            if found is not None:
                rank, text = found
                if rank is not None:
                    stdout_ranks.setdefault(rank, []).append(text + "\n")
                show(rank, text)

    # Every process of the job carries JOB_ENV=job, whatever group it ends up in: the guard stops them if this
    # process dies without doing it (kill -9, a lost terminal, a scheduler), and the stop below finds them all.
    guard = start_guard(marker=(JOB_ENV, job))
    watch = None
    if hang_timeout is not None:
        watch = watcher.ProgressWatch(hang_timeout, lambda: watcher.ranks_of(processes_with_env(JOB_ENV, job)))
        envs = [dict(env, **watcher.deepspeed_timeout_env(hang_timeout, env)) for env in envs]
        show = _noting_output(show, watch)
    tailer = _Tailer(str(log_dir), show)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        # Own session per launcher: one killpg reaches it and all its ranks, and Ctrl-C in a terminal or a notebook
        # interrupt reaches only us, who stop them in order. When we die, the kernel sends each launcher SIGTERM.
        for cmd, env in zip(commands, envs):
            procs.append(subprocess.Popen(cmd, env=dict(env, **{JOB_ENV: job}), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                          preexec_fn=parent_death_signal()))
        readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
        for r in readers:
            r.start()
        tailer.start()
        # Wait until all launchers end, or one fails: then the others (other nodes) would wait for it forever.
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(say("launch.timeout", name=name, timeout=timeout))
            # the stacks are read while the ranks still wait, before anything is stopped
            if watch is not None and watch.stalled() and (report := watcher.hang_report(watch, name)) is not None:
                atomic_write_text(Path(log_dir) / "hang.txt", report + "\n")
                raise LaunchError(f"{report}\n" + say("launch.hang_stopped", log_dir=log_dir))
            time.sleep(0.1)
    finally:
        # a rank that outlived its launcher must not linger
        stop_processes([p.pid for p in procs], processes_with_env(JOB_ENV, job), STOP_GRACE_S)
        for p in procs:
            p.wait()
        guard.kill()
        guard.wait()
        if tailer.is_alive():
            tailer.stop.set()
            tailer.join()
        for r in readers:
            r.join(timeout=5)
        remove_stale_shm_buffers()
    rank_logs = {_rank_of(p): TORCH_PREFIX.sub("", Path(p).read_text(errors="replace"))
                 for p in glob.glob(str(Path(log_dir) / "*_rank*.log"))}
    rank_logs.update({r: "".join(lines) for r, lines in stdout_ranks.items()})
    return rank_logs, ["".join(o) for o in outputs], [p.returncode for p in procs]


def _noting_output(show, watch):
    """show, which also tells the hang watch that a rank printed: progress."""
    def noting(rank, line):
        watch.output()
        show(rank, line)
    return noting


def failing_rank(rank_logs):
    """(rank, traceback text) of the rank that failed first, skipping ranks that only lost their peer."""
    found = []
    for rank, text in sorted(rank_logs.items()):
        start = text.find("Traceback (most recent call last)")
        if start >= 0:
            found.append((rank, text[start:].strip()))
    for rank, trace in found:
        if not _ECHO.search(trace.splitlines()[-1]):  # the exception line names the cause
            return rank, trace
    silent = [r for r in sorted(rank_logs) if r not in dict(found)]
    if found and silent:  # every traceback is an echo: the rank without one died first (by a signal)
        return silent[0], None
    return found[0] if found else (None, None)


def _log_tails(rank_logs, lines=20):
    """The last lines of every rank's log: where a crash without a traceback (a signal) shows."""
    return "\n".join(f"--- rank {r}, last lines ---\n" + "\n".join(t.splitlines()[-lines:])
                     for r, t in sorted(rank_logs.items()))


def _raise_failure(name, world_size, rank_logs, outputs, codes, log_dir):
    # a launcher that exited with a status failed by itself; a negative one was stopped by a signal (ours, after
    # another node failed, or someone else's)
    failed = next((i for i, c in enumerate(codes) if c and c > 0), next(i for i, c in enumerate(codes) if c))
    code = codes[failed]
    rank, trace = failing_rank(rank_logs)
    where = say("launch.rank_failed", rank=rank) if rank is not None else say("launch.launcher_failed")
    if len(codes) > 1:
        where += say("launch.on_node", node=failed)
    killed_by = None
    if code > 128:  # the launcher passes on a rank's -signal as 256 - signal
        try:
            killed_by = signal.Signals(256 - code).name
        except ValueError:
            pass
    if killed_by:
        where += say("launch.killed_by", signal=killed_by)
    elif rank is not None and trace is None:
        # The deepspeed launcher polls its ranks once a second and passes on the first failure it sees: when the
        # peers' echo exits come in the same second, the dead rank's signal is lost, but its silence is not.
        where += say("launch.no_traceback")
    detail = trace or (_log_tails(rank_logs) + "\n--- launcher ---\n" + outputs[failed][-2000:])
    raise LaunchError(say("launch.failed", name=name, world_size=world_size, where=where, code=code, log_dir=log_dir)
                      + f"\n{detail}")


def collect_results(result_dir, world_size):
    """The JSON result each rank left with dslab.this_rank.save_rank_result, by rank (None for a rank that left none)."""
    results = []
    for r in range(world_size):
        path = Path(result_dir) / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def run_job(name, commands, envs, dirs, world_size, show, timeout=None, line_rank=None, command=None,
            hang_timeout=None):
    """Supervise the launchers `commands` (one per node) of a job on `world_size` ranks, keep their output in
    dirs.run/launcher.log, and return a LaunchResult with the ranks' results (`command`: what it reports as run).
    Raises LaunchError, naming the rank that failed first, if any launcher fails, or where each rank waits if no
    rank made progress for `hang_timeout` seconds."""
    rank_logs, outputs, codes = supervise(name, commands, envs, dirs.logs, show, timeout, line_rank, hang_timeout)
    if len(outputs) == 1:
        log = outputs[0]
    else:
        log = "".join(f"\n===== node {i} =====\n{o}" for i, o in enumerate(outputs))
    atomic_write_text(dirs.run / "launcher.log", log)
    log += "".join(f"\n===== rank {r} =====\n{t}" for r, t in sorted(rank_logs.items()))
    if any(codes):
        _raise_failure(name, world_size, rank_logs, outputs, codes, dirs.logs)
    return LaunchResult(command=commands if command is None else command, returncode=0,
                        results=collect_results(dirs.results, world_size), log=log, run_dir=str(dirs.run))
