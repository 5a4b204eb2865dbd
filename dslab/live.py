"""Live ranks: N rank processes a notebook keeps for a whole chapter and drives with %%px cells.

`ranks = live.start(world_size=2)` starts an ipyparallel cluster (one controller, `world_size` engines);
engine i is rank i, with the environment a launcher would give it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_SIZE, MASTER_ADDR, MASTER_PORT), so `deepspeed.init_distributed()` typed in a %%px cell joins a real
process group. A %%px cell runs on every rank and shows each rank's output under the cell, in rank order;
ordinary cells inspect the ranks with `ranks.pull("name")` and `ranks.apply(fn)`.

The ranks stop at `ranks.stop()`, when the kernel exits, and when the kernel dies without exiting
(killed, or restarted from the notebook): a small watchdog process waits for the kernel to disappear
and then kills the controller and the engines.
"""
import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

from dslab.launch import free_port, remove_stale_shm_buffers

MASTER_ADDR = "127.0.0.1"   # all ranks on this machine: rank 0's store listens on loopback
_running = None          # the Ranks of this process, if any: live.start is idempotent within a kernel


def _threads_per_rank(world_size):
    """CPU threads each rank may use: the cores this process may run on, shared out among the ranks."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def _engine_environment(world_size):
    """Variables every engine starts with (the same on all; the rank-specific ones are set once it is up)."""
    threads = str(_threads_per_rank(world_size))
    return {
        # Read by OpenMP when torch loads, so they must be there before the engine imports anything.
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        # Idle OpenMP threads sleep instead of spinning: ranks share a few cores with the kernel.
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        "PYTHONWARNINGS": "ignore",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }


def _become_rank(rank, world_size, master_addr, master_port, cwd, threads):
    """Runs on engine `rank` once: give it a launcher's environment, the kernel's directory, quiet logs."""
    import os

    os.environ.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),            # one machine: the local rank is the rank (it picks cuda:LOCAL_RANK)
        "WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),      # DeepSpeed's CPU shared-memory all-reduce needs it
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    })
    os.chdir(cwd)                           # relative paths in a %%px cell mean what they mean in the notebook
    import torch

    torch.set_num_threads(threads)
    from dslab import dist
    from dslab.train import silenced

    dist.quiet()
    with silenced():
        # DeepSpeed probes which C++ ops can build the first time it is asked (deepspeed.init_distributed asks):
        # compiler runs whose errors (a failed `-laio` link test) would land in a learner's cell. Probe now, quietly.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__
    return os.getpid()


def _leave_process_group():
    """Runs on each engine before it stops: leave a torch.distributed group cleanly if one was joined."""
    import sys

    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def _importable_on_ranks(module_name):
    """True if the ranks can import this module by name: dslab itself, or anything installed in this Python."""
    import sysconfig

    if module_name == "dslab" or module_name.startswith("dslab."):
        return True
    module = sys.modules.get(module_name)
    path = os.path.realpath(getattr(module, "__file__", None) or "/nonexistent")
    installed = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("purelib", "platlib", "stdlib")}
    return any(path.startswith(folder + os.sep) for folder in installed)


def _by_code(fn):
    """fn as the ranks can rebuild it.

    ipyparallel sends a function's code and module name, and the receiving rank imports that module to
    rebuild it. A function from a notebook (module __main__), a test file or a script run by path lives in
    a module the ranks cannot import: send it as a __main__ function, so its free names are looked up in the
    ranks' own namespace (where %%px cells define them).
    """
    if not isinstance(fn, types.FunctionType) or fn.__module__ == "__main__" or _importable_on_ranks(fn.__module__ or ""):
        return fn
    rebuilt = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    rebuilt.__kwdefaults__ = fn.__kwdefaults__
    rebuilt.__module__ = "__main__"
    return rebuilt


class Ranks:
    """A running set of live ranks: pull/push variables, apply a function on every rank, stop them."""

    def __init__(self, cluster, client, world_size, master_port, pids, profile_dir, watchdog):
        self._cluster, self._client = cluster, client
        self.world_size, self.master_port = world_size, master_port
        self.pids = pids                    # {"controller": pid, "engines": [pid of rank 0, rank 1, ...]}
        self.profile_dir = profile_dir      # this cluster's own: see cluster_processes
        self._watchdog = watchdog
        self.view = client[list(range(world_size))]   # engine ids 0..N-1, in rank order
        self.view.block = True
        self.stopped = False

    def __repr__(self):
        # No port or pid here: a notebook that shows the ranks must show the same text on every run.
        return f"<{self.world_size} live ranks{' (stopped)' if self.stopped else ''}>"

    def _check_running(self):
        if self.stopped:
            raise RuntimeError("these ranks were stopped; start new ones with dslab.live.start(world_size=...)")

    def pull(self, name):
        """The value of variable `name` on every rank, as a list in rank order (values must be picklable)."""
        self._check_running()
        return list(self.view.pull(name, block=True))

    def push(self, variables):
        """Set variables (a dict name -> value) on every rank."""
        self._check_running()
        self.view.push(dict(variables), block=True)

    def apply(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) run on every rank; the results as a list in rank order.

        fn (and any function passed as an argument) travels by its code only: it must import what it uses
        inside its body (the kernel's modules are not on the ranks); names it does not define are looked up
        in the ranks' %%px namespace.
        """
        self._check_running()
        args, kwargs = [_by_code(a) for a in args], {k: _by_code(v) for k, v in kwargs.items()}
        return list(self.view.apply_sync(_by_code(fn), *args, **kwargs))

    def apply_async(self, fn, *args, **kwargs):
        """Like apply, without waiting: returns ipyparallel's AsyncResult (`.get(timeout)` -> list in rank order)."""
        self._check_running()
        args, kwargs = [_by_code(a) for a in args], {k: _by_code(v) for k, v in kwargs.items()}
        return self.view.apply_async(_by_code(fn), *args, **kwargs)

    def processes(self):
        """This cluster's processes that still run (psutil.Process objects); [] once stopped."""
        return cluster_processes(self.profile_dir)

    def stop(self):
        """Stop the engines and the controller (idempotent); free DeepSpeed's shared-memory buffers."""
        global _running
        if self.stopped:
            return
        self.stopped = True
        if _running is self:
            _running = None
        leaders = [self.pids["controller"], *self.pids["engines"]]
        procs = _process_tree(leaders) + cluster_processes(self.profile_dir)
        try:
            # Leave the process group first: a gloo group torn down by a signal can leave a rank hanging.
            self.view.apply_async(_leave_process_group).wait(5)
        except Exception:
            pass
        try:
            self._client.close(linger=0)
        except Exception:
            pass
        _kill_trees(leaders, procs)
        if self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait()
        shutil.rmtree(self.profile_dir, ignore_errors=True)
        # DeepSpeed's CPU all-reduce maps a buffer per rank in /dev/shm and never unlinks it.
        _remove_shm_buffers(self.master_port)


def cluster_processes(profile_dir):
    """The live processes (controller, engines and their helpers) of the cluster kept in `profile_dir`.

    ipyparallel gives every process of a cluster IPP_PROFILE_DIR in its environment, and each dslab cluster
    has a profile directory of its own, so this finds them all, whoever their parent is now.
    """
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("IPP_PROFILE_DIR") == profile_dir and _alive(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _process_tree(leaders):
    """The leaders and every process below them (psutil.Process objects), as they are now."""
    import psutil

    procs = []
    for pid in leaders:
        try:
            leader = psutil.Process(pid)
            procs += [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def _kill_trees(leaders, procs=None, grace=0.5):
    """SIGTERM, then SIGKILL after `grace` s, each leader's process group and every process below it.

    Each engine and the controller lead their own process group (ipyparallel starts them in new sessions);
    an engine's "nanny" helper runs in yet another session, so it is found as a child, not by its group.
    Pass `procs` collected earlier when a leader may already have exited (its children then have a new parent).
    Engines ignore SIGTERM once torch is loaded, so the grace is short: they have nothing left to save.
    """
    import psutil

    procs = _process_tree(leaders) if procs is None else procs

    def signal_all(sig):
        for pid in leaders:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in procs:
            try:
                proc.send_signal(sig)   # psutil checks the process is still the one it found (no pid reuse)
            except psutil.NoSuchProcess:
                pass

    signal_all(signal.SIGTERM)
    if not _wait_gone(procs, grace):
        signal_all(signal.SIGKILL)
        _wait_gone(procs, grace)


def _alive(proc):
    """True while proc runs; a zombie (dead, waiting for its parent to collect it) counts as gone."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs, timeout):
    """Wait up to `timeout` s for every process in procs to end; True if they all did."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _remove_shm_buffers(master_port):
    """Delete the /dev/shm all-reduce buffers of this job (its ranks are gone), then any other stale ones."""
    import glob

    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{master_port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass
    remove_stale_shm_buffers()


def running():
    """The live ranks this process started and has not stopped, or None."""
    return _running if _running is not None and not _running.stopped else None


def start(world_size=2, timeout=300):
    """Start `world_size` live ranks (engine i = rank i) and activate %%px; returns a Ranks.

    Idempotent within a process: with ranks of this world_size already running it returns them;
    running ranks of another size are stopped first. timeout: seconds the engines may take to come up
    (they import torch and DeepSpeed: slow on a busy machine).
    """
    global _running
    if running() is not None:
        if _running.world_size == world_size:
            return _running
        _running.stop()
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    import ipyparallel as ipp

    remove_stale_shm_buffers()
    master_port = free_port()
    # A private profile directory per cluster: its connection files and engine logs are this cluster's only.
    profile_dir = tempfile.mkdtemp(prefix="dslab-live-")
    cluster = ipp.Cluster(n=world_size, profile_dir=profile_dir, load_profile=False, shutdown_atexit=False,
                          log_level=logging.ERROR, engine_timeout=timeout, delay=0.2)
    cluster.start_controller_sync()
    cluster.start_engines_sync(world_size, environment=_engine_environment(world_size))
    pids = {"controller": cluster.controller.pid,
            "engines": [launcher.pid for launcher in cluster.engine_set.launchers.values()]}
    # From here on the processes exist: the watchdog must be running before anything can fail.
    watchdog = _start_watchdog(os.getpid(), master_port, [pids["controller"], *pids["engines"]], profile_dir)
    try:
        client = cluster.connect_client_sync()
        # interactive=False: no progress bar in the notebook's output.
        client.wait_for_engines(world_size, timeout=timeout, interactive=False)
        ranks = Ranks(cluster, client, world_size, master_port, pids, profile_dir, watchdog)
        threads = _threads_per_rank(world_size)
        cwd = os.getcwd()
        engine_pids = [client[r].apply_async(_become_rank, r, world_size, MASTER_ADDR, master_port, cwd, threads)
                       for r in range(world_size)]
        ranks.pids["engines"] = [result.get(timeout) for result in engine_pids]   # in rank order
    except BaseException:
        _kill_trees([pids["controller"], *pids["engines"]])
        watchdog.kill()
        watchdog.wait()
        shutil.rmtree(profile_dir, ignore_errors=True)
        raise
    _running = ranks
    _activate_magics(ranks.view)
    return ranks


def _activate_magics(view):
    """%%px / %px on all ranks, output shown once the cell is done, grouped by rank in rank order."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return  # plain Python (a test, a script): pull/push/apply still work
    view.activate()
    # --no-stream: each rank's output arrives whole, [stdout:0] before [stdout:1], instead of interleaved
    # as it happens; --progress-after -1: no progress bar for long cells (it would differ run to run).
    shell.run_line_magic("pxconfig", "--no-stream --progress-after -1")


@atexit.register
def _stop_at_exit():
    if running() is not None:
        _running.stop()


# ---- the watchdog: stops the ranks when the process that started them dies without stopping them ----

def _start_watchdog(owner_pid, master_port, group_leaders, profile_dir):
    """A process, in its own session (so killing the kernel's group spares it), that outlives the kernel."""
    args = [sys.executable, "-m", "dslab.live", "watch", str(owner_pid), str(master_port), profile_dir,
            *map(str, group_leaders)]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _watch(owner_pid, master_port, profile_dir, group_leaders, poll=0.5):
    """Wait until owner_pid has gone, then kill the ranks' process groups and clean up after them."""
    import psutil

    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        owner = None
    while owner is not None and _alive(owner):
        time.sleep(poll)
    _kill_trees(group_leaders, _process_tree(group_leaders) + cluster_processes(profile_dir))
    shutil.rmtree(profile_dir, ignore_errors=True)
    _remove_shm_buffers(master_port)


if __name__ == "__main__" and sys.argv[1:2] == ["watch"]:
    _watch(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], [int(pid) for pid in sys.argv[5:]])
