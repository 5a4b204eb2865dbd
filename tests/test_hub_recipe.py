"""The JupyterHub recipe's plain-Python part (deploy/jupyterhub/dslab_hub.py), on files in a temporary folder: the
learner's cgroup as cgroup v2 and v1 lay it out, read back by the kit's own reader (dslab.machine), and the
learner's copy of the course. The hub itself runs in tests/jupyterhub (make test-jupyterhub), on this machine's real
cgroups, which are one of the two layouts only; the recipe's pins are checked against the kit's here too."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import machine

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "jupyterhub"
sys.path.insert(0, str(DEPLOY))
import dslab_hub  # noqa: E402 (deploy/jupyterhub is no package: found through sys.path)

GIB = 2 ** 30


def _files(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _v2(root, subtree=""):
    _files(root, {"cgroup.controllers": "cpuset cpu io memory pids", "cgroup.subtree_control": subtree})
    return root


def _v1(root):
    _files(root / "cpu,cpuacct", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    _files(root / "memory", {"memory.limit_in_bytes": "9223372036854771712"})
    _files(root / "unified", {"cgroup.controllers": ""})      # an empty v2 hierarchy beside them, as on hybrid hosts
    return root


def test_cgroup_v2_a_learner_s_quota_and_memory_limit_and_the_kit_reads_the_quota(tmp_path):
    root = _v2(tmp_path)
    cgroup = dslab_hub.LearnerCgroup("ana", "dslab-learners", root).create(cpus=2, memory=4 * GIB)
    folder = root / "dslab-learners" / "learner-ana"
    assert cgroup.version == "v2" and cgroup.procs_files() == [str(folder / "cgroup.procs")]
    assert (folder / "cpu.max").read_text() == "200000 100000"
    assert (folder / "memory.max").read_text() == str(4 * GIB)
    # the root and the parent hand both controllers on to their children (a real kernel then lists them unprefixed)
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert (root / "dslab-learners" / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert cgroup.limits() == {"cpus": 2.0, "memory": 4 * GIB}
    assert machine.cgroup_cpu_quota(root, "0::/dslab-learners/learner-ana\n") == 2.0


def test_cgroup_v2_controllers_already_handed_on_are_left_as_they_are_and_no_limit_is_max(tmp_path):
    root = _v2(tmp_path, subtree="cpu memory io")
    cgroup = dslab_hub.LearnerCgroup("bo", "site/learners", root).create(cpus=None, memory=None)
    folder = root / "site" / "learners" / "learner-bo"
    assert (root / "cgroup.subtree_control").read_text() == "cpu memory io"
    assert (root / "site" / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert ((folder / "cpu.max").read_text(), (folder / "memory.max").read_text()) == ("max 100000", "max")
    assert cgroup.limits() == {"cpus": None, "memory": None}
    assert machine.cgroup_cpu_quota(root, "0::/site/learners/learner-bo\n") is None


def test_cgroup_v1_the_cpu_and_memory_hierarchies_and_the_kit_reads_the_quota(tmp_path):
    root = _v1(tmp_path)
    cgroup = dslab_hub.LearnerCgroup("ana", "dslab-learners", root).create(cpus=1.5, memory=2 * GIB)
    cpu, memory = (root / hierarchy / "dslab-learners" / "learner-ana" for hierarchy in ("cpu,cpuacct", "memory"))
    assert cgroup.version == "v1"
    assert cgroup.procs_files() == [str(cpu / "cgroup.procs"), str(memory / "cgroup.procs")]
    assert ((cpu / "cpu.cfs_period_us").read_text(), (cpu / "cpu.cfs_quota_us").read_text()) == ("100000", "150000")
    assert (memory / "memory.limit_in_bytes").read_text() == str(2 * GIB)
    assert cgroup.limits() == {"cpus": 1.5, "memory": 2 * GIB}
    assert machine.cgroup_cpu_quota(root, "4:memory:/dslab-learners/learner-ana\n2:cpu,cpuacct:/dslab-learners/"
                                          "learner-ana\n0::/\n") == 1.5
    dslab_hub.LearnerCgroup("ana", "dslab-learners", root).create()    # again, without limits: v1's -1
    assert ((cpu / "cpu.cfs_quota_us").read_text(), (memory / "memory.limit_in_bytes").read_text()) == ("-1", "-1")


def test_a_tiny_quota_is_the_kernel_s_smallest_and_names_cannot_leave_the_parent(tmp_path):
    root = _v2(tmp_path)
    dslab_hub.LearnerCgroup("ana", "learners", root).create(cpus=0.001)
    assert (root / "learners" / "learner-ana" / "cpu.max").read_text() == "1000 100000"   # the kernel refuses less
    # a name that would be a cgroup v1 control file, or a path, stays a folder of its own under the parent
    assert [dslab_hub.folder_name(n) for n in ("tasks", "a/b", "../x", "li.wei")] == [
        "learner-tasks", "learner-a_b", "learner-.._x", "learner-li.wei"]
    cgroup = dslab_hub.LearnerCgroup("x", "../../etc/learners", root)
    assert cgroup.folders["cpu"] == root / "etc" / "learners" / "learner-x"


def test_no_cgroup_controllers_is_said_plainly(tmp_path):
    _files(tmp_path, {"cgroup.controllers": "pids"})          # v2 without cpu and memory, no v1 hierarchies
    with pytest.raises(dslab_hub.CgroupError, match="no cgroup hierarchy with the cpu and memory controllers"):
        dslab_hub.LearnerCgroup("ana", "learners", tmp_path)


def _kit(tmp_path):
    kit = tmp_path / "kit"
    for name in ("README.md", "pyproject.toml", "notebooks/00_setup.ipynb", "notebooks/zh/00_setup.ipynb",
                 "notebooks/solutions/01_solutions.py", "data/corpus/a.txt", "dslab/__init__.py", "slides/00.md",
                 "deploy/jupyterhub/dslab_hub.py",
                 # what the kit built or ran: never copied
                 "notebooks/runs/05/model.bin", "build/jupyterhub/venv/x", "slides/build/00.html",
                 "dslab/__pycache__/x.pyc", "dslab.egg-info/PKG-INFO", ".git/HEAD", "notebooks/.ipynb_checkpoints/x",
                 "tests/browser/screenshots/a.png", ".venv/bin/python", ".venv-swift/bin/python"):
        (kit / name).parent.mkdir(parents=True, exist_ok=True)
        (kit / name).write_text(name)
    return kit


def test_the_learner_s_copy_of_the_course_leaves_out_what_the_kit_built_and_links_its_venvs(tmp_path):
    kit, dest = _kit(tmp_path), tmp_path / "home" / "ana" / "dslab"
    dest.parent.mkdir(parents=True)
    assert dslab_hub.copy_course(kit, dest)
    copied = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() and not p.is_symlink())
    assert copied == ["README.md", "data/corpus/a.txt", "deploy/jupyterhub/dslab_hub.py", "dslab/__init__.py",
                      "notebooks/00_setup.ipynb", "notebooks/solutions/01_solutions.py", "notebooks/zh/00_setup.ipynb",
                      "pyproject.toml", "slides/00.md"]
    assert {p.name: p.readlink() for p in dest.iterdir() if p.is_symlink()} == {
        ".venv": kit / ".venv", ".venv-swift": kit / ".venv-swift"}
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dslab"]        # no half copy left beside it


def test_a_learner_s_own_copy_is_never_replaced(tmp_path):
    kit, dest = _kit(tmp_path), tmp_path / "home" / "ana" / "dslab"
    dest.parent.mkdir(parents=True)
    dslab_hub.copy_course(kit, dest)
    (dest / "notebooks" / "00_setup.ipynb").write_text("the learner's work")
    run = subprocess.run([sys.executable, str(DEPLOY / "dslab_hub.py"), "copy-course", str(kit), str(dest)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("kept"), run.stdout + run.stderr
    assert (dest / "notebooks" / "00_setup.ipynb").read_text() == "the learner's work"


def _pins(lines):
    return {m.group(1).lower(): m.group(2) for m in (re.match(r'\s*"?([A-Za-z0-9_.-]+)==([^";\s]+)', line)
                                                     for line in lines) if m}


def test_the_hub_s_jupyterlab_is_the_kit_s_and_the_proxy_pin_is_the_locked_one():
    hub = _pins((DEPLOY / "requirements.txt").read_text().splitlines())
    kit = _pins((ROOT / "pyproject.toml").read_text().splitlines())
    for package in ("jupyterlab", "jupyterlab-language-pack-zh-cn", "ipykernel"):
        assert hub[package] == kit[package], package
    pinned = json.loads((DEPLOY / "package.json").read_text())["dependencies"]["configurable-http-proxy"]
    lock = json.loads((DEPLOY / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/configurable-http-proxy"]["version"] == pinned
    assert lock["packages"][""]["dependencies"] == {"configurable-http-proxy": pinned}
