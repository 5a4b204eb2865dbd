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

from dslab import compat

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
    return dict(compat.parse_hostfile(text.splitlines()))


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
    """The command line to type on each node (node rank 0..n-1) to start `script` (a path, or the name of a dslab
    recipe or driver) as one job, without ssh: `deepspeed --hostfile H --no_ssh --node_rank=i ...` or
    `torchrun --nnodes N --node_rank i ...`."""
    from dslab.launch import script_module

    module = script_module(script)
    commands = []
    for i in range(n_nodes):
        if launcher == "deepspeed":
            cmd = ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", f"--node_rank={i}",
                   "--master_addr", master_addr, "--master_port", str(master_port)]
            cmd += ["--module", module] if module else [str(script)]
        elif launcher == "torchrun":
            cmd = ["torchrun", "--nnodes", str(n_nodes), "--node_rank", str(i), "--nproc_per_node", str(procs_per_node),
                   "--master_addr", master_addr, "--master_port", str(master_port)]
            cmd += ["-m", module] if module else [str(script)]
        else:
            raise ValueError("launcher must be 'deepspeed' or 'torchrun'")
        commands.append(shlex.join(cmd + [str(a) for a in script_args]))
    return commands


def run_local_nodes(script, n_nodes=2, procs_per_node=1, launcher="deepspeed", timeout=None, stream=None,
                    run_dir=None, script_args=(), **script_kwargs):
    """Run `script` as an n_nodes-node job on this machine: each node's own launcher command, all started together
    by dslab.launch.run_commands (which starts and supervises them). Returns its LaunchResult; LaunchError if a
    node fails."""
    from dslab import launch
    from dslab.files import atomic_write_text

    name = f"{Path(str(script)).stem}-{n_nodes}nodes-{launcher}"
    hostfile = Path(run_dir or os.environ.get("DSLAB_RUNS_DIR", "runs")) / f"{name}.hostfile"
    atomic_write_text(hostfile, local_hostfile(n_nodes, procs_per_node))
    args = list(script_args) + launch.keyword_argv(script_kwargs)
    commands = node_commands(script, hostfile, n_nodes, procs_per_node, launch.free_port(), launcher, script_args=args)
    return launch.run_commands(commands, timeout=timeout, stream=stream, run_dir=run_dir, name=name)
