"""Command lines as a learner types them: `deepspeed ... train.py ...`, `torchrun ... -m pkg.module ...`,
`accelerate launch --config_file X.yaml ...`, run as typed, one per node (run_commands); and any other command
through `sh`."""
import os
import re
import shlex
import subprocess
from pathlib import Path

from dslab.launch.guard import parent_death_signal
from dslab.launch.ports import free_port, remove_stale_shm_buffers
from dslab.launch.supervise import NOISE, LaunchError, fresh_run_dir, rank_environment, run_job, shower
from dslab.machine import TOOLS_DIR, gpu_count, tool
from dslab.messages import say

LAUNCHERS = ("deepspeed", "torchrun", "accelerate")
MODULE_FLAGS = ("-m", "--module")  # "run the script as a module": the next argument is its module name
_TORCHRUN_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")  # what `torchrun --tee 3` prefixes each rank's line with


def split_command(command):
    """(env assignments, argv) of a command line such as "LOCAL_SIZE=1 torchrun --nnodes 2 ... train.py"."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    if not argv or argv[0] not in LAUNCHERS:
        raise LaunchError(say("launch.no_launcher", command=command, launchers=", ".join(LAUNCHERS)))
    if argv[0] == "accelerate" and argv[1:2] != ["launch"]:
        raise LaunchError(say("launch.accelerate_launch", command=command))
    return env, argv


def has_option(argv, *names):
    """True if argv holds one of the options `names` (`--opt v` or `--opt=v`)."""
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def option_value(argv, names, default=None):
    """The value of the first of `names` in argv (`--opt v` or `--opt=v`), else default."""
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return default


def script_position(argv):
    """Where the launcher's own options end in a launcher argv: at the training script (the first argument ending in
    .py) or at the -m/--module flag that names it as a module. Options dslab adds go there; what follows belongs
    to the script."""
    for i, a in enumerate(argv[1:], 1):
        if a.endswith(".py") or (a in MODULE_FLAGS and i + 1 < len(argv)):
            return i
    raise LaunchError(say("launch.no_script", command=shlex.join(argv)))


def script_name(argv):
    """The name of the script a launcher argv runs: the file's stem, or the last part of the module name."""
    at = script_position(argv)
    if argv[at] in MODULE_FLAGS:
        return argv[at + 1].rsplit(".", 1)[-1]
    return Path(argv[at]).stem


def deepspeed_layout(argv):
    """(world size, processes on this node) of a `deepspeed` command, resolved by DeepSpeed's own runner code."""
    from deepspeed.launcher import runner

    args = runner.parse_args(argv[1:])  # the launcher's own options and defaults
    pool = runner.fetch_hostfile(args.hostfile) if has_option(argv, "--hostfile", "-H") else None
    if not pool:
        if args.num_nodes > 1:
            raise LaunchError(say("launch.hostfile"))
        slots = args.num_gpus if args.num_gpus > 0 else (gpu_count() or 1)
        pool = {"localhost": slots}
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    world = sum(len(v) for v in active.values())
    node = list(active)[args.node_rank] if args.no_ssh else list(active)[0]
    return world, len(active[node])


def torchrun_layout(options):
    """(world size, processes on this node, node rank) from a torchrun command's own options."""
    nnodes = int(str(option_value(options, ("--nnodes",), "1")).split(":")[-1])
    nproc = int(option_value(options, ("--nproc_per_node", "--nproc-per-node"), "1"))
    node_rank = int(option_value(options, ("--node_rank", "--node-rank"), "0"))
    return nnodes * nproc, nproc, node_rank


def accelerate_layout(options):
    """(world size, processes on this node, machine rank) of an `accelerate launch` command: its own options, else
    its --config_file (accelerate's num_processes counts every machine's processes)."""
    config = {}
    config_file = option_value(options, ("--config_file", "--config-file"))
    if config_file:
        import yaml

        config = yaml.safe_load(Path(config_file).read_text()) or {}
    world = int(option_value(options, ("--num_processes", "--num-processes"), config.get("num_processes", 1)))
    machines = int(option_value(options, ("--num_machines", "--num-machines"), config.get("num_machines", 1)))
    machine_rank = int(option_value(options, ("--machine_rank", "--machine-rank"), config.get("machine_rank", 0)))
    return world, world // machines, machine_rank


def run_commands(commands, timeout=None, stream=None, run_dir=None, name=None):
    """Run launcher command lines exactly as typed, one per node, and return a LaunchResult.

    Each command is `deepspeed ...`, `torchrun ...` or `accelerate launch ...` (on CPU the ranks use gloo;
    accelerate runs torchrun inside its own process), optionally preceded by environment assignments. Several
    commands are the nodes of one job, started together on this machine (`deepspeed --hostfile H --no_ssh
    --node_rank=i ...`, `torchrun --nnodes 2 --node_rank i ...`). Added where missing, before the script:
    `--master_port` (accelerate: `--main_process_port`) with a free port (the default, 29500, may belong to another
    job here), and, so that each rank's output can be shown under its rank, `--enable_each_rank_log DIR`
    (deepspeed) or `--tee 3` (torchrun, accelerate). The command printed is the one that runs. Ranks that call
    dslab.this_rank.save_rank_result leave results (LaunchResult.results); if a node fails, every node is stopped
    and LaunchError names the rank that failed first, with its traceback.
    """
    commands = [commands] if isinstance(commands, str) else list(commands)
    remove_stale_shm_buffers()
    parsed = [split_command(c) for c in commands]
    name = name or script_name(parsed[0][1])
    dirs = fresh_run_dir(name, run_dir)
    argvs, layouts = [], []
    for env, argv in parsed:
        at = script_position(argv)
        added = []
        port_options = ("--main_process_port",) if argv[0] == "accelerate" else ("--master_port", "--master-port")
        if not has_option(argv[:at], *port_options, "--rdzv-endpoint", "--rdzv_endpoint"):
            # 29500, the default, may be taken by another job on this machine: its ranks would meet ours
            added += [port_options[0], str(free_port())]
        if argv[0] == "deepspeed" and not has_option(argv[:at], "--enable_each_rank_log"):
            added += ["--enable_each_rank_log", str(dirs.logs)]
        if argv[0] in ("torchrun", "accelerate") and not has_option(argv[:at], "--tee", "-t"):
            added += ["--tee", "3"]
        argv = argv[:at] + added + argv[at:]
        if argv[0] == "deepspeed":
            layouts.append((*deepspeed_layout(argv), None))
        elif argv[0] == "accelerate":
            layouts.append(accelerate_layout(argv[:at + len(added)]))
        else:
            layouts.append(torchrun_layout(argv[:at + len(added)]))
        argvs.append(argv)
    world_size = layouts[0][0]
    here = sum(local for _, local, _ in layouts)  # processes sharing this machine's cores
    for node, ((env, _), argv) in enumerate(zip(parsed, argvs)):
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        if len(argvs) > 1:
            print(f"# node {node}", flush=True)
        print("$ " + (shown + " " if shown else "") + shlex.join(argv), flush=True)
    envs = []
    for env, _ in parsed:
        full = rank_environment(here, dirs.results.resolve())
        full["PATH"] = f"{TOOLS_DIR}{os.pathsep}{full.get('PATH', '')}"  # this environment's tools
        full.update(env)
        envs.append(full)

    def line_rank(node, line):
        _, local, node_rank = layouts[node]
        match = _TORCHRUN_LINE.match(line) if node_rank is not None else None
        return (node_rank * local + int(match.group(1)), match.group(2)) if match else None

    return run_job(name, [[tool(a[0])] + a[1:] for a in argvs], envs, dirs, world_size, shower(stream), timeout,
                   line_rank, command=argvs)


def sh(command, check=True, env=None, show=True):
    """Run a command line (split like a shell would, but no shell runs it: no pipes or globs) with this
    environment's tools (dslab, deepspeed, torchrun, accelerate) first on PATH; print `$ command`, then its
    output (stdout, then stderr; DeepSpeed's own log lines left out; show=False: only the command).
    Returns the CompletedProcess, with the whole output. The command ends if this process dies."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PATH"] = f"{TOOLS_DIR}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    full_env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    full_env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    print(f"$ {command}", flush=True)
    proc = subprocess.run(shlex.split(command), env=full_env, capture_output=True, text=True,
                          preexec_fn=parent_death_signal())
    out = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not NOISE.search(line))
    if show and out.strip():
        print(out.rstrip())
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed with exit status {proc.returncode}: {command}")
    return proc
