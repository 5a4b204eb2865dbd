"""Starting processes, in one place: a script, a dslab recipe or a dslab driver on N ranks through the real
`deepspeed` launcher (`run`) or through `torchrun` (`torchrun`), launcher command lines run as typed, one per node
(`run_commands`), and any other command (`sh`). Every launch follows one path: its output is shown as it comes,
under each rank, the first failing rank is named with its traceback, every process is stopped at the end, and the
ranks' results are collected. Whatever is started stops when the process that started it dies, even by SIGKILL.

    ports.py      free ports for a job's rendezvous, and the /dev/shm buffers of finished jobs
    guard.py      children die with their owner: the parent-death signal and the guard process (dslab.live too)
    supervise.py  start, follow, stop, name the failing rank, collect (run_job, LaunchResult, LaunchError)
    commands.py   command lines as typed (run_commands) and sh
    __init__.py   run and torchrun of a dslab recipe or driver, or a script
"""
import json
import os
import shlex
from pathlib import Path

from dslab.hangs import watcher
from dslab.launch.commands import run_commands, sh
from dslab.launch.ports import free_port, port_is_free, remove_shm_buffers, remove_stale_shm_buffers
from dslab.launch.supervise import (NOISE, LaunchError, LaunchResult, fresh_run_dir, rank_environment, run_job,
                                    shower)
from dslab.machine import gpu_count, tool
from dslab.messages import say

__all__ = ["RECIPES_DIR", "DRIVERS_DIR", "NOISE", "LaunchError", "LaunchResult", "build_command", "check_environment",
           "check_timeout", "display_command", "free_port", "port_is_free", "script_module",
           "keyword_argv", "remove_shm_buffers", "remove_stale_shm_buffers", "run", "run_commands", "sh", "torchrun"]

# dslab's scripts, run by name: the recipes a learner reads and copies, and the drivers that dslab's own functions
# launch on ranks and read the results of (measurements, exercise trials).
RECIPES_DIR = Path(__file__).parent.parent / "recipes"
DRIVERS_DIR = Path(__file__).parent.parent / "drivers"


def script_module(name):
    """"dslab.recipes.NAME" or "dslab.drivers.NAME" if `name` is one of dslab's scripts (dslab/recipes/NAME.py,
    dslab/drivers/NAME.py), else None."""
    for folder in (RECIPES_DIR, DRIVERS_DIR):
        if (folder / f"{name}.py").exists():
            return f"dslab.{folder.name}.{name}"
    return None


def keyword_argv(script_kwargs):
    """Keyword arguments as the command-line words a recipe's or driver's argparse parser reads, in the forms they
    declare:

        str, int, float   --key value        (type=str / int / float)
        list, dict        --key '[1, 2]'     one JSON word (type=json.loads)
        True              --key              a flag (action="store_true")
        False, None       (left out)         the script's default applies: its flags are off, its optional values None
    """
    argv = []
    for key, value in script_kwargs.items():
        if value is None or value is False:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.append(value if isinstance(value, str) else json.dumps(value))
    return argv


def build_command(script, world_size, master_port, log_dir, include=None, args=()):
    """The argv of a `deepspeed` launch of `script` (the name of a dslab recipe or driver, or a script path)."""
    cmd = [tool("deepspeed")]
    if include:
        cmd += ["--include", include]  # the launcher's way to choose GPUs (not CUDA_VISIBLE_DEVICES)
    else:
        cmd += ["--num_gpus", str(world_size)]
    cmd += ["--master_port", str(master_port), "--enable_each_rank_log", str(log_dir), "--no_local_rank"]
    module = script_module(script)
    if module:
        cmd += ["--module", module]
    else:
        path = Path(script)
        if not path.is_file():
            known = sorted(p.stem for folder in (RECIPES_DIR, DRIVERS_DIR) for p in folder.glob("[!_]*.py"))
            raise LaunchError(say("launch.unknown_script", script=script, known=", ".join(known)))
        cmd.append(str(path))
    return cmd + list(args)


def display_command(cmd):
    """The command as a learner would type it (launcher name instead of its full path)."""
    return shlex.join(["deepspeed"] + cmd[1:])


def check_environment(world_size, include):
    """Raise LaunchError, with the fix, for a job the deepspeed launcher would start wrongly on this machine."""
    if world_size < 1:
        raise LaunchError(say("launch.world_size", world_size=world_size))
    if os.environ.get("CUDA_VISIBLE_DEVICES") and not include and gpu_count():
        raise LaunchError(say("launch.cuda_visible"))
    gpus = gpu_count()
    if gpus and not include and world_size > gpus:
        raise LaunchError(say("launch.too_few_gpus", world_size=world_size, gpus=gpus))


def check_timeout(timeout):
    """Raise LaunchError unless `timeout` is None (no limit) or a positive number of seconds."""
    if timeout is not None and not timeout > 0:  # NaN fails too
        raise LaunchError(say("launch.timeout_value", value=timeout))


def run(script, world_size=2, timeout=None, stream=None, master_port=None, include=None, run_dir=None,
        script_args=(), hang_timeout=None, **script_kwargs):
    """Run `script` (a dslab recipe or driver by name, or a script path) on `world_size` ranks with the deepspeed
    launcher and return a LaunchResult.

    stream: None/"recipe" echoes what the ranks print (DeepSpeed's own log lines hidden), "all" echoes
    everything, False echoes nothing. script_kwargs become the script's command-line arguments (`keyword_argv`);
    script_args are passed through verbatim. Raises LaunchError, with the failing rank's traceback, on failure.
    hang_timeout: if no rank makes progress for this many seconds, every rank's stack is read with py-spy, the job
    is stopped and LaunchError names the collective each rank waits in (dslab.hangs.watcher).
    """
    check_environment(world_size, include)
    check_timeout(timeout)
    if master_port is not None and not 1 <= master_port <= 65535:
        raise LaunchError(say("launch.port", value=master_port))
    if hang_timeout is not None and (problem := watcher.unready(hang_timeout)):
        raise LaunchError(problem)   # before the run folder is emptied or anything printed
    remove_stale_shm_buffers()
    name = Path(script).stem
    dirs = fresh_run_dir(name, run_dir)
    port = free_port(master_port)
    if master_port and port != master_port:
        print(f"master port {master_port} is in use; using {port} instead")
    cmd = build_command(script, world_size, port, dirs.logs, include, list(script_args) + keyword_argv(script_kwargs))
    print("$ " + display_command(cmd), flush=True)
    env = rank_environment(world_size, dirs.results.resolve())
    return run_job(name, [cmd], [env], dirs, world_size, shower(stream, prefix=world_size > 1), timeout, command=cmd,
                   hang_timeout=hang_timeout)


def torchrun(script, world_size=2, timeout=300, stream=None, run_dir=None, **script_kwargs):
    """Run a dslab recipe or driver with `torchrun` instead of the deepspeed launcher; returns a LaunchResult.

    Same scripts, same results: only the launcher (and so the environment each rank gets) changes. The command
    runs as printed, so what the ranks print is shown as torchrun passes it on, without rank prefixes.
    """
    module = script_module(script)
    if module is None:
        raise LaunchError(say("launch.not_a_dslab_script", script=script))
    if world_size < 1:
        raise LaunchError(say("launch.world_size", world_size=world_size))
    check_timeout(timeout)
    remove_stale_shm_buffers()
    name = f"{script}-torchrun"
    dirs = fresh_run_dir(name, run_dir)
    cmd = [tool("torchrun"), "--nproc_per_node", str(world_size), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", module, *keyword_argv(script_kwargs)]
    print("$ " + shlex.join(["torchrun"] + cmd[1:]), flush=True)
    env = rank_environment(world_size, dirs.results.resolve())

    def line_rank(node, line):  # no --tee: the ranks' lines arrive unmarked on torchrun's own output
        return (None, line) if line.strip() else None

    return run_job(name, [cmd], [env], dirs, world_size, shower(stream), timeout, line_rank, command=cmd)
