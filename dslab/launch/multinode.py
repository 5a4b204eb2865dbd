"""Multi-node launching, shown for real on one machine: hostfiles, --include/--exclude, and a 2-node job's hostfile.

On a cluster, `deepspeed --hostfile H script.py` reads the hostfile, applies --include/--exclude, encodes
the chosen {host: [slots]} as base64 "world info", and asks pdsh to ssh into every host and run
`python -m deepspeed.launcher.launch --world_info=B64 --node_rank=%n --master_addr=A --master_port=P script.py`
there. Without ssh, the same job is one `deepspeed --hostfile H --no_ssh --node_rank=i ...` typed on each node
(or `torchrun --nnodes N --node_rank i ...`); chapter 08 types those commands itself and runs them all on localhost
with dslab.launch.run_commands, with the hostfile local_hostfile writes.
"""
import base64
import json
import sys

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
