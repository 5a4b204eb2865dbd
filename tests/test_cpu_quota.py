"""Cores a learner may really use: affinity and the cgroup's CPU quota (dslab.machine.cpu_cores), the smaller
wins, and every place that starts ranks gives each its share. The cgroup files are written to a temporary folder
(the reader takes the cgroup root and the text of /proc/self/cgroup as arguments); one test runs a process under a
real 1-core quota where this machine lets root create a cgroup."""
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from dslab import env, live, machine
from dslab.launch import frameworks, supervise

ROOT = Path(__file__).resolve().parent.parent


def _write(root, path, files):
    folder = root / path.strip("/")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text + "\n")
    return folder


def _quota(root, proc_cgroup):
    return machine.cgroup_cpu_quota(root, proc_cgroup)


@pytest.fixture
def server(monkeypatch):
    """A server with `cores` cores in this process's affinity and a cgroup quota of `quota` cores (None: none)."""
    def make(cores, quota):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda *args, **kwargs: quota)
    return make


# --------------------------------------------------------------------------- the reader, on files in a temporary folder

def test_v2_cpu_max_with_a_quota(tmp_path):
    _write(tmp_path, "/user.slice/alice", {"cpu.max": "200000 100000"})
    assert _quota(tmp_path, "0::/user.slice/alice\n") == 2.0


def test_v2_cpu_max_without_a_quota(tmp_path):
    _write(tmp_path, "/user.slice/alice", {"cpu.max": "max 100000"})
    assert _quota(tmp_path, "0::/user.slice/alice\n") is None


def test_v2_a_tighter_parent_caps_its_children(tmp_path):
    # JupyterHub's slice holds every learner: 4 cores for all; the learner's own cgroup has no limit, or a looser one
    _write(tmp_path, "/hub.slice", {"cpu.max": "400000 100000"})
    _write(tmp_path, "/hub.slice/learner-7", {"cpu.max": "max 100000"})
    _write(tmp_path, "/hub.slice/learner-7/kernel", {"cpu.max": "800000 100000"})
    assert _quota(tmp_path, "0::/hub.slice/learner-7/kernel\n") == 4.0
    # ... and a child tighter than its parent wins over the parent; periods may differ from level to level
    _write(tmp_path, "/hub.slice/learner-7", {"cpu.max": "25000 10000"})
    assert _quota(tmp_path, "0::/hub.slice/learner-7/kernel\n") == 2.5


def test_v1_cfs_quota_and_period(tmp_path):
    _write(tmp_path, "/cpu,cpuacct/docker/abc", {"cpu.cfs_quota_us": "300000", "cpu.cfs_period_us": "100000"})
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert _quota(tmp_path, proc) == 3.0
    _write(tmp_path, "/cpu,cpuacct/docker/abc", {"cpu.cfs_quota_us": "-1"})  # -1: no quota
    assert _quota(tmp_path, proc) is None


def test_v1_mounted_as_cpu_alone_and_a_container_without_a_cgroup_namespace(tmp_path):
    # The v1 cpu hierarchy at root/cpu; the container sees only its own cgroup mounted there, while /proc/self/cgroup
    # names it from the host's root (/kubepods/pod1/ctr): the parts that do not exist here are dropped.
    _write(tmp_path, "/cpu", {"cpu.cfs_quota_us": "200000", "cpu.cfs_period_us": "100000"})
    assert _quota(tmp_path, "3:cpu:/kubepods/pod1/ctr\n2:cpuacct:/kubepods/pod1/ctr\n") == 2.0


def test_a_hybrid_machine_reads_the_quota_where_the_cpu_controller_is(tmp_path):
    # v1 controllers at root/<name>, an empty v2 hierarchy at root/unified (this course's own test machines)
    _write(tmp_path, "/unified", {"cgroup.controllers": ""})
    _write(tmp_path, "/cpu/course", {"cpu.cfs_quota_us": "100000", "cpu.cfs_period_us": "100000"})
    assert _quota(tmp_path, "1:cpu:/course\n0::/\n") == 1.0
    assert _quota(tmp_path, "1:cpu:/\n0::/\n") is None


def test_no_cgroup_filesystem_at_all(tmp_path):
    assert _quota(tmp_path / "absent", "0::/user.slice\n4:cpu,cpuacct:/\n") is None
    assert _quota(tmp_path, "") is None                                  # no /proc/self/cgroup (not Linux)
    _write(tmp_path, "/a", {"cpu.max": "garbage"})
    assert _quota(tmp_path, "0::/a\n") is None                           # unreadable: no quota, no error


def test_a_fractional_quota_rounds_down_and_never_below_one():
    # Rounded down: more threads than the quota spends it early in each period and then the whole cgroup stops
    # until the next one (throttling); the kernel and gloo's threads use the fraction left over.
    assert [machine.quota_cores(q) for q in (1.5, 0.5, 0.01, 2.0, 2.99, None)] == [1, 1, 1, 2, 2, None]


def test_the_smaller_of_affinity_and_quota_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    _write(tmp_path, "/learner", {"cpu.max": "150000 100000"})
    assert machine.cpu_cores(tmp_path, "0::/learner\n") == {
        "affinity": 64, "quota": 1.5, "quota_cores": 1, "usable": 1, "limited_by": "quota"}
    _write(tmp_path, "/learner", {"cpu.max": "800000 100000"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})       # taskset -c 0,1 inside an 8-core quota
    assert machine.cpu_cores(tmp_path, "0::/learner\n") == {
        "affinity": 2, "quota": 8.0, "quota_cores": 8, "usable": 2, "limited_by": "affinity"}
    assert machine.cpu_cores(tmp_path / "absent", "0::/learner\n")["usable"] == 2


def test_this_machine_reads_without_error():
    cores = machine.cpu_cores()
    assert 1 <= cores["usable"] <= cores["affinity"] <= (os.cpu_count() or cores["affinity"])
    assert machine.usable_cores() == cores["usable"]


# --------------------------------------------------------------------------- threads per rank, everywhere

def test_live_ranks_get_the_quota_s_cores_shared_out(server):
    server(cores=64, quota=4.0)     # the workshop: a 64-core server, a 4-core limit per learner
    assert live._engine_environment(2)["OMP_NUM_THREADS"] == live._engine_environment(2)["MKL_NUM_THREADS"] == "2"
    server(cores=64, quota=1.5)
    assert live._engine_environment(2)["OMP_NUM_THREADS"] == "1"
    server(cores=64, quota=None)
    assert live._engine_environment(2)["OMP_NUM_THREADS"] == "32"


def test_launched_ranks_get_the_quota_s_cores_shared_out(server, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))   # rank_environment puts dslab's ninja first
    monkeypatch.setattr(supervise, "gpu_count", lambda: 0)  # CPU ranks: the launcher sets their threads
    server(cores=64, quota=4.0)
    assert supervise.rank_environment(2, tmp_path)["OMP_NUM_THREADS"] == "2"
    assert supervise.rank_environment(1, tmp_path)["OMP_NUM_THREADS"] == "4"
    server(cores=2, quota=8.0)      # affinity smaller: it wins
    assert supervise.rank_environment(1, tmp_path)["OMP_NUM_THREADS"] == "2"


def test_the_frameworks_runs_get_the_quota_s_cores_shared_out(server, monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    server(cores=64, quota=4.0)
    one = [frameworks.split_framework_command("NPROC_PER_NODE=2 swift sft --model m")]
    two_nodes = [frameworks.split_framework_command(f"NNODES=2 NODE_RANK={i} NPROC_PER_NODE=1 swift sft")
                 for i in (0, 1)]
    single = [frameworks.split_framework_command("swift infer --model m")]
    assert [frameworks.ranks_here(p) for p in (one, two_nodes, single)] == [2, 2, 1]
    bin_dir = tmp_path / ".venv-swift" / "bin"
    assert frameworks.framework_environment(one[0][0], bin_dir, 2)["OMP_NUM_THREADS"] == "2"
    assert frameworks.framework_environment(single[0][0], bin_dir, 1)["OMP_NUM_THREADS"] == "4"
    own = frameworks.split_framework_command("OMP_NUM_THREADS=3 swift sft")[0]   # the line's own setting is kept
    assert frameworks.framework_environment(own, bin_dir, 1)["OMP_NUM_THREADS"] == "3"


def test_the_env_report_shows_affinity_quota_and_which_wins(server, monkeypatch):
    monkeypatch.setenv("DSLAB_LANG", "en")
    server(cores=64, quota=1.5)
    cpu = machine.cpu_info()
    assert (cpu["cores_usable"], cpu["cores_affinity"], cpu["cpu_quota"], cpu["cores_quota"],
            cpu["cores_limited_by"]) == (1, 64, 1.5, 1, "quota")
    rep = {"versions": {}, "platform": "Linux x86_64", "cpu": cpu, "memory": {"total_gib": 1, "available_gib": 1},
           "accelerator": {"name": "cpu", "communication_backend": "gloo", "bf16_supported": True,
                           "fp16_supported": False},
           "gpus": [], "topology": None, "build_tools": {}, "torch_extensions_dir": "x", "ops": {},
           "async_io": {"op": "async_io", "compatible": False}, "features": []}
    text = env.format_report(rep)
    assert "  cores usable / total  1 / " in text
    assert "  cpu quota (cgroup)    1.5 cores -> 1 (rounded down); affinity: 64; the quota wins" in text
    server(cores=2, quota=None)     # no quota (a laptop): the report reads as it always did, no quota row
    rep["cpu"] = machine.cpu_info()
    assert "cpu quota" not in env.format_report(rep) and rep["cpu"]["cores_limited_by"] == "affinity"


# --------------------------------------------------------------------------- a real quota

CHILD = textwrap.dedent("""
    import json, subprocess, sys, tempfile
    from dslab import live, machine
    from dslab.launch import supervise
    rank_env = supervise.rank_environment(1, tempfile.gettempdir())   # what the launcher gives a CPU rank
    rank = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=rank_env,
                          capture_output=True, text=True, check=True)  # a rank in the same cgroup, as launched
    print(json.dumps({"cores": machine.cpu_cores(), "gpus": machine.gpu_count(),
                      "live": live._engine_environment(1)["OMP_NUM_THREADS"],
                      "launcher": rank_env.get("OMP_NUM_THREADS"), "rank_threads": int(rank.stdout.strip()),
                      "cgroup": open("/proc/self/cgroup").read()}))
""")


def _cgroup_for_one_core():
    """(folder of a new child cgroup limited to one core, its cgroup.procs), or pytest.skip with the reason."""
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    root = Path(machine.CGROUP_ROOT)
    name = f"dslab-test-{uuid.uuid4().hex[:8]}"
    v2_control = root / "cgroup.subtree_control"
    v1 = next((root / d for d in ("cpu", "cpu,cpuacct") if (root / d / "cpu.cfs_quota_us").exists()), None)
    if v2_control.exists() and "cpu" in v2_control.read_text().split():
        folder, files = root / name, {"cpu.max": "100000 100000"}
    elif v1 is not None:
        folder, files = v1 / name, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
    else:
        pytest.skip(f"no cgroup with the cpu controller to create one under at {root} (cgroup v2 with cpu in "
                    "cgroup.subtree_control, or cgroup v1's cpu hierarchy)")
    try:
        folder.mkdir()
    except OSError as e:
        pytest.skip(f"this machine does not let root create a cgroup at {folder}: {e}")
    try:
        for file, value in files.items():
            (folder / file).write_text(value)
    except OSError as e:
        folder.rmdir()
        pytest.skip(f"this machine does not let root set a CPU quota on {folder}: {e}")
    return folder


def test_a_process_under_a_real_one_core_quota_and_its_ranks_use_one_core():
    folder = _cgroup_for_one_core()
    procs = str(folder / "cgroup.procs")

    def enter():  # in the child, before it runs Python: join the cgroup (its children, the ranks, are born in it)
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    try:
        run = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, preexec_fn=enter, capture_output=True,
                             text=True, timeout=300)
    finally:
        for _ in range(50):  # a cgroup can be removed once its last process is gone
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert folder.name in seen["cgroup"], seen["cgroup"]
    assert seen["cores"]["quota"] == 1.0 and seen["cores"]["usable"] == 1, seen["cores"]
    assert seen["cores"]["limited_by"] == ("quota" if seen["cores"]["affinity"] > 1 else "affinity")
    assert seen["live"] == "1"
    if seen["gpus"] == 0:   # CPU ranks: the launcher sets their threads (GPU ranks are left as they are)
        assert seen["launcher"] == "1" and seen["rank_threads"] == 1
