"""dslab.launch: failures surface with the failing rank's traceback and leave no process behind;
results come back per rank; a taken master port is replaced; the keyword arguments of a launch reach a recipe's
argparse parser as they were given."""
import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from dslab import launch, this_rank
from dslab.launch import ports
from support import assert_no_strays

# Rank scripts import only dslab.this_rank (no torch), so each launch costs little more than the launcher.
FAILING = """
import argparse, time
from dslab import this_rank
parser = argparse.ArgumentParser()
parser.add_argument("--fail_rank", type=int, default=1)
args = parser.parse_args()
if this_rank.rank() == args.fail_rank:
    raise ValueError(f"rank {this_rank.rank()} fails on purpose")
time.sleep(120)  # the healthy rank would wait for the failed one forever: the launcher must stop it
"""

# The usual real failure: one rank raises while the others wait for it inside a collective. They then fail too
# ("Connection closed by peer"), and the error must name the rank that failed first, not an echo of it.
FAILING_IN_COLLECTIVE = """
import torch
import torch.distributed as torch_dist
from dslab import this_rank
torch_dist.init_process_group("gloo")  # torch only: cheaper than DeepSpeed for this test
if this_rank.rank() == 1:
    raise ValueError("rank 1 fails on purpose")
torch_dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, which is gone
"""

REPORTING = """
import argparse, json, os
from dslab import this_rank
parser = argparse.ArgumentParser()
parser.add_argument("--tag", default="none")
parser.add_argument("--numbers", type=json.loads, default=[])
args = parser.parse_args()
this_rank.save_rank_result({"rank": this_rank.rank(), "world_size": this_rank.world_size(), "tag": args.tag,
                            "numbers": args.numbers, "master_port": int(os.environ["MASTER_PORT"])})
"""


def _script(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_failing_rank_raises_with_its_traceback_and_stops_the_others(tmp_path):
    script = _script(tmp_path, "fails_on_rank1.py", FAILING)
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.run(str(script), world_size=2, stream=False, run_dir=tmp_path / "runs", timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1 failed" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: rank 1 fails on purpose" in message
    assert elapsed < 30, f"the failure took {elapsed:.0f} s to surface (rank 0 sleeps 120 s)"
    assert_no_strays(script)


def test_the_rank_that_failed_first_is_named_not_the_one_left_waiting(tmp_path):
    script = _script(tmp_path, "fails_in_collective.py", FAILING_IN_COLLECTIVE)
    with pytest.raises(launch.LaunchError) as info:
        launch.run(str(script), world_size=2, stream=False, run_dir=tmp_path / "runs", timeout=60)
    assert_no_strays(script)
    assert "rank 1 failed" in str(info.value) and "ValueError: rank 1 fails on purpose" in str(info.value)


def test_cli_exits_nonzero_fast_on_failure(tmp_path):
    """The failing rank ends the job, not the clock: the CLI reports it long before its --timeout. (Starting the job
    takes 10-30 s on 2 busy cores, so the bound is the timeout's, not a speed goal.)"""
    script = _script(tmp_path, "cli_fails_on_rank0.py", FAILING)
    timeout = 120
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dslab.cli", "launch", "--world-size", "2",
                           "--run-dir", str(tmp_path / "runs"), "--timeout", str(timeout), str(script),
                           "--fail_rank", "0"], capture_output=True, text=True, timeout=timeout + 60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 0 failed" in proc.stderr and "ValueError: rank 0 fails on purpose" in proc.stderr
    assert "did not finish within" not in proc.stderr
    assert elapsed < timeout * 0.75, f"CLI took {elapsed:.0f} s to report the failure (its timeout: {timeout} s)"
    assert_no_strays(script)


def test_results_per_rank_and_a_taken_port_is_replaced(tmp_path, capsys):
    script = _script(tmp_path, "reports.py", REPORTING)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert not launch.port_is_free(taken)
        result = launch.run(str(script), world_size=2, master_port=taken, stream=False,
                            run_dir=tmp_path / "runs", timeout=60, tag="hello", numbers=[1, 2.5])
    out = capsys.readouterr().out
    assert f"master port {taken} is in use; using " in out
    assert [r["rank"] for r in result.results] == [0, 1]
    assert result.rank0 is result.results[0]
    assert all(r["world_size"] == 2 and r["tag"] == "hello" and r["numbers"] == [1, 2.5] for r in result.results)
    used = {r["master_port"] for r in result.results}
    assert len(used) == 1 and taken not in used  # both ranks met on the replacement port
    assert f"--master_port {used.pop()}" in out
    assert_no_strays(script)


def test_free_port_keeps_a_free_preferred_port():
    port = launch.free_port()
    assert launch.port_is_free(port) and launch.free_port(port) == port


def test_a_chosen_port_lies_below_the_range_the_kernel_gives_outgoing_connections(tmp_path):
    # a port from that range can be taken by any connection before the store binds it (live ranks: minutes later)
    first, _ = ports.ephemeral_ports()
    assert first - ports.LOWEST_CHOSEN_PORT >= 1000   # room below it here (Linux default: 32768)
    drawn = {launch.free_port() for _ in range(20)}
    assert all(ports.LOWEST_CHOSEN_PORT <= p < first for p in drawn) and len(drawn) > 1   # drawn, not alike
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t65535\n")
    assert ports.ephemeral_ports(ranges) == (1024, 65535)
    assert ports.ephemeral_ports(tmp_path / "absent") == (32768, 60999)


def test_unknown_recipe_is_a_clear_error(tmp_path):
    with pytest.raises(launch.LaunchError,
                       match=r"'no_such_recipe' is neither a dslab recipe or driver \(.*hello.*zero_memory\) nor a script"):
        launch.run("no_such_recipe", world_size=2, run_dir=tmp_path)


def test_world_size_must_be_positive(tmp_path):
    with pytest.raises(launch.LaunchError, match="world_size must be at least 1"):
        launch.run("collectives", world_size=0, run_dir=tmp_path)


def test_command_line_for_a_recipe_and_for_a_script(tmp_path):
    cmd = launch.build_command("collectives", 2, 29500, "logs", args=["--numel", "8"])
    shown = launch.display_command(cmd)
    assert shown == ("deepspeed --num_gpus 2 --master_port 29500 --enable_each_rank_log logs --no_local_rank "
                     "--module dslab.recipes.collectives --numel 8")
    script = _script(tmp_path, "mine.py", "print('hi')\n")
    assert launch.build_command(str(script), 2, 29500, "logs")[-1] == str(script)
    assert launch.build_command("collectives", 2, 1, "logs", include="localhost:0,1")[1:3] == ["--include", "localhost:0,1"]
    # a driver (run on ranks by dslab's own functions) is found by name as a recipe is
    assert launch.build_command("zero_memory", 2, 29500, "logs")[-2:] == ["--module", "dslab.drivers.zero_memory"]
    assert launch.script_module("hello") == "dslab.recipes.hello" and launch.script_module("mine") is None


# ---- keyword arguments -> command-line words -> a recipe's parser: the same values back --------------------------

def recipe_parser():
    """A parser as the recipes and drivers write one: each form launch.keyword_argv writes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's, unless --no_local_rank
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--name", default="x")
    parser.add_argument("--model", default=None)
    parser.add_argument("--sizes", type=json.loads, default=[])
    parser.add_argument("--shape", type=json.loads, default={})
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("--other_flag", action="store_true")
    return parser


def test_keyword_argv_writes_each_form_a_recipe_declares():
    assert launch.keyword_argv({"steps": 8, "lr": 3e-4, "name": "plain text", "sizes": [1, "a"], "shape": {"n": 2},
                                "flag": True, "other_flag": False, "model": None}) == \
        ["--steps", "8", "--lr", "0.0003", "--name", "plain text", "--sizes", '[1, "a"]', "--shape", '{"n": 2}', "--flag"]


def test_what_launch_writes_parses_back_to_the_same_values():
    values = {"steps": 8, "lr": 3e-4, "name": "run one", "sizes": [[0], [1]], "shape": {"hidden_size": 64},
              "flag": True, "other_flag": False, "model": None}
    args = vars(recipe_parser().parse_args(launch.keyword_argv(values)))
    assert args == {**values, "local_rank": -1}
    # the words of a launch shown as a command line, then split by a shell, are the same words
    words = launch.keyword_argv(values)
    assert shlex.split(shlex.join(words)) == words


def test_a_recipe_parser_takes_the_deepspeed_launchers_local_rank_and_names_unknown_options():
    parser = recipe_parser()
    assert parser.parse_args(["--local_rank=1", "--steps", "3"]).local_rank == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--stpes", "3"])


def test_the_sft_recipe_parses_what_dslab_sft_passes(tmp_path):
    """The settings dslab.training.sft.run hands to launch.run (sft_settings.recipe_arguments), written as the ranks'
    argv and parsed by the recipe's own parser: the values set arrive as set, lists included; the others get their
    defaults there; the launcher's own settings (ranks, time limit) never reach the recipe."""
    from dslab.recipes import sft as recipe
    from dslab.training import sft_settings

    chosen = {"zero_stage": 3, "epochs": 2, "full": True, "lr": 1e-4, "data": [str(tmp_path / "a.jsonl")],
              "model_name": ["鲸", "Whale"], "mix_general": 0, "deepspeed": str(tmp_path / "ds.json"),
              "gradient_checkpointing": True, "max_length": 64, "world_size": 4, "timeout": 9.0}
    values = sft_settings.resolve({**chosen, "output": str(tmp_path / "out")})
    args = vars(recipe.parse_args(launch.keyword_argv(sft_settings.recipe_arguments(values))))
    for s in sft_settings.SETTINGS:
        if s.on_ranks:
            wanted = values[s.name]
            assert args[s.recipe_name] == (list(wanted) if isinstance(wanted, tuple) else wanted), s.name
        else:
            assert s.recipe_name not in args, s.name


def test_save_rank_result_is_a_no_op_outside_launch(monkeypatch, tmp_path):
    monkeypatch.delenv(this_rank.RESULT_DIR_ENV, raising=False)
    this_rank.save_rank_result({"a": 1})  # nothing to write to, nothing raised
    monkeypatch.setenv(this_rank.RESULT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    this_rank.save_rank_result({"a": 1})
    assert os.listdir(tmp_path) == ["rank3.json"]


# ---- command lines as a learner types them --------------------------------------------------------------

ARGPARSE_REPORTING = """
import argparse, os
from dslab import this_rank
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
parser.add_argument("--tag", default="none")
args = parser.parse_args()
this_rank.save_rank_result({"rank": this_rank.rank(), "world_size": this_rank.world_size(), "tag": args.tag,
                            "local_rank": args.local_rank, "local_size": os.environ.get("LOCAL_SIZE")})
print(f"hello from rank {this_rank.rank()}")
"""


def test_run_commands_runs_the_deepspeed_line_as_typed_and_prefixes_each_rank(tmp_path, capsys):
    script = _script(tmp_path, "hello.py", ARGPARSE_REPORTING)
    result = launch.run_commands(f"deepspeed --num_gpus 2 {script} --tag typed", run_dir=tmp_path, timeout=60)
    out = capsys.readouterr().out
    log_dir = tmp_path / "hello" / "logs"
    # the additions (a free port, the per-rank log directory) go before the script; the line printed is what ran
    assert re.search(rf"\$ deepspeed --num_gpus 2 --master_port \d+ --enable_each_rank_log {log_dir} {script} --tag typed\n", out)
    assert "[rank0] hello from rank 0" in out and "[rank1] hello from rank 1" in out
    assert [(r["rank"], r["tag"], r["local_rank"], r["local_size"]) for r in result.results] == \
        [(0, "typed", 0, "2"), (1, "typed", 1, "2")]
    assert_no_strays(script)


def test_run_commands_stops_every_node_when_one_fails(tmp_path):
    # node 0's rank would sleep 10 minutes: the job ends with node 1's error long before the timeout
    script = _script(tmp_path, "node_fails.py", FAILING.replace("time.sleep(120)", "time.sleep(600)"))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = launch.free_port()
    with pytest.raises(launch.LaunchError) as info:
        launch.run_commands([f"deepspeed --hostfile {hostfile} --no_ssh --node_rank={i} --master_addr 127.0.0.1 "
                             f"--master_port {port} --no_local_rank {script}" for i in range(2)],
                            run_dir=tmp_path, stream=False, timeout=400)
    assert "rank 1 failed (node 1)" in str(info.value) and "ValueError: rank 1 fails on purpose" in str(info.value)
    assert_no_strays(script)


@pytest.mark.parametrize("command, message", [
    ("python train.py", "start the command with one of deepspeed, torchrun"),
    ("deepspeed --num_gpus 2", "no training script"),
])
def test_run_commands_refuses_what_it_cannot_run(tmp_path, command, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.run_commands(command, run_dir=tmp_path)


@pytest.mark.parametrize("argv, position, name", [
    (["deepspeed", "--num_gpus", "2", "train.py", "--lr", "1e-3"], 3, "train"),
    (["deepspeed", "--num_gpus", "2", "--module", "dslab.recipes.sft", "--output", "x.py"], 3, "sft"),
    (["torchrun", "--nnodes", "2", "-m", "dslab.recipes.collectives", "--numel", "8"], 3, "collectives"),
])
def test_launcher_options_end_at_the_script_or_the_flag_that_names_its_module(argv, position, name):
    """One rule: what dslab adds (a port, a log folder) goes where the launcher's own options end."""
    from dslab.launch.commands import script_name, script_position

    assert script_position(argv) == position and script_name(argv) == name


# ---- children die with their owner (dslab.launch.guard) ----------------------------------------------------------

# The owner starts a "launcher" (here: sleep) in a session of its own, as dslab.launch does, then waits to be killed.
OWNER = """
import subprocess, sys, time
from dslab.launch import guard
how = sys.argv[1]
env = {"PATH": "/usr/bin:/bin", guard.JOB_ENV: sys.argv[2]}
if how == "guard":
    guard.start_guard(marker=(guard.JOB_ENV, sys.argv[2]))
    child = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
else:
    child = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True, preexec_fn=guard.parent_death_signal())
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["guard", "parent_death_signal"])
def test_a_child_in_its_own_session_dies_when_its_owner_is_sigkilled(how):
    from dslab.launch import guard

    marker = f"test-{os.getpid()}-{how}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, how, marker], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(owner.stdout.readline()))
        assert guard.is_running(child) and os.getpgid(child.pid) != os.getpgid(owner.pid)
        owner.kill()  # SIGKILL: no code of the owner runs any more
        owner.wait()
        assert guard.wait_gone([child], timeout=5), f"{how}: the child outlived its owner"
        assert guard.processes_with_env(guard.JOB_ENV, marker) == []
    finally:
        owner.kill()
        for proc in guard.processes_with_env(guard.JOB_ENV, marker):
            proc.kill()


# The guard as `python -m dslab.launch guard` runs it, after the system clock was stepped by one second (NTP does
# that): every wall-clock process start time psutil computes moves with the boot time it adds.
CLOCK_STEPPED_GUARD = """
import json, sys
from psutil import _pslinux
from dslab.launch import guard
boot_time = _pslinux.boot_time
_pslinux.boot_time = lambda: boot_time() + 1.0
guard.watch(json.loads(sys.argv[1]), poll=0.05)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="steps the clock as psutil reads it on Linux")
def test_a_clock_step_is_not_the_owners_death():
    from dslab.launch import guard

    marker = f"test-{os.getpid()}-clock"
    child = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", guard.JOB_ENV: marker},
                             start_new_session=True)
    spec = {"owner": os.getpid(), "groups": [], "marker": [guard.JOB_ENV, marker], "remove": [], "master_port": None}
    watcher = subprocess.Popen([sys.executable, "-c", CLOCK_STEPPED_GUARD, json.dumps(spec)])
    try:
        time.sleep(3)   # the guard has polled its owner about 60 times by now
        assert watcher.poll() is None, "the guard took a clock step for its owner's death"
        assert child.poll() is None, "the guard stopped a job whose owner runs"
    finally:
        watcher.kill()
        child.kill()
        watcher.wait()
        child.wait()


def test_the_starting_process_place_does_not_reach_the_launcher(monkeypatch, tmp_path):
    # A kernel or test that ran DeepSpeed in-process has RANK=0, WORLD_SIZE=1, ...: the launcher assigns places
    # itself, and the hang watch finds a job's ranks by RANK (an inherited one made it read the launcher's stack).
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.setenv(var, "0")
    env = launch.supervise.rank_environment(2, tmp_path)
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE"} & set(env)


def test_a_port_whose_job_just_ended_is_free_and_one_listened_on_is_not():
    # torch's rendezvous store listens with SO_REUSEADDR; when a job ends, its connections linger in TIME_WAIT. The
    # port is free for the next job then, and the ended job's /dev/shm buffers (named by port) are removed as stale.
    store = socket.socket()
    store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    store.bind(("127.0.0.1", 0))
    store.listen()
    port = store.getsockname()[1]
    assert not launch.port_is_free(port)
    rank = socket.create_connection(("127.0.0.1", port))
    accepted, _ = store.accept()
    accepted.close()          # the store's side closes first: its end of the connection waits in TIME_WAIT
    time.sleep(0.1)
    rank.close()
    store.close()
    time.sleep(0.1)
    assert launch.port_is_free(port)
