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


def start_guard(owner_pid, process_groups):
    """A process, in a session of its own, that kills `process_groups` if `owner_pid` dies without doing it (even by
    SIGKILL, when no code of the owner can run). The owner kills the guard when it has stopped them itself."""
    return subprocess.Popen([sys.executable, "-m", "dslab.launch", "guard", str(owner_pid), *map(str, process_groups)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _guard(owner_pid, process_groups, poll=0.2, grace=3.0):
    """The guard's loop: wait for the owner to vanish, then SIGTERM the groups, and SIGKILL what is left."""
    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:   # a zombie (dead, not yet reaped) counts as gone
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    while alive(owner_pid):
        time.sleep(poll)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
        for group in process_groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        time.sleep(wait)


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


def encode_value(value):
    """A Python value as one command-line word for dslab.dist.recipe_args: strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


_encode = encode_value


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
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars, once per rank
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


def _collect_results(result_dir, world_size):
    results = []
    for r in range(world_size):
        path = Path(result_dir) / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def _fresh_run_dir(name, run_dir):
    run_dir = Path(run_dir or os.environ.get("DSLAB_RUNS_DIR", "runs")) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    log_dir, result_dir = run_dir / "logs", run_dir / "results"
    log_dir.mkdir(parents=True)
    result_dir.mkdir()
    return run_dir, log_dir, result_dir


def _supervise(name, commands, envs, log_dir, world_size, show, timeout, line_rank=None):
    """Start one launcher process per command (one per node), follow every rank's output, and stop them all as
    soon as one fails, times out or is interrupted. Returns (rank_logs, launcher outputs, return codes).

    Rank output comes from the per-rank log files the deepspeed launcher writes into `log_dir`
    (--enable_each_rank_log), or, for launchers that prefix it on their own stdout (torchrun --tee), from
    `line_rank(node, line) -> (rank, text) or None`.
    """
    outputs, stdout_ranks = [[] for _ in commands], {}

    def read(i, proc):
        for line in proc.stdout:
            outputs[i].append(line)
            found = line_rank(i, line.rstrip("\n")) if line_rank else None
            if found is not None:
                rank, text = found
                stdout_ranks.setdefault(rank, []).append(text + "\n")
                show(rank, text)

    # Own session per launcher: one killpg reaches it and all its ranks, and a notebook interrupt too. Being in
    # another session, it would outlive us if we were killed (kill -9, a lost terminal, a scheduler), and the
    # deepspeed launcher does not stop its ranks when it is killed: a guard process does it then.
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, env in zip(commands, envs)]
    guard = start_guard(os.getpid(), [p.pid for p in procs])
    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for r in readers:
        r.start()
    tailer = _Tailer(str(log_dir), show)
    tailer.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        # Wait until all launchers end, or one fails: then the others (other nodes) would wait for it forever.
        while True:
            codes = [p.poll() for p in procs]  # poll every launcher: a failed one ends the wait
            if all(c is not None for c in codes) or any(codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"{name} did not finish within {timeout} s; all ranks were stopped")
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill_group(p)  # a rank that outlived its launcher must not linger
        guard.kill()
        guard.wait()
        tailer.stop.set()
        tailer.join()
        for r in readers:
            r.join(timeout=5)
        remove_stale_shm_buffers()
    rank_logs = {_rank_of(p): _TORCH_PREFIX.sub("", Path(p).read_text(errors="replace"))
                 for p in glob.glob(str(Path(log_dir) / "*_rank*.log"))}
    rank_logs.update({r: "".join(lines) for r, lines in stdout_ranks.items()})
    return rank_logs, ["".join(o) for o in outputs], [p.returncode for p in procs]


def _raise_failure(name, world_size, rank_logs, outputs, codes, log_dir):
    # a launcher that exited with a status failed by itself; a negative one was stopped by a signal (ours, after
    # another node failed, or someone else's)
    failed = next((i for i, c in enumerate(codes) if c and c > 0), next(i for i, c in enumerate(codes) if c))
    code = codes[failed]
    rank, trace = _failing_rank(rank_logs)
    where = f"rank {rank} failed" if rank is not None else "the launcher failed"
    if len(codes) > 1:
        where += f" (node {failed})"
    if code > 128:  # the launcher passes on a rank's -signal as 256 - signal
        try:
            where += f" (killed by {signal.Signals(256 - code).name})"
        except ValueError:
            pass
    detail = trace or (_log_tails(rank_logs) + "\n--- launcher ---\n" + outputs[failed][-2000:])
    raise LaunchError(f"{name} on {world_size} ranks: {where} (exit status {code}); "
                      f"all ranks were stopped. Per-rank logs: {log_dir}\n{detail}")


def _shower(stream, prefix=True):
    def show(rank, line):
        if stream is False or (stream != "all" and _NOISE.search(line)):
            return
        print(f"[rank{rank}] {line}" if prefix else line, flush=True)
    return show


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
    run_dir, log_dir, result_dir = _fresh_run_dir(name, run_dir)
    args = list(script_args)
    for key, value in recipe_kwargs.items():
        args += [f"--{key}", _encode(value)]
    port = free_port(master_port)
    if master_port and port != master_port:
        print(f"master port {master_port} is in use; using {port} instead")
    cmd = build_command(recipe, world_size, port, log_dir, include, args)
    print("$ " + display_command(cmd), flush=True)
    env = _rank_env(world_size, result_dir.resolve())
    rank_logs, outputs, codes = _supervise(name, [cmd], [env], log_dir, world_size,
                                           _shower(stream, prefix=world_size > 1), timeout)
    log = outputs[0] + "".join(f"\n===== rank {r} =====\n{t}" for r, t in sorted(rank_logs.items()))
    if codes[0] != 0:
        _raise_failure(name, world_size, rank_logs, outputs, codes, log_dir)
    return LaunchResult(command=cmd, returncode=0, results=_collect_results(result_dir, world_size), log=log,
                        run_dir=str(run_dir))


# ----------------------------------------------------------------------------------------------------
# Command lines as a learner types them: `deepspeed ... train.py ...`, `torchrun ... train.py ...`
# ----------------------------------------------------------------------------------------------------
LAUNCHERS = ("deepspeed", "torchrun")
_TORCHRUN_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")  # what `torchrun --tee 3` prefixes each rank's line with


def _split_command(command):
    """(env assignments, argv) of a command line such as "LOCAL_SIZE=1 torchrun --nnodes 2 ... train.py"."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    if not argv or argv[0] not in LAUNCHERS:
        raise LaunchError(f"{command!r}: start the command with one of {', '.join(LAUNCHERS)} "
                          "(environment assignments such as LOCAL_SIZE=1 may come first)")
    return env, argv


def _has_option(argv, *names):
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _option(argv, names, default=None):
    """The value of the first of `names` in argv (`--opt v` or `--opt=v`), else default."""
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return default


def _script_index(argv):
    """Index of the training script in a launcher argv: the first argument ending in .py, else the last option's
    value plus one (scripts run with -m / --module are found by the module name)."""
    for i, a in enumerate(argv[1:], 1):
        if a.endswith(".py") or (argv[i - 1] in ("-m", "--module") and not a.startswith("-")):
            return i
    raise LaunchError(f"no training script (*.py) in {shlex.join(argv)!r}")


def _deepspeed_layout(argv):
    """(world size, processes on this node) of a `deepspeed` command, resolved by DeepSpeed's own runner code."""
    from deepspeed.launcher import runner

    args = runner.parse_args(argv[1:])  # the launcher's own options and defaults
    pool = runner.fetch_hostfile(args.hostfile) if _has_option(argv, "--hostfile", "-H") else None
    if not pool:
        if args.num_nodes > 1:
            raise LaunchError("--num_nodes > 1 needs a --hostfile that lists the nodes")
        slots = args.num_gpus if args.num_gpus > 0 else (_gpu_count() or 1)
        pool = {"localhost": slots}
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    world = sum(len(v) for v in active.values())
    node = list(active)[args.node_rank] if args.no_ssh else list(active)[0]
    return world, len(active[node])


def _torchrun_layout(argv):
    nnodes = int(str(_option(argv, ("--nnodes",), "1")).split(":")[-1])
    nproc = int(_option(argv, ("--nproc_per_node", "--nproc-per-node"), "1"))
    node_rank = int(_option(argv, ("--node_rank", "--node-rank"), "0"))
    return nnodes * nproc, nproc, node_rank


def run_commands(commands, timeout=None, stream=None, run_dir=None, name=None):
    """Run launcher command lines exactly as typed, one per node, and return a LaunchResult.

    Each command is `deepspeed ...` or `torchrun ...` (on CPU the ranks use gloo), optionally preceded by
    environment assignments. Several commands are the nodes of one job, started together on this machine
    (`deepspeed --hostfile H --no_ssh --node_rank=i ...`, `torchrun --nnodes 2 --node_rank i ...`). Added where
    missing, before the script: `--master_port` with a free port (the default, 29500, may belong to another job
    here), and, so that each rank's output can be shown under its rank, `--enable_each_rank_log DIR` (deepspeed)
    or `--tee 3` (torchrun). The command printed is the one that runs. Ranks that call
    dslab.dist.save_result leave results (LaunchResult.results); if a node fails, every node is stopped
    and LaunchError names the rank that failed first, with its traceback.
    """
    commands = [commands] if isinstance(commands, str) else list(commands)
    remove_stale_shm_buffers()
    parsed = [_split_command(c) for c in commands]
    name = name or Path(parsed[0][1][_script_index(parsed[0][1])]).stem
    run_dir, log_dir, result_dir = _fresh_run_dir(name, run_dir)
    argvs, layouts = [], []
    for env, argv in parsed:
        at = _script_index(argv)
        if argv[at - 1] in ("-m", "--module"):  # launcher options go before the flag that names the module
            at -= 1
        if not _has_option(argv[:at], "--master_port", "--master-port", "--rdzv-endpoint", "--rdzv_endpoint"):
            # 29500, the default, may be taken by another job on this machine: its ranks would meet ours
            argv = argv[:at] + ["--master_port", str(free_port())] + argv[at:]
            at += 2
        if argv[0] == "deepspeed":
            if not _has_option(argv[:at], "--enable_each_rank_log"):
                argv = argv[:at] + ["--enable_each_rank_log", str(log_dir)] + argv[at:]
            world, local = _deepspeed_layout(argv)
            layouts.append((world, local, None))
        else:
            if not _has_option(argv[:at], "--tee", "-t"):
                argv = argv[:at] + ["--tee", "3"] + argv[at:]
            world, local, node_rank = _torchrun_layout(argv[:_script_index(argv)])
            layouts.append((world, local, node_rank))
        argvs.append(argv)
    world_size = layouts[0][0]
    here = sum(local for _, local, _ in layouts)  # processes sharing this machine's cores
    for node, ((env, _), argv) in enumerate(zip(parsed, argvs)):
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        if len(argvs) > 1:
            print(f"# node {node}", flush=True)
        print("$ " + (shown + " " if shown else "") + shlex.join(argv), flush=True)
    tools = Path(sys.executable).parent  # this environment's launchers, so the ranks use the same Python
    envs = []
    for env, _ in parsed:
        full = _rank_env(here, result_dir.resolve())
        full["PATH"] = f"{tools}{os.pathsep}{full.get('PATH', '')}"
        full.update(env)
        envs.append(full)
    run_argvs = [[str(tools / a[0]) if (tools / a[0]).exists() else a[0]] + a[1:] for a in argvs]

    def line_rank(node, line):
        world, local, node_rank = layouts[node]
        match = _TORCHRUN_LINE.match(line) if node_rank is not None else None
        return (node_rank * local + int(match.group(1)), match.group(2)) if match else None

    rank_logs, outputs, codes = _supervise(name, run_argvs, envs, log_dir, world_size, _shower(stream), timeout,
                                           line_rank)
    log = "".join(f"\n===== node {i} =====\n{o}" for i, o in enumerate(outputs))
    log += "".join(f"\n===== rank {r} =====\n{t}" for r, t in sorted(rank_logs.items()))
    if any(codes):
        _raise_failure(name, world_size, rank_logs, outputs, codes, log_dir)
    return LaunchResult(command=argvs, returncode=0, results=_collect_results(result_dir, world_size), log=log,
                        run_dir=str(run_dir))


def sh(command, check=True, env=None, show=True):
    """Run a command line (split like a shell would, but no shell runs it: no pipes or globs) with this
    environment's tools (dslab, deepspeed, torchrun, accelerate) first on PATH; print `$ command`, then its
    output (stdout, then stderr; DeepSpeed's own log lines left out; show=False: only the command).
    Returns the CompletedProcess, with the whole output."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    full_env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    full_env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    print(f"$ {command}", flush=True)
    proc = subprocess.run(shlex.split(command), env=full_env, capture_output=True, text=True)
    out = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not _NOISE.search(line))
    if show and out.strip():
        print(out.rstrip())
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed with exit status {proc.returncode}: {command}")
    return proc


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


if __name__ == "__main__" and sys.argv[1:2] == ["guard"]:
    _guard(int(sys.argv[2]), [int(g) for g in sys.argv[3:]])
