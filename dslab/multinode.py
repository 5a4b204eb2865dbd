"""Multi-node launching, shown for real on one machine: hostfiles, --include/--exclude, and a 2-node job on localhost.

On a cluster, `deepspeed --hostfile H script.py` reads the hostfile, applies --include/--exclude, encodes
the chosen {host: [slots]} as base64 "world info", and asks pdsh to ssh into every host and run
`python -m deepspeed.launcher.launch --world_info=B64 --node_rank=%n --master_addr=A --master_port=P script.py`
there. This module runs that per-node launcher itself, once per "node", all on localhost: no ssh needed.
"""
import base64
import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

EXAMPLE_HOSTFILE = """\
# one line per machine: a name ssh can reach, and how many processes (GPUs) it runs
worker-0 slots=4
worker-1 slots=4
"""


def world_info(nodes):
    """The launcher's --world_info: urlsafe base64 of the JSON {host: [local slot ids]} (ordered = node ranks)."""
    return base64.urlsafe_b64encode(json.dumps(nodes).encode("utf-8")).decode("ascii")


def decode_world_info(text):
    """The {host: [slots]} dict a --world_info string stands for."""
    return json.loads(base64.urlsafe_b64decode(text.encode("ascii")))


def parse_hostfile(text):
    """{host: slots} from hostfile text, parsed by DeepSpeed's own parser (ValueError on a bad line)."""
    from deepspeed.launcher.runner import _parse_hostfile

    return dict(_parse_hostfile(text.splitlines()))


def resolve(hostfile_text, include="", exclude=""):
    """The {host: [slots]} DeepSpeed's runner would launch on for this hostfile and --include/--exclude.

    Filters look like "worker-0:0,1@worker-1" (slots 0 and 1 of worker-0, all of worker-1).
    """
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    return dict(parse_inclusion_exclusion(parse_hostfile(hostfile_text), include, exclude))


def pdsh_command(hostfile_text, script="train.py", script_args=(), include="", exclude="",
                 master_addr="worker-0", master_port=29500):
    """The pdsh command line DeepSpeed's runner builds for a hostfile (built by DeepSpeed's PDSHRunner, not run)."""
    from types import SimpleNamespace

    from deepspeed.launcher.multinode_runner import PDSHRunner

    active = resolve(hostfile_text, include, exclude)
    args = SimpleNamespace(user_args=list(script_args), user_script=script, ssh_port=None, launcher_args="",
                           master_addr=master_addr, master_port=master_port, venv_script=None, no_python=False,
                           module=False, no_local_rank=False, save_pid=False, enable_each_rank_log="None")
    cmd, _, _ = PDSHRunner(args, world_info(active)).get_cmd({}, active)
    # shown as a learner would read it: no machine-specific interpreter path or directory
    return " ".join("python" if part == sys.executable else "cd ~/project;" if part.startswith("cd ") else part
                    for part in cmd if part)


def node_command(recipe, node_rank, nodes, master_port, log_dir, master_addr="127.0.0.1", args=()):
    """argv of DeepSpeed's per-node launcher for node `node_rank` of `nodes` ({host: [slots]})."""
    from dslab.launch import RECIPES_DIR

    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info(nodes)}",
           f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}",
           f"--enable_each_rank_log={log_dir}", "--no_local_rank"]
    if (RECIPES_DIR / f"{recipe}.py").exists():
        cmd += ["--module", f"dslab.recipes.{recipe}"]
    else:
        cmd.append(str(recipe))
    return cmd + list(args)


def display(cmd):
    """A command line as a learner would type it."""
    return shlex.join(["python"] + cmd[1:])


def run_local_nodes(recipe, n_nodes=2, procs_per_node=1, timeout=None, stream=None, run_dir=None, **recipe_kwargs):
    """Run `recipe` as an n_nodes-node job on this machine: one per-node launcher per node, node ranks 0..n-1.

    Both "nodes" are localhost (hence the made-up host names: the launcher only uses the names as keys).
    Returns a dslab.launch.LaunchResult with every global rank's result; LaunchError if any node fails.
    """
    from dslab import launch

    name = f"{Path(recipe).stem}-{n_nodes}nodes"
    run_dir = Path(run_dir or os.environ.get("DSLAB_RUNS_DIR", "runs")) / name
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    log_dir, result_dir = run_dir / "logs", run_dir / "results"
    log_dir.mkdir(parents=True)
    result_dir.mkdir()
    world_size = n_nodes * procs_per_node
    nodes = {f"node{i}": list(range(procs_per_node)) for i in range(n_nodes)}
    args = []
    for key, value in recipe_kwargs.items():
        args += [f"--{key}", launch._encode(value)]
    port = launch.free_port()
    env = launch._rank_env(world_size, result_dir.resolve())
    env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // world_size))  # all nodes share these cores
    commands = [node_command(recipe, i, nodes, port, log_dir, args=args) for i in range(n_nodes)]
    for i, cmd in enumerate(commands):
        print(f"# node {i}\n$ " + display(cmd), flush=True)

    def show(rank, line):
        if stream is False or (stream != "all" and launch._NOISE.search(line)):
            return
        print(f"[rank{rank}] {line}", flush=True)

    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd in commands]
    outputs = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout), daemon=True) for p, o in zip(procs, outputs)]
    for r in readers:
        r.start()
    tailer = launch._Tailer(str(log_dir), show)
    tailer.start()
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise launch.LaunchError(f"{name} did not finish within {timeout} s; all nodes were stopped")
    finally:
        tailer.stop.set()
        tailer.join()
        for p in procs:
            launch._kill_group(p)
        for r in readers:
            r.join(timeout=5)
    rank_logs = {launch._rank_of(str(p)): launch._TORCH_PREFIX.sub("", p.read_text(errors="replace"))
                 for p in log_dir.glob("*_rank*.log")}
    log = "".join(f"\n===== node {i} =====\n" + "".join(o) for i, o in enumerate(outputs))
    log += "".join(f"\n===== rank {r} =====\n{t}" for r, t in sorted(rank_logs.items()))
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        rank, trace = launch._failing_rank(rank_logs)
        raise launch.LaunchError(f"{name}: node {failed[0]} exited with status {procs[failed[0]].returncode}; "
                                 f"per-rank logs: {log_dir}\n{trace or ''.join(outputs[failed[0]])[-3000:]}")
    results = []
    for r in range(world_size):
        path = result_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return launch.LaunchResult(command=commands, returncode=0, results=results, log=log, run_dir=str(run_dir))


# ----------------------------------------------------------------------------------------------------
# Chapter 08 exercises (checked by dslab.exercises; solutions in notebooks/solutions/08_solutions.py)
# ----------------------------------------------------------------------------------------------------
def _register_exercises():
    from dslab.exercises import expect

    # hostfile worker-0 slots=4, worker-1 slots=4; --include worker-0:0,1@worker-1 -> 2 + 4 ranks.
    expect("08.world_size", 6, wrong=(8, 4, 2, 3),
           hint="--include keeps slots 0 and 1 of worker-0 and every slot of worker-1; count the processes.")
    # world info {"a": [0, 1], "b": [0, 1]}: node_rank 1, local rank 1 -> global rank 3.
    expect("08.global_rank", 3, wrong=(1, 2, 4),
           hint="global rank = node_rank x processes per node + local rank (node ranks follow the world-info order).")


_register_exercises()


# ----------------------------------------------------------------------------------------------------
# Shell commands from a notebook, and other launchers
# ----------------------------------------------------------------------------------------------------
def sh(command, check=True, env=None, show=True):
    """Run a command line (split like a shell would, but no shell runs it: no pipes or globs) with this
    environment's tools (dslab, deepspeed, torchrun, accelerate) first on PATH; print `$ command`, then its
    output (stdout, then stderr; show=False: only the command). Returns the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    full_env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    print(f"$ {command}", flush=True)
    proc = subprocess.run(shlex.split(command), env=full_env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if show and out.strip():
        print(out.rstrip())
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed with exit status {proc.returncode}: {command}")
    return proc


def launcher_command(launcher, recipe, world_size=2, port=29500, **recipe_kwargs):
    """argv that starts dslab recipe `recipe` on `world_size` local ranks under "torchrun" or "accelerate"."""
    from dslab import launch

    if launcher == "torchrun":
        cmd = ["torchrun", "--nproc_per_node", str(world_size), "--master_port", str(port)]
    elif launcher == "accelerate":
        cmd = ["accelerate", "launch", "--use_deepspeed", "--zero_stage", "2", "--num_processes", str(world_size),
               "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
               "--dynamo_backend", "no"]
    else:
        raise ValueError("launcher must be 'torchrun' or 'accelerate'")
    cmd += ["-m", f"dslab.recipes.{recipe}"]
    for key, value in recipe_kwargs.items():
        cmd += [f"--{key}", launch._encode(value)]
    return cmd


def run_with_launcher(launcher, recipe, world_size=2, timeout=None, **recipe_kwargs):
    """Run a dslab recipe under "torchrun" or "accelerate" (instead of deepspeed) and collect per-rank results.

    torchrun does not set LOCAL_SIZE, which DeepSpeed's CPU shared-memory all-reduce needs: set here.
    Prints the command; the ranks' own output stays in the returned log.
    """
    import shutil
    import tempfile

    from dslab import launch

    cmd = launcher_command(launcher, recipe, world_size, launch.free_port(), **recipe_kwargs)
    result_dir = Path(tempfile.mkdtemp(prefix=f"dslab-{launcher}-"))
    env = launch._rank_env(world_size, result_dir)
    env["LOCAL_SIZE"] = str(world_size)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    print("$ " + ("LOCAL_SIZE=%d " % world_size if launcher == "torchrun" else "") + shlex.join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise launch.LaunchError(f"{launcher} run of {recipe} failed (exit status {proc.returncode}):\n"
                                     + (proc.stdout + proc.stderr)[-3000:])
        results = [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)
    return launch.LaunchResult(command=cmd, returncode=0, results=results, log=proc.stdout + proc.stderr)
