"""Children die with their owner: what dslab starts stops when the process that started it ends, even by SIGKILL
(a lost terminal, a job scheduler, the OOM killer, a notebook kernel restarted), when none of its code can run.

Two means, in this one place:

- `parent_death_signal()`, a Popen preexec_fn: the kernel itself (Linux prctl PR_SET_PDEATHSIG) sends the child
  SIGTERM the moment the thread that started it ends. It reaches that child only. torchrun stops its ranks on
  SIGTERM (torch.distributed.elastic turns it into a SignalException and its agent stops the workers), and so does
  DeepSpeed's per-node launcher (deepspeed/launcher/launch.py: terminate_process_tree of every rank). But the
  `deepspeed` command in front of that launcher (deepspeed/launcher/runner.py) sets no handler for a local run
  (only for pdsh): it dies of SIGTERM and leaves the per-node launcher and the ranks running.
- `start_guard()`: a small watcher process, in a session of its own (a kill of the owner's process group spares it),
  that waits for the owner to vanish, then stops the owner's children: given process groups, and every process
  whose environment carries a marker variable (every descendant inherits it, whichever group or session it moved
  to), and removes what they left (folders, /dev/shm buffers).

The owner stops its children itself when it can (stop_processes), then kills its guard.
"""
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil

from dslab.launch.ports import remove_shm_buffers, remove_stale_shm_buffers

# Set in the environment of every launcher dslab starts, to a value of that job's own: the ranks inherit it.
JOB_ENV = "DSLAB_JOB"
PR_SET_PDEATHSIG = 1  # from linux/prctl.h


def is_running(proc):
    """True while proc (a psutil.Process) runs; a zombie (dead, waiting for its parent to collect it) counts as gone."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def process_tree(pids):
    """The processes `pids` and every process below them (psutil.Process objects), as they are now."""
    procs = []
    for pid in pids:
        try:
            leader = psutil.Process(pid)
            procs += [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def processes_with_env(name, value):
    """The running processes (not this one) whose environment holds name=value: all of a job's, for its marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(name) == value and is_running(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def wait_gone(procs, timeout):
    """Wait up to `timeout` s for every process in procs to end; True if they all did."""
    deadline = time.monotonic() + timeout
    while any(is_running(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_processes(groups=(), procs=(), grace=3.0):
    """SIGTERM the process groups `groups` and the processes `procs`, give them `grace` s, then SIGKILL them.

    Collect `procs` before anything is signalled: a process whose parent has died is no longer below it.
    """
    procs = list(procs)

    def signal_all(sig):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in procs:
            try:
                proc.send_signal(sig)  # psutil checks it is still the process it found (no pid reuse)
            except psutil.NoSuchProcess:
                pass

    signal_all(signal.SIGTERM)
    wait_gone(procs, grace)
    signal_all(signal.SIGKILL)  # a rank that ignores SIGTERM, or a group member nobody listed
    wait_gone(procs, grace)


def parent_death_signal(sig=signal.SIGTERM):
    """A Popen preexec_fn after which the child receives `sig` as soon as the thread that started it ends, however
    it ends (Linux; None elsewhere). Start the child from a thread that lives as long as the child should.

    It runs in the child between fork and exec, where only the forking thread exists: one foreign call and
    os calls, no imports or locks another thread could have held, so it is safe with threads in the parent.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec():
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect: no signal would ever come
            os.kill(os.getpid(), sig)

    return preexec


def start_guard(groups=(), marker=None, remove=(), master_port=None):
    """Start the guard of this process's children; returns its Popen (kill it once they are stopped).

    groups: process groups to stop; marker: (name, value) of the environment variable every process to stop
    carries; remove: folders to delete afterwards; master_port: the job whose /dev/shm buffers go too.
    """
    spec = {"owner": os.getpid(), "groups": list(groups), "marker": list(marker) if marker else None,
            "remove": [str(p) for p in remove], "master_port": master_port}
    return subprocess.Popen([sys.executable, "-m", "dslab.launch", "guard", json.dumps(spec)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _owner_alive(owner_pid):
    # The guard is the owner's child: when the owner exits, however it exits, the kernel gives the guard another
    # parent (init or a subreaper). No start times compared: a wall-clock one moves whenever the system clock is
    # adjusted (psutil adds the boot time, which /proc/stat gives to the second), and a 1 s step read as the owner's
    # death once stopped a healthy job.
    return os.getppid() == owner_pid


def watch(spec, poll=0.2, grace=2.0):
    """The guard's loop (`python -m dslab.launch guard SPEC`): wait until the owner has gone, then stop its
    children and remove what they left. The grace is short: a job whose owner died has nobody to report to."""
    while _owner_alive(spec["owner"]):
        time.sleep(poll)
    procs = process_tree(spec["groups"])
    if spec["marker"]:
        procs += processes_with_env(*spec["marker"])
    stop_processes(spec["groups"], procs, grace)
    for path in spec["remove"]:
        shutil.rmtree(path, ignore_errors=True)
    if spec["master_port"]:
        remove_shm_buffers(spec["master_port"])
    else:
        remove_stale_shm_buffers()
