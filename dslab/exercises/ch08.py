"""Chapter 08 (CLI and multi-node): ranks from a hostfile, and a deepspeed --hostfile command line, resolved by
DeepSpeed's own runner functions.

Solutions: notebooks/solutions/08_solutions.py."""
import contextlib
import io
import logging
import shlex

from dslab.exercises import Mistake, exercise, expect

# Exercise 08.hostfile_command: two machines with 4 GPUs each; the job uses GPUs 0 and 1 of worker-0 and all of
# worker-1, runs train.py, and meets on port 29600. Any hostfile and command line that make DeepSpeed's runner select
# exactly those GPUs is right (a filter, or a hostfile that lists only the slots to use); the checker resolves them
# with the runner's own functions.
WANTED_SLOTS = {"worker-0": [0, 1], "worker-1": [0, 1, 2, 3]}
GPUS_PER_MACHINE = 4
WRONG_HOSTFILE_COMMANDS = (
    # GPUs chosen with CUDA_VISIBLE_DEVICES: the runner does not pass it to the nodes once a hostfile is used
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "CUDA_VISIBLE_DEVICES=0,1 deepspeed --hostfile hostfile --master_port 29600 train.py"},
     "CUDA_VISIBLE_DEVICES does not choose GPUs here"),
    # every GPU of both machines
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile --master_port 29600 train.py"}, "the runner would start ranks on"),
    # the right filter, default port
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-1 train.py"}, "(the default is 29500)"),
    # hostfile written with gpus= instead of slots=
    ({"hostfile": "worker-0 gpus=4\nworker-1 gpus=4\n",
      "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-1 --master_port 29600 train.py"},
     "DeepSpeed cannot read the hostfile"),
    # --num_gpus together with --include
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile --num_gpus 2 --include worker-0:0,1@worker-1 --master_port 29600 "
                 "train.py"}, "Cannot specify num_nodes/gpus with include/exclude"),
    # --num_gpus 2 takes 2 GPUs of every machine
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile --num_gpus 2 --master_port 29600 train.py"},
     "the runner would start ranks on"),
    # a machine the hostfile does not list
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-2 --master_port 29600 train.py"},
     "not found in hostfile"),
    # no hostfile: the runner uses this machine only
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --include worker-0:0,1@worker-1 --master_port 29600 train.py"}, "pass the hostfile"),
)


@contextlib.contextmanager
def _runner_logs_off():
    logger = logging.getLogger("DeepSpeed")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _environment_words(argv):
    """The VAR=value words before the command (as a shell reads them) and the command's own words."""
    i = 0
    while i < len(argv) and "=" in argv[i] and not argv[i].startswith("-") and argv[i].split("=")[0].isidentifier():
        i += 1
    return dict(word.split("=", 1) for word in argv[:i]), argv[i:]


def check_hostfile_command(answer):
    """Resolve the learner's hostfile and deepspeed command with DeepSpeed's own runner code (fetch_hostfile,
    parse_args, parse_inclusion_exclusion, apply_num_nodes_and_gpus, in the order its main() runs them) and compare
    the GPUs it would start ranks on, the port and the script with the task's; name what differs."""
    import tempfile
    from pathlib import Path

    from deepspeed.launcher import runner

    if not isinstance(answer, dict) or not {"hostfile", "command"} <= set(answer):
        raise Mistake("answer = {'hostfile': '...', 'command': 'deepspeed ...'}")
    hostfile, command = str(answer["hostfile"]), str(answer["command"])
    env, argv = _environment_words(shlex.split(command))
    if not argv or argv[0] != "deepspeed":
        raise Mistake("start the command with `deepspeed` (the runner that reads the hostfile)")
    try:
        with contextlib.redirect_stderr(io.StringIO()):   # argparse's usage text: the Mistake says it instead
            args = runner.parse_args(argv[1:])
    except SystemExit:
        raise Mistake(f"the deepspeed runner cannot parse {command!r}; see `deepspeed --help`") from None
    if not any(a in ("--hostfile", "-H") or a.startswith("--hostfile=") for a in argv):
        raise Mistake("pass the hostfile: --hostfile hostfile (without it the runner uses only this machine)")
    with tempfile.TemporaryDirectory() as tmp:   # the runner reads the hostfile from a file: give it one
        path = Path(tmp) / "hostfile"
        path.write_text(hostfile, encoding="utf-8")
        try:
            with _runner_logs_off():          # it logs the bad text before raising; the Mistake says it
                pool = runner.fetch_hostfile(str(path))
        except ValueError as err:
            raise Mistake(f"DeepSpeed cannot read the hostfile ({err}): one line per machine, 'NAME slots=N'") \
                from None
    too_many = {host: slots for host, slots in pool.items() if slots > GPUS_PER_MACHINE}
    if too_many:
        raise Mistake(f"the hostfile gives {too_many} slots: each machine has {GPUS_PER_MACHINE} GPUs, and a slot is a "
                      "GPU the runner may start a rank on")
    if (args.num_gpus >= 0 or args.num_nodes >= 0) and (args.include or args.exclude):
        raise Mistake("the runner refuses --num_gpus/--num_nodes together with --include/--exclude "
                      "('Cannot specify num_nodes/gpus with include/exclude'): choose the GPUs one way")
    try:
        active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    except ValueError as err:
        raise Mistake(f"the runner rejects the filter: {err}") from None
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    active = {host: list(slots) for host, slots in active.items() if slots}
    if active != WANTED_SLOTS:
        if "CUDA_VISIBLE_DEVICES" in env:
            raise Mistake("CUDA_VISIBLE_DEVICES does not choose GPUs here: with a hostfile DeepSpeed's runner does not "
                          "pass it to the nodes, and each node's launcher sets it to that node's slots from the world "
                          f"info. The runner would start ranks on {active}. Choose GPUs with --include (or --exclude, "
                          "or the hostfile's slots)")
        raise Mistake(f"the runner would start ranks on {active}; wanted {WANTED_SLOTS}: filter with --include or "
                      "--exclude, or list in the hostfile only the slots to use")
    if args.master_port != 29600:
        raise Mistake(f"the ranks would meet on port {args.master_port} (the default is 29500): --master_port 29600")
    if args.user_script != "train.py":
        raise Mistake(f"the script is {args.user_script!r}; run train.py")
    return True


# hostfile worker-0 slots=4, worker-1 slots=4; --include worker-0:0,1@worker-1 -> 2 + 4 ranks.
expect("08.world_size", 6,
       wrong=((8, "8 counts every slot of both machines: --include keeps only slots 0 and 1 of worker-0"),
              (4, "4 is worker-1's ranks alone: worker-0's slots 0 and 1 run ranks too"),
              (2, "2 is worker-0's share: a host named in --include without slots keeps all its slots (worker-1: 4)"),
              (3, "3 counts worker-1 as one rank: a host named in --include without slots keeps all 4 of its slots")),
       hint="--include keeps slots 0 and 1 of worker-0 and every slot of worker-1; count the processes.")
# world info {"a": [0, 1], "b": [0, 1]}: node_rank 1, local rank 1 -> global rank 3.
expect("08.global_rank", 3,
       wrong=((1, "1 is the local rank: the global rank also counts node a's 2 ranks before it"),
              (2, "2 is the first rank of node b (local rank 0): local rank 1 comes after it"),
              (4, "4 counts from 1: ranks start at 0, so node b's ranks are 2 and 3")),
       hint="global rank = node_rank x processes per node + local rank (node ranks follow the world-info order).")
exercise("08.hostfile_command", hint="answer = {'hostfile': '...', 'command': 'deepspeed ...'}",
         wrong=WRONG_HOSTFILE_COMMANDS)(check_hostfile_command)

# Right answers other than the instructor's (tests/test_exercises.py checks that each is accepted).
OTHER_RIGHT_HOSTFILE_COMMANDS = (
    {"hostfile": "worker-0 slots=2\nworker-1 slots=4\n",           # the hostfile lists only the slots to use
     "command": "deepspeed --hostfile hostfile --master_port 29600 train.py"},
    {"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
     "command": "deepspeed --hostfile=hostfile --exclude worker-0:2,3 --master_port=29600 train.py"},
    {"hostfile": "# two machines\nworker-0 slots=4\nworker-1 slots=4\n",
     "command": "deepspeed -H hostfile --include=worker-0:0,1@worker-1:0,1,2,3 --master_port 29600 train.py"},
    {"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
     "command": "CUDA_VISIBLE_DEVICES=0,1 deepspeed --hostfile hostfile --include worker-0:0,1@worker-1 "
                "--master_port 29600 train.py"},
)
