"""Communication basics: what each collective moves, the variables launchers set, and torchrun runs."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The variables a launcher sets for each rank, and what they mean. torch.distributed reads the first
# five to join the process group (init_method "env://"); the others describe the machine layout.
LAUNCHER_VARIABLES = {
    "RANK": "global rank of this process, 0 .. WORLD_SIZE-1",
    "WORLD_SIZE": "number of processes in the job",
    "LOCAL_RANK": "rank on this machine: picks the GPU (cuda:LOCAL_RANK)",
    "MASTER_ADDR": "host of rank 0, where the rendezvous store listens",
    "MASTER_PORT": "port of that store",
    "LOCAL_SIZE": "processes on this machine (deepspeed launcher)",
    "LOCAL_WORLD_SIZE": "processes on this machine (torchrun)",
    "CROSS_RANK": "index of this machine among the machines (deepspeed launcher)",
    "CROSS_SIZE": "number of machines (deepspeed launcher)",
    "GROUP_RANK": "index of this machine among the machines (torchrun)",
    "TORCHELASTIC_RUN_ID": "job id of an elastic run (torchrun)",
}


def launcher_env():
    """The launcher variables this process received (those of LAUNCHER_VARIABLES that are set)."""
    return {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ}


# Bytes each rank sends in the bandwidth-optimal ring algorithms (NCCL's and gloo's large-message
# choice), as a multiple of the message size M (for all-reduce M is the tensor each rank holds; for
# all-gather the gathered result; for reduce-scatter the full input).
RING_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,  # a reduce-scatter then an all-gather
    "reduce_scatter": lambda n: (n - 1) / n,  # N-1 steps, each passing one 1/N chunk on
    "all_gather": lambda n: (n - 1) / n,
}


def ring_bytes(op, message_bytes, world_size):
    """Bytes one rank sends in a ring `op` ("all_reduce", "reduce_scatter", "all_gather") on world_size ranks."""
    if op not in RING_FACTORS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(RING_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return RING_FACTORS[op](world_size) * message_bytes


def ring_allreduce_bytes(message_bytes, world_size):
    """Bytes one rank sends in a ring all-reduce: 2(N-1)/N x the message size."""
    return ring_bytes("all_reduce", message_bytes, world_size)


def bytes_written():
    """Bytes this process has written so far (Linux /proc/self/io `wchar`, sockets included); None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def torchrun(recipe, world_size=2, timeout=300, **recipe_kwargs):
    """Run a dslab recipe with `torchrun` instead of the deepspeed launcher; returns a LaunchResult.

    Same recipes, same results: only the launcher (and so the environment each rank gets) changes.
    """
    from dslab import launch

    run_dir = Path(os.environ.get("DSLAB_RUNS_DIR", "runs")) / f"{recipe}-torchrun"
    result_dir = run_dir / "results"
    result_dir.mkdir(parents=True, exist_ok=True)
    for old in result_dir.glob("*.json"):
        old.unlink()
    if not (launch.RECIPES_DIR / f"{recipe}.py").exists():
        raise launch.LaunchError(f"{recipe!r} is not a dslab recipe")
    port = launch.free_port()
    exe = Path(sys.executable).parent / "torchrun"
    cmd = [str(exe) if exe.exists() else "torchrun", "--nproc_per_node", str(world_size),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", f"dslab.recipes.{recipe}"]
    for key, value in recipe_kwargs.items():
        cmd += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    print("$ " + " ".join(["torchrun"] + cmd[1:]), flush=True)
    env = launch._rank_env(world_size, result_dir.resolve())
    start = time.time()
    # Own session, so one killpg stops torchrun and every rank it started.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        launch._kill_group(proc)
        output, _ = proc.communicate()
        (run_dir / "torchrun.log").write_text(output)
        raise launch.LaunchError(f"torchrun {recipe} did not finish within {timeout} s; all ranks were stopped. "
                                 f"Last output:\n{output[-3000:]}") from exc
    finally:
        launch._kill_group(proc)
    (run_dir / "torchrun.log").write_text(output)
    if proc.returncode != 0:
        raise launch.LaunchError(f"torchrun {recipe} failed (exit status {proc.returncode}) after "
                                 f"{time.time() - start:.0f} s:\n{output[-3000:]}")
    for line in output.splitlines():  # echo what the recipe printed, not the launcher's and DeepSpeed's logs
        if line.strip() and not launch._NOISE.search(line):
            print(line, flush=True)
    results = []
    for r in range(world_size):
        path = result_dir / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return launch.LaunchResult(command=cmd, returncode=0, results=results, log=output, run_dir=str(run_dir))
