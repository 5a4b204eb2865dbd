"""Multi-node launching, shown for real on one machine: hostfiles, --include/--exclude, and a 2-node job on localhost.

On a cluster, `deepspeed --hostfile H script.py` reads the hostfile, applies --include/--exclude, encodes
the chosen {host: [slots]} as base64 "world info", and asks pdsh to ssh into every host and run
`python -m deepspeed.launcher.launch --world_info=B64 --node_rank=%n --master_addr=A --master_port=P script.py`
there. Without ssh, the same job is one `deepspeed --hostfile H --no_ssh --node_rank=i ...` typed on each node
(or `torchrun --nnodes N --node_rank i ...`); this module builds those commands, and dslab.launch runs them, all
on localhost.
"""
import base64
import json
import os
import shlex
import sys
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


def local_hostfile(n_nodes=2, procs_per_node=1):
    """Hostfile text for an n_nodes-node job on this machine: made-up node names (the launcher only uses them as
    keys of the world info when --no_ssh is given), procs_per_node slots each."""
    return "".join(f"node{i} slots={procs_per_node}\n" for i in range(n_nodes))


def node_commands(script, hostfile, n_nodes=2, procs_per_node=1, master_port=29500, launcher="deepspeed",
                  master_addr="127.0.0.1", script_args=()):
    """The command line to type on each node (node rank 0..n-1) to start `script` (a path, or a dslab recipe name)
    as one job, without ssh: `deepspeed --hostfile H --no_ssh --node_rank=i ...` or `torchrun --nnodes N --node_rank i ...`."""
    from dslab.launch import RECIPES_DIR

    recipe = (RECIPES_DIR / f"{script}.py").exists()
    commands = []
    for i in range(n_nodes):
        if launcher == "deepspeed":
            cmd = ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", f"--node_rank={i}",
                   "--master_addr", master_addr, "--master_port", str(master_port)]
            cmd += ["--module", f"dslab.recipes.{script}"] if recipe else [str(script)]
        elif launcher == "torchrun":
            cmd = ["torchrun", "--nnodes", str(n_nodes), "--node_rank", str(i), "--nproc_per_node", str(procs_per_node),
                   "--master_addr", master_addr, "--master_port", str(master_port)]
            cmd += ["-m", f"dslab.recipes.{script}"] if recipe else [str(script)]
        else:
            raise ValueError("launcher must be 'deepspeed' or 'torchrun'")
        commands.append(shlex.join(cmd + [str(a) for a in script_args]))
    return commands


def run_local_nodes(script, n_nodes=2, procs_per_node=1, launcher="deepspeed", timeout=None, stream=None,
                    run_dir=None, script_args=(), **recipe_kwargs):
    """Run `script` as an n_nodes-node job on this machine: each node's own launcher command, all started together
    by dslab.launch (the one place that starts processes). Returns its LaunchResult; LaunchError if a node fails."""
    from dslab import launch

    name = f"{Path(str(script)).stem}-{n_nodes}nodes-{launcher}"
    hostfile = Path(run_dir or os.environ.get("DSLAB_RUNS_DIR", "runs")) / f"{name}.hostfile"
    hostfile.parent.mkdir(parents=True, exist_ok=True)
    hostfile.write_text(local_hostfile(n_nodes, procs_per_node))
    args = list(script_args)
    for key, value in recipe_kwargs.items():
        args += [f"--{key}", launch.encode_value(value)]
    commands = node_commands(script, hostfile, n_nodes, procs_per_node, launch.free_port(), launcher, script_args=args)
    return launch.run_commands(commands, timeout=timeout, stream=stream, run_dir=run_dir, name=name)


# ----------------------------------------------------------------------------------------------------
# Chapter 08 exercises (checked by dslab.exercises; solutions in notebooks/solutions/08_solutions.py)
# ----------------------------------------------------------------------------------------------------
def _register_exercises():
    from dslab.exercises import exercise, expect

    # hostfile worker-0 slots=4, worker-1 slots=4; --include worker-0:0,1@worker-1 -> 2 + 4 ranks.
    expect("08.world_size", 6, wrong=(8, 4, 2, 3),
           hint="--include keeps slots 0 and 1 of worker-0 and every slot of worker-1; count the processes.")
    # world info {"a": [0, 1], "b": [0, 1]}: node_rank 1, local rank 1 -> global rank 3.
    expect("08.global_rank", 3, wrong=(1, 2, 4),
           hint="global rank = node_rank x processes per node + local rank (node ranks follow the world-info order).")
    exercise("08.hostfile_command", hint="answer = {'hostfile': '...', 'command': 'deepspeed ...'}",
             wrong=WRONG_HOSTFILE_COMMANDS)(check_hostfile_command)


# Exercise 08.hostfile_command: two machines with 4 GPUs each; the job uses GPUs 0 and 1 of worker-0 and all of
# worker-1, runs train.py, and meets on port 29600.
WANTED_SLOTS = {"worker-0": [0, 1], "worker-1": [0, 1, 2, 3]}
WRONG_HOSTFILE_COMMANDS = (
    # GPUs chosen with CUDA_VISIBLE_DEVICES: the launcher drops it once a hostfile is used
    {"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
     "command": "CUDA_VISIBLE_DEVICES=0,1 deepspeed --hostfile hostfile --master_port 29600 train.py"},
    # slots = the GPUs to use rather than the GPUs the machine has, and no filter
    {"hostfile": "worker-0 slots=2\nworker-1 slots=4\n",
     "command": "deepspeed --hostfile hostfile --master_port 29600 train.py"},
    # the right filter, default port
    {"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
     "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-1 train.py"},
    # hostfile written with gpus= instead of slots=
    {"hostfile": "worker-0 gpus=4\nworker-1 gpus=4\n",
     "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-1 --master_port 29600 train.py"},
    # --num_gpus together with --include
    {"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
     "command": "deepspeed --hostfile hostfile --num_gpus 2 --include worker-0:0,1@worker-1 --master_port 29600 train.py"},
)


def check_hostfile_command(answer):
    """Parse the learner's hostfile and deepspeed command with DeepSpeed's own runner code; name what is wrong."""
    from deepspeed.launcher import runner

    from dslab.exercises import Mistake

    hostfile, command = answer["hostfile"], answer["command"]
    try:
        pool = dict(runner._parse_hostfile(hostfile.splitlines()))
    except ValueError as err:
        raise Mistake(f"DeepSpeed cannot read the hostfile ({err}): one line per machine, 'NAME slots=N'")
    if pool != {"worker-0": 4, "worker-1": 4}:
        raise Mistake(f"the hostfile says {pool}: list each machine with all the GPUs it has (slots=4); choose the "
                      "GPUs this job uses with --include")
    argv = shlex.split(command)
    if argv and "=" in argv[0] and argv[0].split("=")[0] == "CUDA_VISIBLE_DEVICES":
        raise Mistake("CUDA_VISIBLE_DEVICES does not choose GPUs here: with a hostfile DeepSpeed's runner does not "
                      "pass it to the nodes, and each node's launcher sets it to that node's slots from the world "
                      "info. Choose GPUs with --include worker-0:0,1@worker-1")
    if not argv or argv[0] != "deepspeed":
        raise Mistake("start the command with `deepspeed` (the runner that reads the hostfile)")
    try:
        args = runner.parse_args(argv[1:])
    except SystemExit:
        raise Mistake(f"the deepspeed runner cannot parse {command!r}; see `deepspeed --help`") from None
    if not _has_hostfile(argv):
        raise Mistake("pass the hostfile: --hostfile hostfile (without it the runner uses only this machine)")
    if (args.num_gpus > 0 or args.num_nodes > 0) and (args.include or args.exclude):
        raise Mistake("the runner refuses --num_gpus/--num_nodes together with --include/--exclude "
                      "('Cannot specify num_nodes/gpus with include/exclude'): keep --include only")
    try:
        active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    except ValueError as err:
        raise Mistake(f"the runner rejects the filter: {err}")
    active = {host: list(slots) for host, slots in runner.apply_num_nodes_and_gpus(active, args.num_nodes,
                                                                                    args.num_gpus).items()}
    if active != WANTED_SLOTS:
        raise Mistake(f"the runner would start ranks on {active}; wanted {WANTED_SLOTS}: "
                      "--include worker-0:0,1@worker-1")
    if args.master_port != 29600:
        raise Mistake(f"the ranks would meet on port {args.master_port} (the default is 29500): --master_port 29600")
    if args.user_script != "train.py":
        raise Mistake(f"the script is {args.user_script!r}; run train.py")
    return True


def _has_hostfile(argv):
    return any(a in ("--hostfile", "-H") or a.startswith("--hostfile=") for a in argv)


_register_exercises()


from dslab.launch import sh  # noqa: E402  (chapter 08 ran shell commands through dslab.multinode.sh)
