"""Live ranks: N rank processes a notebook keeps for a whole chapter and drives with %%px cells.

`ranks = live.start(world_size=2)` starts an ipyparallel cluster (one controller, `world_size` engines);
engine i is rank i, with the environment a launcher would give it (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_SIZE, MASTER_ADDR, MASTER_PORT), so `deepspeed.init_distributed()` typed in a %%px cell joins a real
process group. A %%px cell runs on every rank and shows each rank's output under the cell, in rank order;
ordinary cells inspect the ranks with `ranks.pull("name")` and `ranks.apply(fn)`.

The ranks stop at `ranks.stop()`, when the kernel exits, and when the kernel dies without exiting
(killed, or restarted from the notebook): dslab.launch's guard process waits for the kernel to disappear
and then stops the controller and the engines (the same guard that stops launched jobs).

`live.start(world_size=2, hang_timeout=S)` also watches the ranks while a cell runs on them: if none makes progress
for S seconds (dslab.hangs.watcher), every rank's stack and the collective it waits in are printed under the cell,
kept in `ranks.hang_report`, and the ranks are stopped (a rank blocked in a collective cannot be woken).
"""
import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import types

import psutil

from dslab.hangs import watcher
from dslab.launch import free_port, remove_shm_buffers, remove_stale_shm_buffers
from dslab.launch.guard import process_tree, processes_with_env, start_guard, stop_processes
from dslab.machine import ensure_build_tools_on_path, threads_per_rank

MASTER_ADDR = "127.0.0.1"   # all ranks on this machine: rank 0's store listens on loopback
# ipyparallel gives every process of a cluster (controller, engines, their helpers) this variable; each dslab cluster
# has a profile directory of its own, so its value marks this cluster's processes, whoever their parent is now.
PROFILE_ENV = "IPP_PROFILE_DIR"
# Engines ignore SIGTERM once torch is loaded, so the grace is short: they have nothing left to save.
STOP_GRACE_S = 0.5
_running = None          # the Ranks of this process, if any: live.start is idempotent within a kernel


def _engine_environment(world_size):
    """Variables every engine starts with (the same on all; the rank-specific ones are set once it is up)."""
    threads = str(threads_per_rank(world_size))  # the cores this process may use (affinity, CPU quota), shared out
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
    from dslab import this_rank
    from dslab.this_rank import silenced

    this_rank.quiet()
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

    def __init__(self, cluster, client, world_size, master_port, pids, profile_dir, guard):
        self._cluster, self._client = cluster, client
        self.world_size, self.master_port = world_size, master_port
        self.pids = pids                    # {"controller": pid, "engines": [pid of rank 0, rank 1, ...]}
        self.profile_dir = profile_dir      # this cluster's own: see cluster_processes
        self._guard = guard                # stops the cluster if this process dies first
        self.view = client[list(range(world_size))]   # engine ids 0..N-1, in rank order
        self.view.block = True
        self.stopped = False
        self.hang_report = None             # set if the hang watch (start(hang_timeout=...)) stopped the ranks
        self._stop_lock = threading.Lock()  # the hang watch may stop the ranks from its own thread
        self._hang_watch = None

    def __repr__(self):
        # No port or pid here: a notebook that shows the ranks must show the same text on every run.
        return f"<{self.world_size} live ranks{' (stopped)' if self.stopped else ''}>"

    def _check_running(self):
        if self.stopped:
            why = " after a hang (see ranks.hang_report)" if self.hang_report else ""
            raise RuntimeError(f"these ranks were stopped{why}; start new ones with dslab.live.start(world_size=...)")

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
        result = self.view.apply_async(_by_code(fn), *args, **kwargs)
        while not result.wait(0.2):
            if self.hang_report:   # the ranks hung and were stopped: the report was printed above
                raise RuntimeError("no rank made progress: the ranks were stopped (report in ranks.hang_report)")
        return list(result.get())

    def apply_async(self, fn, *args, **kwargs):
        """Like apply, without waiting: returns ipyparallel's AsyncResult (`.get(timeout)` -> list in rank order)."""
        self._check_running()
        args, kwargs = [_by_code(a) for a in args], {k: _by_code(v) for k, v in kwargs.items()}
        return self.view.apply_async(_by_code(fn), *args, **kwargs)

    def processes(self):
        """This cluster's processes that still run (psutil.Process objects); [] once stopped."""
        return cluster_processes(self.profile_dir)

    def watch_hangs(self, hang_timeout):
        """While a cell or apply runs on the ranks, stop them if none makes progress for hang_timeout s (see start)."""
        if self._hang_watch is not None:
            self._hang_watch.stop.set()
        def engines():
            return {rank: process_tree([pid]) for rank, pid in enumerate(self.pids["engines"])}

        def printed():   # what the running tasks printed so far, as the client has received it
            metadata = self._client.metadata
            return sum(len(metadata[m]["stdout"]) + len(metadata[m]["stderr"])
                       for m in list(self._client.outstanding) if m in metadata)

        self._hang_watch = watcher.watch_in_background(hang_timeout, engines, lambda: bool(self._client.outstanding),
                                                       printed, self._stop_hung, "the live ranks")

    def _stop_hung(self, report):
        self.hang_report = report
        print(report + "\nThe ranks were stopped: start new ones with dslab.live.start(world_size=...).",
              file=sys.stderr, flush=True)
        # The engines only: each engine's nanny (its child) sees it die and tells the controller at once, so a %%px
        # cell waiting for them fails within a second instead of when the heartbeat gives up (about 30 s). Only
        # then may the client close, or that cell would wait for a reply forever; stop() ends the nannies.
        stop_processes([], [p for p in process_tree(self.pids["engines"]) if not _is_nanny(p)], STOP_GRACE_S)
        deadline = time.monotonic() + 120
        while self._client.outstanding and time.monotonic() < deadline:
            time.sleep(0.5)
        if not self._client.outstanding:
            self.stop()

    def stop(self):
        """Stop the engines and the controller (idempotent); free DeepSpeed's shared-memory buffers."""
        global _running
        with self._stop_lock:
            if self.stopped:
                return
            self.stopped = True
        if self._hang_watch is not None:
            self._hang_watch.stop.set()
        if _running is self:
            _running = None
        leaders = [self.pids["controller"], *self.pids["engines"]]
        procs = _cluster_tree(leaders, self.profile_dir)
        try:
            # Leave the process group first: a gloo group torn down by a signal can leave a rank hanging.
            self.view.apply_async(_leave_process_group).wait(5)
        except Exception:
            pass
        try:
            self._client.close(linger=0)
        except Exception:
            pass
        stop_processes(leaders, procs, STOP_GRACE_S)
        if self._guard.poll() is None:
            self._guard.kill()
            self._guard.wait()
        shutil.rmtree(self.profile_dir, ignore_errors=True)
        # DeepSpeed's CPU all-reduce maps a buffer per rank in /dev/shm and never unlinks it.
        remove_shm_buffers(self.master_port)


def _is_nanny(proc):
    """True for an engine's nanny: the ipyparallel helper that reports its engine's exit to the controller."""
    try:
        return "ipyparallel.engine.nanny" in proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def cluster_processes(profile_dir):
    """The live processes (controller, engines and their helpers) of the cluster kept in `profile_dir`."""
    return processes_with_env(PROFILE_ENV, profile_dir)


def _cluster_tree(leaders, profile_dir):
    """Every process of the cluster: below the leaders, and anywhere with its profile directory.

    Each engine and the controller lead their own process group (ipyparallel starts them in new sessions); an
    engine's "nanny" helper runs in yet another session, so it is found as a child, not by its group. Collect
    them before a leader exits: its children then have a new parent.
    """
    return process_tree(leaders) + cluster_processes(profile_dir)


def running():
    """The live ranks this process started and has not stopped, or None."""
    return _running if _running is not None and not _running.stopped else None


def start(world_size=2, timeout=300, hang_timeout=None):
    """Start `world_size` live ranks (engine i = rank i) and activate %%px; returns a Ranks.

    Idempotent within a process: with ranks of this world_size already running it returns them;
    running ranks of another size are stopped first. timeout: seconds the engines may take to come up
    (they import torch and DeepSpeed: slow on a busy machine). hang_timeout: see the module's docstring.
    """
    global _running
    if hang_timeout is not None and (problem := watcher.unready(hang_timeout)):
        raise ValueError(problem)
    if running() is not None:
        if _running.world_size == world_size:
            if hang_timeout is not None:
                _running.watch_hangs(hang_timeout)
            return _running
        _running.stop()
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    import ipyparallel as ipp

    remove_stale_shm_buffers()
    ensure_build_tools_on_path()  # inherited by the engines: one ninja builds DeepSpeed's ops
    master_port = free_port()
    # A private profile directory per cluster: its connection files and engine logs are this cluster's only, and its
    # path, in every cluster process's environment, marks them for the guard, started before any of them.
    profile_dir = tempfile.mkdtemp(prefix="dslab-live-")
    guard = start_guard(marker=(PROFILE_ENV, profile_dir), remove=[profile_dir], master_port=master_port)
    pids = None
    try:
        cluster = ipp.Cluster(n=world_size, profile_dir=profile_dir, load_profile=False, shutdown_atexit=False,
                              log_level=logging.ERROR, engine_timeout=timeout, delay=0.2)
        cluster.start_controller_sync()
        cluster.start_engines_sync(world_size, environment=_engine_environment(world_size))
        pids = {"controller": cluster.controller.pid,
                "engines": [launcher.pid for launcher in cluster.engine_set.launchers.values()]}
        client = cluster.connect_client_sync()
        # interactive=False: no progress bar in the notebook's output.
        client.wait_for_engines(world_size, timeout=timeout, interactive=False)
        ranks = Ranks(cluster, client, world_size, master_port, pids, profile_dir, guard)
        threads = threads_per_rank(world_size)
        cwd = os.getcwd()
        engine_pids = [client[r].apply_async(_become_rank, r, world_size, MASTER_ADDR, master_port, cwd, threads)
                       for r in range(world_size)]
        ranks.pids["engines"] = [result.get(timeout) for result in engine_pids]   # in rank order
        _wait_for_output_path(ranks.view, timeout)
    except BaseException:
        leaders = [pids["controller"], *pids["engines"]] if pids else []
        stop_processes(leaders, _cluster_tree(leaders, profile_dir), STOP_GRACE_S)
        guard.kill()
        guard.wait()
        shutil.rmtree(profile_dir, ignore_errors=True)
        raise
    _running = ranks
    if hang_timeout is not None:
        ranks.watch_hangs(hang_timeout)
    _activate_magics(ranks.view)
    return ranks


def _wait_for_output_path(view, timeout):
    """Return once a cell run on every rank has its end of output seen here. A %%px cell's output is complete when
    each engine's "idle" message arrives over ZeroMQ publish/subscribe, which drops what is published before a
    subscription has reached the publisher; %%px --no-stream then waits for it forever (seen once on a loaded
    machine: the first %%px cell after start, its ranks long done). A lost probe costs nothing: another is sent."""
    deadline = time.monotonic() + timeout
    while True:
        probe = view.execute("pass", block=False)
        probe.get(timeout=max(1.0, deadline - time.monotonic()))
        if probe.wait_for_output(2):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks ran a cell, but the end of its output did not reach this process within "
                               f"{timeout} s")


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
