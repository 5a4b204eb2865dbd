"""Chapter 08 (CLI and multi-node): ranks from a hostfile, and a deepspeed --hostfile command line, resolved by
DeepSpeed's own runner functions.

Solutions: notebooks/solutions/08_solutions.py."""
import contextlib
import io
import logging
import os
import re
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
      "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-1 train.py"},
     "the command sets no --master_port"),
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
      "command": "deepspeed --include worker-0:0,1@worker-1 --master_port 29600 train.py"}, "Pass the hostfile"),
    # the hostfile after the script: train.py's argument; the runner reads /job/hostfile
    ({"hostfile": "worker-0 slots=2\nworker-1 slots=4\n",
      "command": "deepspeed --master_port 29600 train.py --hostfile hostfile"},
     "--hostfile comes after train.py: DeepSpeed's runner reads its own options only before the script"),
    # the filter and port after the script: the runner starts every GPU of the hostfile, on port 29500
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile train.py --include worker-0:0,1@worker-1 --master_port 29600"},
     "--include, --master_port come after train.py"),
    # the chapter's --no_ssh command, copied: it starts one machine's ranks only
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile --no_ssh --node_rank=0 --master_addr worker-0 --include "
                 "worker-0:0,1@worker-1 --master_port 29600 train.py"}, "with --no_ssh the runner starts only"),
    # slurm's srun places tasks by count: it cannot start ranks on GPUs 0 and 1 of one machine and 4 of the other
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --launcher slurm --hostfile hostfile --include worker-0:0,1@worker-1 --master_port 29600 "
                 "train.py"}, "slurm backend needs the same slot count on every host"),
    # two lines without a backslash: two commands
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-1\n    --master_port 29600 train.py"},
     "the command spans 2 lines"),
    # torchrun: one machine's ranks, no hostfile
    ({"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
      "command": "torchrun --nproc_per_node 4 --master_port 29600 train.py"}, "torchrun reads no hostfile"),
)


RUNNER_PROGRAMS = ("deepspeed", "ds", "deepspeed.pt")   # DeepSpeed's bin/ scripts: each runs launcher/runner.py main()


@contextlib.contextmanager
def _runner_logs_off():
    logger = logging.getLogger("DeepSpeed")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def command_words(command):
    """The words a POSIX shell hands the program: lines ending in a backslash joined to the next, comments dropped,
    quotes removed (shlex.split). A Mistake if the text holds more than one command line."""
    text = re.sub(r"\\\r?\n", "", command)        # backslash-newline: the shell continues the line
    lines = [line for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if len(lines) > 1:
        raise Mistake(f"the command spans {len(lines)} lines, and the shell runs each line as a command of its own "
                      f"(the second would start with {lines[1].split()[0]!r}): end every line but the last with a "
                      "backslash, or write one line")
    try:
        return shlex.split(text, comments=True)
    except ValueError as err:
        raise Mistake(f"the shell cannot split the command ({err}): check its quotes") from None


def runner_arguments(words):
    """(environment, arguments): the VAR=value words before the program (also after `env`), and the words the
    deepspeed runner parses: after `deepspeed` (any path to it, or its other names ds, deepspeed.pt) or after
    `python -m deepspeed.launcher.runner`."""
    env, i = {}, 0

    def assignments():
        nonlocal i
        while i < len(words) and re.fullmatch(r"[A-Za-z_]\w*=.*", words[i], re.S):
            key, value = words[i].split("=", 1)
            env[key] = value
            i += 1

    assignments()
    if i < len(words) and os.path.basename(words[i]) == "env":   # /usr/bin/env [VAR=value ...] deepspeed ...
        i += 1
        assignments()
    if i == len(words):
        raise Mistake("start the command with `deepspeed` (the runner that reads the hostfile)")
    program = os.path.basename(words[i])
    if program in RUNNER_PROGRAMS:
        return env, words[i + 1:]
    if re.fullmatch(r"python[\d.]*", program) and words[i + 1:i + 3] == ["-m", "deepspeed.launcher.runner"]:
        return env, words[i + 3:]
    also = " (torchrun reads no hostfile: it starts the ranks of one machine)" if program == "torchrun" else ""
    raise Mistake(f"the command runs {words[i]!r}{also}; the hostfile is read by DeepSpeed's runner: start the "
                  "command with `deepspeed` (or a path to it, such as .venv/bin/deepspeed)")


def _parse(argv):
    """runner.parse_args(argv), or None where DeepSpeed's runner exits on it (its usage error on stderr)."""
    from deepspeed.launcher import runner

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return runner.parse_args(argv)
    except SystemExit:
        return None


def misplaced_options(user_args):
    """The words after the script that are runner options (DeepSpeed's runner would take them before the script):
    its parser hands every word after the script to the script (user_args, argparse.REMAINDER)."""
    found = []
    for word in user_args:
        name = word.split("=", 1)[0]
        if name.startswith("-") and (_parse([name, "1", "script.py"]) or _parse([name, "script.py"])):
            found.append(name)
    return found


def check_hostfile_command(answer):
    """Resolve the learner's hostfile and deepspeed command as the shell and DeepSpeed's runner do: shlex (with line
    continuations), then the runner's own parse_args, fetch_hostfile, parse_inclusion_exclusion,
    apply_num_nodes_and_gpus and the launcher's validate_active_resources, in the order its main() runs them; compare
    the GPUs it would start ranks on, the port and the script with the task's, and name what differs."""
    import tempfile
    from pathlib import Path

    from deepspeed.launcher import runner

    if not isinstance(answer, dict) or not {"hostfile", "command"} <= set(answer):
        raise Mistake("answer = {'hostfile': '...', 'command': 'deepspeed ...'}")
    hostfile, command = str(answer["hostfile"]), str(answer["command"])
    env, argv = runner_arguments(command_words(command))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):   # argparse's usage text: the Mistake says its last line
            args = runner.parse_args(argv)
    except SystemExit:
        said = (err.getvalue().strip().splitlines() or ["see `deepspeed --help`"])[-1]
        raise Mistake(f"DeepSpeed's runner cannot parse the command: {said}") from None
    runner_words = argv[:len(argv) - len(args.user_args) - 1]
    misplaced = misplaced_options(args.user_args)

    def refuse(what):
        if misplaced:
            verb = "comes" if len(misplaced) == 1 else "come"
            raise Mistake(f"{', '.join(misplaced)} {verb} after {args.user_script}: DeepSpeed's runner reads its own "
                          f"options only before the script (its parser hands every later word to the script, "
                          f"user_args), so {args.user_script} gets them as its own arguments and the runner never "
                          f"sees them. So {what} Put the runner's options before {args.user_script}.")
        raise Mistake(what)

    named = args.hostfile != runner.DLTS_HOSTFILE or any(runner.DLTS_HOSTFILE in word for word in runner_words)
    if not named:
        refuse(f"the runner reads its default hostfile, {runner.DLTS_HOSTFILE} (DLTS_HOSTFILE in "
               "deepspeed/launcher/runner.py); where there is none it uses only this machine's GPUs. Pass the "
               "hostfile: --hostfile hostfile.")
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
        refuse("the runner refuses --num_gpus/--num_nodes together with --include/--exclude "
               "('Cannot specify num_nodes/gpus with include/exclude'): choose the GPUs one way.")
    try:
        active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    except ValueError as err:
        refuse(f"the runner rejects the filter: {err}.")
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    launcher = runner.LAUNCHER_CLASSES.get(args.launcher.lower())
    if launcher is None:
        refuse(f"the runner knows no launcher {args.launcher!r} (it knows {', '.join(runner.LAUNCHER_CLASSES)}).")
    try:
        launcher.validate_active_resources(active)
    except ValueError as err:
        refuse(f"the runner refuses this filter with --launcher {args.launcher}: {err}")
    active = {host: list(slots) for host, slots in active.items() if slots}
    if args.no_ssh:
        refuse(f"with --no_ssh the runner starts only the ranks of one machine, the one it runs on (node_rank "
               f"{args.node_rank}), and the same command must be typed on every machine with its own --node_rank; "
               "the task asks for one command that starts them all: leave out --no_ssh (the runner then starts "
               "every machine's ranks over ssh, with pdsh).")
    if active != WANTED_SLOTS:
        if "CUDA_VISIBLE_DEVICES" in env:
            refuse("CUDA_VISIBLE_DEVICES does not choose GPUs here: with a hostfile DeepSpeed's runner does not read "
                   "it or pass it to the nodes, and each node's launcher sets it to that node's slots from the world "
                   f"info. The runner would start ranks on {active}. Choose GPUs with --include (or --exclude, or "
                   "the hostfile's slots).")
        refuse(f"the runner would start ranks on {active}; wanted {WANTED_SLOTS}: filter with --include or "
               "--exclude, or list in the hostfile only the slots to use.")
    if args.master_port != 29600:
        default = " (the runner's default: the command sets no --master_port)" if args.master_port == 29500 else ""
        refuse(f"the ranks would meet on port {args.master_port}{default}; the task's port is 29600: "
               "--master_port 29600.")
    if os.path.normpath(args.user_script) != "train.py":
        refuse(f"the script is {args.user_script!r}; run train.py.")
    if args.module or args.no_python:
        refuse(f"with {'--module' if args.module else '--no_python'} the ranks would not run train.py as "
               "`python train.py` (--module runs `python -m train.py`, --no_python runs the file itself): leave it "
               "out.")
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
    {"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",                 # continued lines, a path to deepspeed
     "command": ".venv/bin/deepspeed --hostfile hostfile \\\n    --include worker-0:0,1@worker-1 \\\n"
                "    --master_port 29600 \\\n    train.py"},
    {"hostfile": "worker-0 slots=4\nworker-1 slots=4\n",                 # env, and the runner as a module
     "command": "/usr/bin/env NCCL_DEBUG=INFO python -m deepspeed.launcher.runner --hostfile hostfile "
                "--include 'worker-0:0,1@worker-1' --master_port 29600 train.py --deepspeed_config ds.json"},
)
