"""Chapter 08 (CLI and multi-node): ranks from a hostfile, and a deepspeed --hostfile command line.

Solutions: notebooks/solutions/08_solutions.py."""
import shlex

from dslab.exercises import Mistake, exercise, expect

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


# hostfile worker-0 slots=4, worker-1 slots=4; --include worker-0:0,1@worker-1 -> 2 + 4 ranks.
expect("08.world_size", 6, wrong=(8, 4, 2, 3),
       hint="--include keeps slots 0 and 1 of worker-0 and every slot of worker-1; count the processes.")
# world info {"a": [0, 1], "b": [0, 1]}: node_rank 1, local rank 1 -> global rank 3.
expect("08.global_rank", 3, wrong=(1, 2, 4),
       hint="global rank = node_rank x processes per node + local rank (node ranks follow the world-info order).")
exercise("08.hostfile_command", hint="answer = {'hostfile': '...', 'command': 'deepspeed ...'}",
         wrong=WRONG_HOSTFILE_COMMANDS)(check_hostfile_command)
