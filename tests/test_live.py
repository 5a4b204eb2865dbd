"""Live ranks (dslab.live): real DeepSpeed on 2 engine processes, and nothing left running afterwards.

Other sessions may run their own ipyparallel clusters on the same machine, so "nothing left" is checked for
this test's cluster: every process ipyparallel starts carries the cluster's private IPP_PROFILE_DIR.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from dslab import live
from dslab.launch.guard import is_running
from dslab.machine import usable_cores

ROOT = Path(__file__).resolve().parent.parent


def _zero2_bf16_steps(steps):
    """On each rank: join the group, ZeRO-2 + bf16 on a tiny model, a few steps on this rank's own data."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)                    # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    generator = torch.Generator().manual_seed(100 + rank)   # each rank its own batch, as a sampler would give
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=generator).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        # The ranks' losses differ (different data); their mean is what both ranks report below.
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
    first = next(engine.module.parameters())
    return {"losses": losses, "stage": engine.zero_optimization_stage(), "bf16": engine.bfloat16_enabled(),
            "weights": first.detach().float().sum().item()}


def _environment():
    import os

    import torch

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_WAIT_POLICY")
    return {**{k: os.environ.get(k) for k in keys}, "threads": torch.get_num_threads(), "cwd": os.getcwd()}


def _wait_until_gone(processes, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in processes if is_running(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [(p.pid, " ".join(p.cmdline()[:3])) for p in processes if is_running(p)]


def _shm_buffers(port):
    return [p for p in os.listdir("/dev/shm") if p.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in p]


def test_two_live_ranks_train_zero2_bf16_in_lockstep_then_stop_leaves_nothing():
    ranks = live.start(world_size=2)
    try:
        assert live.start(world_size=2) is ranks          # idempotent within a process
        envs = ranks.apply(_environment)
        assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert all(e["WORLD_SIZE"] == e["LOCAL_SIZE"] == "2" and e["MASTER_ADDR"] == "127.0.0.1" for e in envs)
        assert {e["MASTER_PORT"] for e in envs} == {str(ranks.master_port)}
        assert all(e["OMP_WAIT_POLICY"] == "PASSIVE" and e["cwd"] == os.getcwd() for e in envs)
        assert all(e["threads"] == max(1, usable_cores() // 2) for e in envs)

        results = ranks.apply(_zero2_bf16_steps, 3)
        assert [r["stage"] for r in results] == [2, 2] and all(r["bf16"] for r in results)
        assert results[0]["losses"] == results[1]["losses"]     # lock-step: the same averaged loss on both
        assert results[0]["weights"] == results[1]["weights"]   # ... and the same weights after 3 steps
        ranks.push({"answer": 42})
        assert ranks.pull("answer") == [42, 42]
        processes = ranks.processes()
        assert len(processes) >= 1 + 2 * 2                        # controller, 2 engines, 2 nannies at least
        assert _shm_buffers(ranks.master_port)                  # DeepSpeed's CPU all-reduce buffers exist
    finally:
        ranks.stop()
    ranks.stop()                                                  # idempotent
    assert live.running() is None
    assert _wait_until_gone(processes, timeout=5) == []          # stop() waits for them itself
    assert ranks.processes() == []
    assert _shm_buffers(ranks.master_port) == []
    assert not os.path.exists(ranks.profile_dir)
    with pytest.raises(RuntimeError, match="stopped"):
        ranks.pull("answer")


OWNER = textwrap.dedent("""
    import json, os, sys, time
    from dslab import live
    ranks = live.start(world_size=2)
    print(json.dumps({"profile_dir": ranks.profile_dir, "pids": ranks.pids}), flush=True)
    time.sleep(600)
""")


def test_ranks_die_with_the_process_that_started_them_even_when_it_is_sigkilled(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        info = json.loads(owner.stdout.readline())
        processes = live.cluster_processes(info["profile_dir"])
        guards = [p for p in psutil.Process(owner.pid).children() if "dslab.launch guard" in " ".join(p.cmdline())]
        assert len(processes) >= 5 and len(guards) == 1
        os.kill(owner.pid, signal.SIGKILL)                    # no atexit, no cleanup code runs in the owner
        owner.wait()
        assert _wait_until_gone(processes + guards) == []        # the guard cleans up, then exits
        assert live.cluster_processes(info["profile_dir"]) == []
        assert not os.path.exists(info["profile_dir"])
    finally:
        if owner.poll() is None:
            owner.kill()


@pytest.mark.parametrize("shutdown", ["graceful", "killed"])
def test_nothing_is_left_after_a_notebook_kernel_ends(tmp_path, shutdown):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("from dslab import live\nranks = live.start(world_size=2)"),
        nbformat.v4.new_code_cell("%%px\nimport os\nrank = int(os.environ['RANK'])\nprint('rank', rank)"),
        nbformat.v4.new_code_cell("import json\nprint(json.dumps({'profile_dir': ranks.profile_dir, "
                                  "'ranks': ranks.pull('rank')}))"),
    ])
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        client.execute_cell(nb.cells[0], 0)
        client.execute_cell(nb.cells[1], 1)
        client.execute_cell(nb.cells[2], 2)
        kernel = psutil.Process(client.km.provisioner.process.pid)
        if shutdown == "killed":                               # as a kernel restart or a crash would end it
            kernel.kill()
    assert nb.cells[1].outputs[0]["text"] == "[stdout:0] \nrank 0\n[stdout:1] \nrank 1\n"
    info = json.loads(nb.cells[2].outputs[0]["text"])
    assert info["ranks"] == [0, 1]
    assert not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE
    deadline = time.monotonic() + 20   # a killed kernel leaves the cleaning to the guard: give it time
    while (live.cluster_processes(info["profile_dir"]) or os.path.exists(info["profile_dir"])) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live.cluster_processes(info["profile_dir"]) == []
    assert not os.path.exists(info["profile_dir"])
