"""What the course's JupyterHub spawner (dslab_spawner.py) does on the server, in plain Python with no JupyterHub
import, so that the kit's own tests can check it (tests/test_hub_recipe.py):

- a cgroup per learner that holds their single-user server and everything it starts (kernels, ranks, terminals),
  with a CPU quota and a memory limit: cgroup v2 (cpu.max, memory.max) where the cpu and memory controllers are
  there, else cgroup v1 (cpu.cfs_quota_us, memory.limit_in_bytes). dslab reads the same files to size its ranks
  (dslab.machine.cpu_cores);
- the learner's own copy of the course, made once, as the learner: `python dslab_hub.py copy-course KIT DEST`.
"""
import errno
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PERIOD_US = 100_000             # the CPU quota's period, the kernel's default
CONTROLLERS = ("cpu", "memory")


class CgroupError(RuntimeError):
    """A learner's cgroup cannot be made here; the message says where and why."""


def _read(path):
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _write(path, text):
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as err:
        hint = ""
        if err.errno == errno.EBUSY and path.name == "cgroup.subtree_control":
            hint = (" (cgroup v2 lets a cgroup hand controllers to its children only while no process sits in it: "
                    "start the hub in a cgroup of its own, or give DslabSpawner.cgroup_parent a delegated one)")
        raise CgroupError(f"cannot write {text!r} to {path}: {err.strerror or err}{hint}") from err


def hierarchies(root=CGROUP_ROOT):
    """("v2", {"cpu": root, "memory": root}) where cgroup v2 offers both controllers at `root`, else ("v1", {"cpu":
    the cpu hierarchy, "memory": the memory hierarchy}); CgroupError where neither is there."""
    root = Path(root)
    offered = _read(root / "cgroup.controllers").split()
    if all(c in offered for c in CONTROLLERS):
        return "v2", {c: root for c in CONTROLLERS}
    cpu = next((root / d for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / d / "cpu.cfs_quota_us").exists()),
               None)
    memory = root / "memory" if (root / "memory" / "memory.limit_in_bytes").exists() else None
    if cpu and memory:
        return "v1", {"cpu": cpu, "memory": memory}
    raise CgroupError(f"no cgroup hierarchy with the cpu and memory controllers under {root} (cgroup v2 with both in "
                      "cgroup.controllers, or cgroup v1's cpu and memory hierarchies)")


def folder_name(learner):
    """The learner's cgroup folder: "learner-" and the name, characters other than letters, digits, '.', '_' and '-'
    as '_' (the prefix keeps a name such as "tasks" off cgroup v1's control files)."""
    return "learner-" + re.sub(r"[^A-Za-z0-9._-]", "_", learner)


class LearnerCgroup:
    """One learner's cgroup: LearnerCgroup("ana").create(cpus=2, memory=4 * 2**30), then its procs_files() get the
    server's process id (the spawner writes it there before the server runs), and remove() ends whatever is left in it
    and deletes it. `parent` is the cgroup that holds every learner's, under `root`."""

    def __init__(self, learner, parent="dslab-learners", root=CGROUP_ROOT):
        self.version, bases = hierarchies(root)
        parts = [p for p in str(parent).split("/") if p and p not in (".", "..")]
        self.root = Path(root)
        self.parents = {c: base.joinpath(*parts) for c, base in bases.items()}
        self.folders = {c: folder / folder_name(learner) for c, folder in self.parents.items()}

    def _unique(self, folders):
        return list(dict.fromkeys(folders.values()))

    def create(self, cpus=None, memory=None):
        """Make the cgroup (and its parents) with a quota of `cpus` cores and `memory` bytes (None: no limit)."""
        quota = None if not cpus else max(1000, round(float(cpus) * PERIOD_US))
        if self.version == "v2":
            # every level from the root down to the parent hands cpu and memory on to its children
            self._enable(self.root)
            relative = self.parents["cpu"].relative_to(self.root).parts
            for depth in range(1, len(relative) + 1):
                level = self.root.joinpath(*relative[:depth])
                level.mkdir(exist_ok=True)
                self._enable(level)
            folder = self.folders["cpu"]
            folder.mkdir(exist_ok=True)
            _write(folder / "cpu.max", f"{quota if quota else 'max'} {PERIOD_US}")
            _write(folder / "memory.max", str(int(memory)) if memory else "max")
        else:
            for folder in self._unique(self.folders):
                folder.mkdir(parents=True, exist_ok=True)
            _write(self.folders["cpu"] / "cpu.cfs_period_us", str(PERIOD_US))
            _write(self.folders["cpu"] / "cpu.cfs_quota_us", str(quota if quota else -1))
            _write(self.folders["memory"] / "memory.limit_in_bytes", str(int(memory)) if memory else "-1")
        return self

    @staticmethod
    def _enable(folder):
        """cgroup v2: hand the cpu and memory controllers to `folder`'s children."""
        control = folder / "cgroup.subtree_control"
        missing = [c for c in CONTROLLERS if c not in _read(control).split()]
        if missing:
            _write(control, " ".join("+" + c for c in missing))

    def procs_files(self):
        """The cgroup.procs files a process id is written to, to move that process into this cgroup."""
        return [str(folder / "cgroup.procs") for folder in self._unique(self.folders)]

    def exists(self):
        return any(folder.is_dir() for folder in self.folders.values())

    def pids(self):
        """The processes in the cgroup now."""
        found = set()
        for folder in self._unique(self.folders):
            found.update(int(p) for p in _read(folder / "cgroup.procs").split() if p.isdigit())
        return found

    def limits(self):
        """{"cpus": the quota in cores or None, "memory": the limit in bytes or None}, read back from the files."""
        if self.version == "v2":
            cpu = _read(self.folders["cpu"] / "cpu.max").split()
            cpus = int(cpu[0]) / int(cpu[1]) if len(cpu) == 2 and cpu[0].isdigit() else None
            memory = _read(self.folders["memory"] / "memory.max")
        else:
            quota = _read(self.folders["cpu"] / "cpu.cfs_quota_us")
            period = _read(self.folders["cpu"] / "cpu.cfs_period_us")
            cpus = int(quota) / int(period) if quota.isdigit() and period.isdigit() and int(period) else None
            memory = _read(self.folders["memory"] / "memory.limit_in_bytes")
            if memory.isdigit() and int(memory) >= 2 ** 62:   # v1 shows "no limit" as a huge number
                memory = "max"
        return {"cpus": cpus, "memory": int(memory) if memory.isdigit() else None}

    def kill(self, timeout=10.0):
        """End every process in the cgroup (SIGKILL); True once it is empty."""
        kill_file = self.folders["cpu"] / "cgroup.kill"                 # cgroup v2, Linux 5.14 and later
        if self.version == "v2" and kill_file.exists() and self.pids():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids() - {os.getpid()}
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.05)

    def remove(self, timeout=10.0):
        """End what is left in the cgroup and delete it; the folders that could not be deleted (none when it worked)."""
        if not self.exists():
            return []
        self.kill(timeout)
        left = []
        for folder in self._unique(self.folders):
            deadline = time.monotonic() + timeout
            while folder.is_dir():
                try:
                    folder.rmdir()
                except OSError:
                    if time.monotonic() > deadline:     # a process that would not die
                        left.append(str(folder))
                        break
                    time.sleep(0.05)
        return left


def join(procs_files, pid=None):
    """Move process `pid` (this one by default) into the cgroup whose cgroup.procs files these are. Called in the
    child between fork and exec, so only plain system calls."""
    data = str(pid or os.getpid()).encode()
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- the learner's copy of the course

# Not copied: what the kit built or ran (venvs, build outputs, the chapters' runs, caches), as in the kit's .gitignore.
# The venvs are linked instead: installed once, for everyone.
SKIP_NAMES = {".git", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", "node_modules", "runs"}
SKIP_PATHS = {"build", "slides/build", "tests/browser/screenshots"}
VENV_PREFIX = ".venv"


def _skipped(kit):
    def ignore(folder, names):
        here = Path(folder).relative_to(kit)
        return {n for n in names if n in SKIP_NAMES or n.endswith(".egg-info") or (here / n).as_posix() in SKIP_PATHS
                or (here == Path(".") and n.startswith(VENV_PREFIX))}
    return ignore


def copy_course(kit, dest):
    """Copy the course from the kit into `dest` (the learner's ~/dslab) unless it is there already; True if copied.

    Run as the learner, so every file is theirs. The copy is made beside `dest` and renamed into place: a copy cut
    short (a server killed meanwhile) is never taken for the learner's own. The kit's venvs (.venv, .venv-swift,
    .venv-llamafactory) are links to the kit's: installed once for all."""
    kit, dest = Path(kit).resolve(), Path(dest)
    if dest.exists() or dest.is_symlink():
        return False
    partial = dest.with_name(f".{dest.name}.copying-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(kit, partial, symlinks=True, ignore=_skipped(kit))
    for venv in sorted(kit.glob(VENV_PREFIX + "*")):
        if venv.is_dir():
            (partial / venv.name).symlink_to(venv)
    try:
        partial.rename(dest)
    except OSError:            # made meanwhile by another start of the same learner's server: theirs is kept
        shutil.rmtree(partial, ignore_errors=True)
        return False
    return True


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "copy-course":
        print("usage: python dslab_hub.py copy-course KIT DEST", file=sys.stderr)
        return 2
    print("copied" if copy_course(args[1], args[2]) else "kept", args[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
