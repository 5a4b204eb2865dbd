"""Run a script on N ranks through the real `deepspeed` launcher, stream its output, collect per-rank results."""
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dslab.dist import RESULT_DIR_ENV

RECIPES_DIR = Path(__file__).parent / "recipes"
# Lines DeepSpeed's own logger writes ("[2026-01-01 10:00:00,123] [INFO] [launch.py:...] ...") and the
# JIT-build chatter: kept in the log, hidden from the learner unless stream="all".
_NOISE = re.compile(
    r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING|DEBUG)\]"
    r"|^DeepSpeed deepspeed\.ops\.\S+ built successfully"
    r"|^(Using|Emitting ninja|Building extension|Loading extension|Detected CUDA|ninja: no work)"
    r"|^\[\d+/\d+\] "
    r"|^Time to load \S+ op:"
)


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


def port_is_free(port, host="127.0.0.1"):
    """True if nothing listens on host:port (the rendezvous store needs it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred=None):
    """`preferred` if it is free, else a port the kernel says is unused."""
    if preferred and port_is_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count():
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _deepspeed_executable():
    # The launcher script installed beside this interpreter, so the ranks use the same environment.
    local = Path(sys.executable).parent / "deepspeed"
    return str(local) if local.exists() else (shutil.which("deepspeed") or "deepspeed")


def _encode(value):
    if isinstance(value, str):
        return value
    return json.dumps(value)


def build_command(recipe, world_size, master_port, log_dir, include=None, args=()):
    """The argv of a `deepspeed` launch of `recipe` (a dslab.recipes name or a script path)."""
    cmd = [_deepspeed_executable()]
    if include:
        cmd += ["--include", include]  # the launcher's way to choose GPUs (not CUDA_VISIBLE_DEVICES)
    else:
        cmd += ["--num_gpus", str(world_size)]
    cmd += ["--master_port", str(master_port), "--enable_each_rank_log", str(log_dir), "--no_local_rank"]
    if (RECIPES_DIR / f"{recipe}.py").exists():
        cmd += ["--module", f"dslab.recipes.{recipe}"]
    else:
        script = Path(recipe)
        if not script.is_file():
            known = sorted(p.stem for p in RECIPES_DIR.glob("[!_]*.py"))
            raise LaunchError(f"{recipe!r} is neither a dslab recipe ({', '.join(known)}) nor a script file")
        cmd.append(str(script))
    return cmd + list(args)


def display_command(cmd):
    """The command as a learner would type it (launcher name instead of its full path)."""
    return shlex.join(["deepspeed"] + cmd[1:])


def _check_environment(world_size, include):
    if world_size < 1:
        raise LaunchError(f"world_size must be at least 1, got {world_size}")
    if os.environ.get("CUDA_VISIBLE_DEVICES") and not include and _gpu_count():
        raise LaunchError(
            "CUDA_VISIBLE_DEVICES is set, but the deepspeed launcher chooses GPUs itself and overrides it. "
            "Unset it and pass include='localhost:0,1' (CLI: --include localhost:0,1) to pick GPUs."
        )
    gpus = _gpu_count()
    if gpus and not include and world_size > gpus:
        raise LaunchError(f"world_size={world_size} but only {gpus} GPU(s) are visible; use world_size<={gpus}")


def _rank_env(world_size, result_dir):
    env = dict(os.environ)
    env[RESULT_DIR_ENV] = str(result_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONWARNINGS", "ignore")
    if not _gpu_count():
        # CPU ranks share the cores: one rank per core slice, or they oversubscribe and crawl.
        cores = len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(max(1, cores // world_size))
        # Idle OpenMP threads sleep instead of spinning, so ranks sharing cores don't steal each other's time.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.M)  # torch prefixes uncaught tracebacks itself


def _rank_of(path):
    return int(re.search(r"_rank(\d+)\.log$", path).group(1))


class _Tailer(threading.Thread):
    """Follows the per-rank log files the launcher writes and echoes new lines with a rank prefix."""

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
            text = _TORCH_PREFIX.sub("", complete.decode("utf-8", "replace"))
            for line in text.splitlines():
                self.show(_rank_of(path), line)

    def run(self):
        while not self.stop.is_set():
            self.poll()
            time.sleep(0.2)
        self.poll()


def _kill_group(proc):
    """Stop the launcher and every rank it started (they share one process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            time.sleep(0.2)
        except subprocess.TimeoutExpired:
            pass


def remove_stale_shm_buffers():
    """Delete the shared-memory all-reduce buffers that finished jobs left in /dev/shm.

    DeepSpeed's CPU backend maps a ~70 MB file per rank, named after the master port, and never
    unlinks it; a day of runs would fill /dev/shm (RAM) until jobs die. A buffer whose port nobody
    listens on any more belongs to a job that has ended (the rendezvous store holds the port while
    a job runs), so it is safe to remove.
    """
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        match = re.search(r"_(\d+)_\d+$", path)
        if match and port_is_free(int(match.group(1))):
            try:
                os.unlink(path)
            except OSError:
                pass


# How a rank fails when another rank died first: these are echoes, not causes.
_ECHO = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash|Broken pipe|"
                   r"DistNetworkError|DistBackendError|NCCL communicator was aborted|Socket Timeout|"
                   r"failed to recv, got 0 bytes", re.I)


def _failing_rank(rank_logs):
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


def run(recipe, world_size=2, timeout=None, stream=None, master_port=None, include=None, run_dir=None,
        script_args=(), **recipe_kwargs):
    """Run `recipe` on `world_size` ranks with the deepspeed launcher and return a LaunchResult.

    stream: None/"recipe" echoes what the ranks print (DeepSpeed's own log lines hidden), "all" echoes
    everything, False echoes nothing. recipe_kwargs become `--key value` arguments (JSON-encoded);
    script_args are passed through verbatim. Raises LaunchError, with the failing rank's traceback, on failure.
    """
    _check_environment(world_size, include)
    remove_stale_shm_buffers()
    name = Path(recipe).stem
    run_dir = Path(run_dir or os.environ.get("DSLAB_RUNS_DIR", "runs")) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    log_dir, result_dir = run_dir / "logs", run_dir / "results"
    log_dir.mkdir(parents=True)
    result_dir.mkdir()
    args = list(script_args)
    for key, value in recipe_kwargs.items():
        args += [f"--{key}", _encode(value)]
    port = free_port(master_port)
    if master_port and port != master_port:
        print(f"master port {master_port} is in use; using {port} instead")
    cmd = build_command(recipe, world_size, port, log_dir, include, args)
    print("$ " + display_command(cmd), flush=True)

    def show(rank, line):
        if stream is False or (stream != "all" and _NOISE.search(line)):
            return
        print(f"[rank{rank}] {line}" if world_size > 1 else line, flush=True)

    launcher_out = []
    # Own session: one killpg reaches the launcher and all ranks, and a notebook interrupt too.
    proc = subprocess.Popen(cmd, env=_rank_env(world_size, result_dir.resolve()), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reader = threading.Thread(target=lambda: launcher_out.extend(proc.stdout), daemon=True)
    reader.start()
    tailer = _Tailer(str(log_dir), show)
    tailer.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise LaunchError(f"{name} did not finish within {timeout} s; all ranks were stopped")
    except KeyboardInterrupt:
        _kill_group(proc)
        raise
    finally:
        tailer.stop.set()
        tailer.join()
        reader.join(timeout=5)
        _kill_group(proc)  # a rank that outlived the launcher must not linger
        remove_stale_shm_buffers()

    rank_logs = {_rank_of(p): _TORCH_PREFIX.sub("", Path(p).read_text(errors="replace")) for p in glob.glob(str(log_dir / "*_rank*.log"))}
    log = "".join(launcher_out) + "".join(f"\n===== rank {r} =====\n{t}" for r, t in sorted(rank_logs.items()))
    if proc.returncode != 0:
        rank, trace = _failing_rank(rank_logs)
        where = f"rank {rank} failed" if rank is not None else "the launcher failed"
        if proc.returncode > 128:  # the launcher passes on a rank's -signal as 256 - signal
            try:
                where += f" (killed by {signal.Signals(256 - proc.returncode).name})"
            except ValueError:
                pass
        detail = trace or (_log_tails(rank_logs) + "\n--- launcher ---\n" + "".join(launcher_out)[-2000:])
        raise LaunchError(f"{name} on {world_size} ranks: {where} (exit status {proc.returncode}); "
                          f"all ranks were stopped. Per-rank logs: {log_dir}\n{detail}")
    results = []
    for r in range(world_size):
        path = result_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return LaunchResult(command=cmd, returncode=0, results=results, log=log, run_dir=str(run_dir))


def _cli_launch(args):
    try:
        run(args.script, world_size=args.world_size, master_port=args.master_port, include=args.include,
            stream="all" if args.verbose else None, timeout=args.timeout, run_dir=args.run_dir,
            script_args=args.script_args)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def add_commands(subparsers):
    """`dslab launch`."""
    import argparse

    p = subparsers.add_parser("launch", help="run a script on N ranks through the deepspeed launcher")
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (processes)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (a free one if omitted or taken)")
    p.add_argument("--include", default=None, help="GPUs to use, deepspeed style: localhost:0,1")
    p.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many seconds")
    p.add_argument("--run-dir", default=None, help="where per-rank logs and results go (default ./runs)")
    p.add_argument("--verbose", action="store_true", help="also show DeepSpeed's own log lines")
    p.add_argument("script", help="a script path or a dslab recipe name")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="--key value pairs passed to the script")
    p.set_defaults(func=_cli_launch)
