"""Hangs: when no rank of a job makes progress for S seconds, read every rank's Python stack with py-spy, name the
collective each rank is blocked in, and let the caller stop the job.

A rank that waits in a collective its peers never join (one rank skips an all_reduce; ZeRO-3 ranks generate
different numbers of tokens) waits until its process-group timeout: 10 minutes under deepspeed.init_distributed
(DEEPSPEED_TIMEOUT, in minutes), 30 under torch's gloo default; then it fails with "Timed out", which says nothing of
where the others were.
`dslab launch --hang-timeout S` (launch.run(..., hang_timeout=S)) and `live.start(..., hang_timeout=S)` watch instead.

What counts as progress (ProgressWatch): a rank printed a line, or one rank used at least BUSY_FRACTION of a CPU core
(user + system time of its processes, children included) over the last S seconds. Both are needed: a rank waiting in
a gloo collective sleeps in a socket read (measured here: 0.2-0.3 % of a core, its background threads), while a rank
that computes without printing (a long evaluation, a JIT build in a child process) burns CPU; a rank that prints is
alive even when it waits. CPU is summed over the whole window, not per poll, so a helper thread that wakes now and
then cannot pass for work. Not counted: socket and disk I/O (live ranks' heartbeats move those while a rank hangs).
Before a job is called hung, its stacks are read: a rank waiting for torch's build lock while a compiler runs on this
machine waits for another process's JIT build of an op (a second notebook, another learner on a shared account),
which it loads once that build ends: no hang, and the window starts again.
Limits, stated: a rank waiting without CPU on something else outside the job (a network file system, a download)
for longer than S looks hung, so choose S above the longest such wait; on GPUs, CUDA's default synchronisation may
busy-wait when cores are free, so a host thread waiting for a hung NCCL kernel can look busy (not verified here).
"""
import json
import math
import shutil
import subprocess
import sysconfig
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from dslab.machine import tool
from dslab.messages import say

BUSY_FRACTION = 0.05      # of one core, averaged over the window: 20x what a waiting rank used here
POLL_S = 1.0              # how often the ranks are sampled
DUMP_TIMEOUT_S = 30       # py-spy pauses a process for milliseconds; a slow answer means it is stuck itself
PY_SPY_PIN = "py-spy==0.4.3"
PTRACE_HELP = ("py-spy reads another process's memory, which needs ptrace permission: run as root, or as the same "
               "user with kernel.yama.ptrace_scope=0 (`sudo sysctl kernel.yama.ptrace_scope=0`; under scope 1 only "
               "a process's ancestors may trace it, and py-spy is not an ancestor of the ranks), or give py-spy the "
               "capability (`sudo setcap cap_sys_ptrace+ep $(which py-spy)`); in a container add SYS_PTRACE")
# Collective names as they appear in frame names, without underscores and in lower case: longer words first, so
# that all_reduce is not taken for reduce nor all_gather for gather.
COLLECTIVE_WORDS = ("allreduce", "reducescatter", "allgather", "alltoall", "broadcast", "barrier", "reduce",
                    "gather", "scatter", "isend", "irecv", "send", "recv")
CANONICAL = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter", "allgather": "all_gather",
             "alltoall": "all_to_all"}
# Where a collective is issued or waited for: torch.distributed, deepspeed.comm, and ZeRO's gather/reduce handles.
COMM_PATHS = ("/torch/distributed/", "/deepspeed/comm/", "/deepspeed/runtime/zero/")
# torch.utils.cpp_extension's lock around a JIT build: a process that finds it taken sleeps in this frame until it goes
BUILD_LOCK_WAIT = "FileBaton.wait"
# processes that run while an op is built: torch drives every JIT build through ninja, which runs the compiler
BUILDERS = frozenset({"ninja", "cc1plus", "c++", "g++", "clang++", "nvcc", "cicc", "ptxas", "ld", "collect2"})
LIBRARY_PATHS = tuple({str(Path(sysconfig.get_paths()[key]).resolve()) for key in ("purelib", "platlib", "stdlib")})


class ProgressWatch:
    """Tells when no rank has made progress (see the module docstring) for `timeout` seconds.

    find_ranks() -> {rank: [psutil.Process, ...]}: each rank's processes, its own first. Call output() whenever a rank
    prints a line, and stalled() often (it samples at most every POLL_S seconds).
    """

    def __init__(self, timeout, find_ranks, busy_fraction=BUSY_FRACTION, clock=time.monotonic):
        if not timeout or timeout <= 0:
            raise ValueError(f"hang_timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout, self.find_ranks, self.busy_fraction, self.clock = timeout, find_ranks, busy_fraction, clock
        self.ranks, self.seen, self.window_cpu = {}, set(), {}
        self.restart()

    def restart(self):
        """Forget the history: the window starts now (the ranks are starting, or live ranks start a new cell)."""
        self.cpu = {}             # process -> (rank, CPU seconds at its last reading): the dead keep theirs
        self.samples = deque()    # (time, {rank: CPU seconds of all its processes so far}), oldest first
        self.last_output = self.last_sample = self.clock()

    def output(self):
        """A rank printed something: that is progress."""
        self.last_output = self.clock()

    def stalled(self):
        """Sample the ranks; True once none printed for `timeout` s nor used busy_fraction of a core in that time."""
        now = self.clock()
        if self.samples and now - self.last_sample < POLL_S:
            return False
        self.last_sample = now
        ranks = self.find_ranks()
        if not ranks and not self.seen:   # the launcher has not started the ranks yet: nothing to judge
            self.restart()
            return False
        self.ranks = ranks
        self.seen |= set(ranks)
        if not ranks:   # every rank has exited and the launcher is winding up (slowly on a loaded machine): no hang
            return False
        for rank, procs in ranks.items():
            for proc in procs:
                try:
                    used = proc.cpu_times()
                    # keyed by the process itself: psutil tells processes apart by pid and start time since boot,
                    # which a change of the system clock does not move
                    self.cpu[proc] = (rank, used.user + used.system)
                except psutil.Error:
                    pass  # it ended between the listing and now: its last reading stays
        totals = {}
        for rank, seconds in self.cpu.values():
            totals[rank] = totals.get(rank, 0.0) + seconds
        self.samples.append((now, totals))
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.timeout:
            self.samples.popleft()  # keep one sample at or before the window's start
        start, start_totals = self.samples[0]
        if now - start < self.timeout or now - self.last_output < self.timeout:
            return False
        self.window_cpu = {r: totals[r] - start_totals.get(r, 0.0) for r in totals}
        return all(seconds < self.busy_fraction * (now - start) for seconds in self.window_cpu.values())


def ranks_of(processes):
    """{rank: [processes]} of a job's processes (dslab.launch.guard.processes_with_env finds them by its marker): those
    with a RANK variable, the rank's own process first (its children, such as data loader workers or a compiler,
    inherit RANK and count as the rank's)."""
    rank_of = {}
    for proc in processes:
        try:
            rank = proc.environ().get("RANK", "")
        except psutil.Error:
            continue
        if rank.isdigit():
            rank_of[proc] = int(rank)
    by_pid = {proc.pid: rank for proc, rank in rank_of.items()}
    ranks = {}
    for proc, rank in rank_of.items():
        try:
            helper = by_pid.get(proc.ppid()) == rank   # its parent is the same rank: one of that rank's helpers
        except psutil.Error:
            continue
        ranks.setdefault(rank, []).append((helper, proc.pid, proc))
    return {rank: [proc for _, _, proc in sorted(found, key=lambda f: f[:2])] for rank, found in sorted(ranks.items())}


def unready(hang_timeout):
    """Why a hang watch with this timeout cannot run here (a sentence with the fix), or None."""
    if isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float)) or not hang_timeout > 0:
        return say("hang.timeout_value", value=hang_timeout)
    if not Path(tool("py-spy")).is_file() and not shutil.which(tool("py-spy")):
        return say("hang.no_py_spy", pin=PY_SPY_PIN)
    return None


class StackUnreadable(RuntimeError):
    """py-spy could not read a process's stack; the message says why and what to do."""


def read_stack(pid):
    """The Python threads of process `pid` as `py-spy dump --json --pid PID` reads them (frames innermost first)."""
    try:
        done = subprocess.run([tool("py-spy"), "dump", "--json", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=DUMP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise StackUnreadable(f"py-spy is not installed: pip install {PY_SPY_PIN}") from None
    except subprocess.TimeoutExpired:
        raise StackUnreadable(f"py-spy did not answer within {DUMP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        why = " ".join((done.stderr or done.stdout).split())[-300:] or f"exit status {done.returncode}"
        if "ermission" in why or "ptrace" in why.lower() or "Operation not permitted" in why:
            why += ". " + PTRACE_HELP
        raise StackUnreadable(f"py-spy failed: {why}")
    return json.loads(done.stdout)


def frame_text(frame):
    """One frame the way py-spy prints it: `function (file:line)`."""
    return f"{frame['name']} ({frame.get('short_filename') or frame['filename']}:{frame['line']})"


def _place(frame):
    return f"{frame.get('short_filename') or frame['filename']}:{frame['line']}"


def collective_of(frame):
    """The collective a frame issues or waits for (all_reduce, barrier, all_gather, ...), else None."""
    path = frame["filename"].replace("\\", "/")
    if not any(part in path for part in COMM_PATHS):
        return None
    name = frame["name"].rsplit(".", 1)[-1]
    for word in COLLECTIVE_WORDS:
        if word in name.replace("_", "").lower():
            return name                    # torch.distributed's and deepspeed.comm's own names: all_gather_into_tensor
    for word in COLLECTIVE_WORDS:
        if word in frame["name"].replace("_", "").lower():
            return CANONICAL.get(word, word)   # a handle's wait: AllGatherCoalescedHandle.wait -> all_gather
    return None


def is_user_frame(frame):
    """A frame of the job's own code, not of Python or an installed package."""
    path = frame["filename"]
    return not (path.startswith("<") or any(path.startswith(lib) for lib in LIBRARY_PATHS)
                or "/site-packages/" in path or "/dist-packages/" in path)


def where_blocked(threads, pid):
    """(collective or None, one line saying where): the collective a rank's threads are blocked in and the job's
    own line that called it, else where its main thread is."""
    main = next((t for t in threads if t.get("os_thread_id") == pid), threads[0] if threads else None)
    for thread in [main] + [t for t in threads if t is not main]:
        frames = thread["frames"] if thread else []
        for i, frame in enumerate(frames):
            collective = collective_of(frame)
            if collective:
                caller = next((f for f in frames[i + 1:] if is_user_frame(f)), None)
                called = f", called from {_place(caller)} ({caller['name']})" if caller else ""
                return collective, f"blocked in {collective} ({_place(frame)}){called}"
    frames = main["frames"] if main else []
    if not frames:
        return None, "no Python frame (it may be starting or finishing)"
    own = next((f for f in frames if is_user_frame(f)), frames[0])
    where = f"in no collective: at {_place(own)} ({own['name']})"
    if waits_for_build(frames):
        where += (", waiting for another process to finish a JIT build of a C++ op (torch's build lock); if no "
                  "build runs, a killed one left its `lock` file in the op's folder under ~/.cache/torch_extensions")
    return None, where


def waits_for_build(frames):
    """True when these frames (one thread's) sleep on torch's build lock."""
    return any(f["name"].endswith(BUILD_LOCK_WAIT) for f in frames)


def building_here():
    """True while a compiler, or the ninja that drives it, runs on this machine."""
    return any(proc.info["name"] in BUILDERS for proc in psutil.process_iter(["name"]))


def format_threads(threads, pid):
    """The stacks as py-spy prints them (each thread, then its frames, innermost first): the main thread and every
    thread in a collective or in the job's own code; threads wholly inside libraries (an IPython engine's
    messaging threads, a loader's helpers) are counted, not shown."""
    lines, hidden = [], 0
    for t in threads:
        if not (t.get("os_thread_id") == pid or any(collective_of(f) or is_user_frame(f) for f in t["frames"])):
            hidden += 1
            continue
        name = f': "{t["thread_name"]}"' if t.get("thread_name") else ""
        lines.append(f"Thread {t.get('os_thread_id') or t.get('thread_id')} "
                     f"({'active' if t.get('active') else 'idle'}){name}")
        lines += [f"    {frame_text(f)}" for f in t["frames"]]
    if hidden:
        lines.append(f"({hidden} more thread{'s' if hidden > 1 else ''} wholly inside libraries, not shown)")
    return "\n".join(lines)


def dump_ranks(ranks, seen=()):
    """Read every rank's stack (in parallel): [(rank, collective or None, one-line summary, stacks text, whether it
    waits for torch's build lock)] by rank.

    ranks: {rank: [processes]} (its own process first); seen: every rank known so far (those gone: "has exited")."""
    def one(item):
        rank, procs = item
        pid = procs[0].pid
        try:
            threads = read_stack(pid)
        except StackUnreadable as exc:
            return rank, None, f"rank {rank} (pid {pid}): stack not read: {exc}", "", False
        collective, where = where_blocked(threads, pid)
        return (rank, collective, f"rank {rank} (pid {pid}): {where}",
                f"--- rank {rank} (pid {pid}), py-spy dump ---\n{format_threads(threads, pid)}",
                any(waits_for_build(t["frames"]) for t in threads))

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(ranks)))) as pool:
        found = list(pool.map(one, ranks.items()))
    found += [(r, None, f"rank {r}: has exited", "", False) for r in sorted(set(seen) - set(ranks))]
    return sorted(found, key=lambda item: item[0])


def hang_report(watch, name="the job"):
    """The hang, as text: what was measured, where each rank is blocked, then every rank's stack. None when it is
    no hang (a rank waits for torch's build lock while a compiler runs here, see the module docstring): the watch's
    window then starts again."""
    found = dump_ranks(watch.ranks, watch.seen)
    if any(build for *_, build in found) and building_here():
        watch.restart()
        return None
    used = ", ".join(f"rank {r} {s:.2f} s" for r, s in sorted(watch.window_cpu.items()))
    text = (f"{name}: no rank made progress for {watch.timeout:g} s (no line printed; CPU time in that window: "
            f"{used or 'none'}, each below {watch.busy_fraction:.0%} of a core), so it hangs. Where each rank waits:\n"
            + "".join(f"  {summary}\n" for _, _, summary, _, _ in found))
    if len({collective for _, collective, _, _, _ in found}) > 1:
        text += ("The ranks disagree on which collective comes next: one was skipped or added on some ranks "
                 "(a rank-dependent `if`, loops or generations of different lengths).\n")
    return text + "\n".join(stacks for _, _, _, stacks, _ in found if stacks)


def watch_in_background(timeout, find_ranks, working, printed, on_hang, name="the ranks"):
    """A daemon thread that watches ranks which live longer than one task (dslab.live): while working() is true
    (a task runs on them), it samples them with a ProgressWatch, and printed() (a count of what they printed) growing
    is progress; on a hang it calls on_hang(report) once and ends. Set the thread's `stop` event to end it."""
    stop = threading.Event()

    def loop():
        watch, seen = ProgressWatch(timeout, find_ranks), printed()
        while not stop.wait(POLL_S / 4):
            if not working():   # waiting between tasks is no hang
                watch.restart()
                continue
            if printed() != seen:
                seen = printed()
                watch.output()
            if watch.stalled() and (report := hang_report(watch, name)) is not None:
                on_hang(report)
                return

    thread = threading.Thread(target=loop, name="dslab-hang-watch", daemon=True)
    thread.stop = stop
    thread.start()
    return thread


def deepspeed_timeout_env(hang_timeout, env):
    """DEEPSPEED_TIMEOUT (minutes) to give the ranks so that their process-group timeout cannot fire before the hang
    is seen and dumped (margin: DUMP_TIMEOUT_S and a minute); {} when DeepSpeed's 10-minute default is already later
    or the variable is set. The timeout is never shortened: a rank may wait in a barrier for as long as another
    computes, which is progress (see ProgressWatch), and a shorter timeout would fail it."""
    if "DEEPSPEED_TIMEOUT" in env:
        return {}
    minutes = math.ceil((hang_timeout + DUMP_TIMEOUT_S + 60) / 60)
    return {"DEEPSPEED_TIMEOUT": str(minutes)} if minutes > 10 else {}
