"""Communication basics: what each collective moves, the variables launchers set, torchrun runs, and the
checker of exercise 01.average_gradients (the learner's gradient averaging, run on the live ranks)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dslab.exercises import exercise

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


# ---- Exercise 01.average_gradients: the learner writes DDP's all-reduce, the live ranks run it ------------------

def _average_gradients_trial(average_gradients):
    """On each rank: gradients of a tiny model on this rank's share of a batch, then the learner's averaging."""
    import torch
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    torch.manual_seed(0)                                  # the same model and the same batch on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x, y = torch.randn(2 * world_size, 4), torch.randn(2 * world_size, 1)

    def gradients(rows):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        return [p.grad.clone() for p in model.parameters()]

    full = gradients(slice(None))                         # the whole batch: what the average must equal
    local = gradients(slice(2 * rank, 2 * rank + 2))      # this rank's share, left in p.grad as after backward()
    average_gradients(model)
    after = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return {"world_size": world_size, "full": full, "local": local, "after": after}


def _diagnose_average_gradients(results):
    """None if every rank holds the full-batch gradient; else the mistake, in words."""
    import torch

    from dslab.exercises import Mistake

    n, count = results[0]["world_size"], len(results[0]["full"])

    def equal(grads, target):
        return all(g is not None and g.shape == t.shape and torch.allclose(g, t, rtol=1e-4, atol=1e-7)
                   for g, t in zip(grads, target))

    def everywhere(target_of):
        return all(equal(r["after"], target_of(r)) for r in results)

    if everywhere(lambda r: r["full"]):
        return None
    if any(g is None for r in results for g in r["after"]):
        raise Mistake("p.grad is None after your function: leave the averaged gradients in p.grad "
                      "(no zero_grad, no p.grad = None), the optimizer step reads them there.")
    total = [sum(r["local"][i] for r in results) for i in range(count)]
    if everywhere(lambda r: total):
        raise Mistake(f"the gradients are the sum over the {n} ranks, {n} times the mean: all_reduce adds "
                      "(ReduceOp.SUM). Divide by dist.get_world_size() afterwards, as DDP does.")
    if everywhere(lambda r: results[0]["local"]):
        raise Mistake("every rank now holds rank 0's gradients: that is a broadcast, which copies one rank's "
                      "values. An average needs every rank's gradient: all_reduce (sum), then divide by world size.")
    if everywhere(lambda r: r["local"]):
        raise Mistake("p.grad did not change on any rank. all_reduce changes the tensor it is given, in place, and "
                      "returns None; p.grad / n or p.grad.clone() is a new tensor the model never sees. "
                      "Call dist.all_reduce(p.grad), then p.grad /= world_size (or p.grad.div_(world_size)).")
    if everywhere(lambda r: [g / n for g in r["local"]]):
        raise Mistake("each rank divided its own gradients by world size without all-reducing them: no rank "
                      "saw another rank's gradients.")
    missed = [i for i in range(count) if not all(equal([r["after"][i]], [r["full"][i]]) for r in results)]
    if len(missed) < count:
        shapes = ", ".join(str(tuple(results[0]["full"][i].shape)) for i in missed)
        raise Mistake(f"{len(missed)} of the model's {count} parameters were not averaged (shapes {shapes}): "
                      "loop over every tensor of model.parameters(), biases included.")
    raise Mistake("the gradients are not the mean over the ranks of each rank's gradient. Sum them with "
                  "dist.all_reduce(p.grad) on every rank, then divide by dist.get_world_size().")


def _sum_only(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)


def _broadcast_from_rank0(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.broadcast(p.grad, src=0)


def _reduce_a_copy(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad / dist.get_world_size())


def _weights_only(model):
    import torch.distributed as dist

    for name, p in model.named_parameters():
        if name.endswith("weight"):
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@exercise("01.average_gradients", wrong=(_sum_only, _broadcast_from_rank0, _reduce_a_copy, _weights_only),
          hint="write a function average_gradients(model) that, on every rank after loss.backward(), makes each "
               "p.grad the mean over the ranks of that gradient (import torch.distributed inside it).")
def _check_average_gradients(average_gradients, timeout=120):
    """Run the learner's average_gradients on the live ranks (started here if none run) and name any mistake."""
    from ipyparallel import error

    from dslab import live
    from dslab.exercises import Mistake

    if not callable(average_gradients):
        return False
    ranks = live.running() or live.start(world_size=2)
    try:
        results = ranks.apply_async(_average_gradients_trial, average_gradients).get(timeout)
    except error.TimeoutError:
        ranks.stop()    # ranks blocked in a collective that the others never call can only be stopped
        raise Mistake(f"your function did not finish within {timeout} s on every rank, so the ranks were stopped: "
                      "a collective called by only some ranks (inside `if rank == 0:`, say) waits forever. "
                      "Start the ranks again (run the chapter from the top) and call it on every rank.") from None
    except error.CompositeError as failed:
        ename, evalue = failed.elist[0][:2]
        raise Mistake(f"your function raised {ename}: {evalue}") from None
    return _diagnose_average_gradients(results) is None
