"""What this machine offers a job: the cores it may really use, free ports, GPUs, this environment's tools, and the
/dev/shm buffers that finished jobs leave behind."""
import glob
import math
import os
import random
import re
import shutil
import socket
import sys
from pathlib import Path

# DeepSpeed's CPU backend maps a ~70 MB file per rank in /dev/shm, named after the master port and the rank, and
# never unlinks it.
SHM_BUFFER_PREFIX = "/dev/shm/deepspeed_allreduce_buffer_"


# --------------------------------------------------------------------------- cores

CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path):
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_dirs(base, cgroup_path):
    """The folders of the cgroup `cgroup_path` (as /proc/self/cgroup names it) and of its parents, innermost first,
    in a hierarchy mounted at `base`. A container without a cgroup namespace names its cgroup from the host's root
    (/docker/abc/...) while only its own cgroup is mounted: the leading parts that do not exist are dropped."""
    if not base.is_dir():
        return []
    parts = [p for p in cgroup_path.split("/") if p]
    while parts and not base.joinpath(*parts).is_dir():
        parts = parts[1:]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(folder):
    """Cores that cgroup v2's cpu.max allows one cgroup ("150000 100000": 1.5), None for "max" or no file."""
    fields = (_read(folder / "cpu.max") or "").split()
    if len(fields) == 2 and fields[0] != "max" and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]):
        return int(fields[0]) / int(fields[1])
    return None


def _v1_limit(folder):
    """Cores that cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us allow one cgroup, None for a quota of -1."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        quota, period = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_quota(cgroup_root=CGROUP_ROOT, proc_cgroup=None):
    """The CPU quota of this process's cgroup, in cores (1.5: one and a half cores' time per period), or None.

    This is how Docker (--cpus), Kubernetes (a CPU limit) and JupyterHub's spawners (cpu_limit) cap a learner, while
    affinity still shows every core of the server. The cgroup is read from `proc_cgroup` (the text of
    /proc/self/cgroup: a cgroup v2 line "0::/path", cgroup v1 lines "N:cpu,cpuacct:/path") and looked up under the
    filesystem `cgroup_root`: v2's cpu.max ("max 100000" or "200000 100000"), v1's cpu.cfs_quota_us (-1: none) and
    cpu.cfs_period_us, in the cgroup and every parent up to the root: a parent's quota caps all its children, so the
    smallest on the path wins."""
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup") or ""
    root = Path(cgroup_root)
    limits = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        path = path.split(" (deleted)")[0]
        if hierarchy == "0" and controllers == "":  # v2: at the root, or at root/unified on a hybrid system
            bases = [root] + ([root / "unified"] if (root / "unified").is_dir() else [])
            limits += [_v2_limit(d) for base in bases for d in _cgroup_dirs(base, path)]
        elif "cpu" in controllers.split(","):  # v1: mounted at root/cpu,cpuacct, often also at root/cpu
            bases = dict.fromkeys([root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"])
            base = next((b for b in bases if b.is_dir()), None)
            limits += [_v1_limit(d) for d in _cgroup_dirs(base, path)] if base else []
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def quota_cores(quota):
    """Threads a CPU quota of `quota` cores can keep busy: rounded down, at least 1 (None without a quota).

    Down, not up: a cgroup that runs more threads than its quota spends the quota before the period ends, and then
    every thread of it stops until the next period (throttling); a rank waiting at an OpenMP barrier or in a gloo
    collective for a stopped peer loses the whole rest of the period. Rounded down, the threads never outrun the
    quota, and the fraction left over is not wasted: the notebook kernel, gloo's own threads and the launcher share
    the same cgroup. (uber-go/automaxprocs rounds down too, since v1.2, for the same reason: rounding up meant
    constant throttling at saturation.)"""
    return None if quota is None else max(1, math.floor(quota))


def cpu_cores(cgroup_root=CGROUP_ROOT, proc_cgroup=None):
    """The cores this process may really use, and why: {"affinity": cores it may run on (taskset, cpusets),
    "quota": its cgroup's CPU quota in cores or None, "quota_cores": that quota as threads (quota_cores) or None,
    "usable": the smaller of the two, "limited_by": "quota" or "affinity"}."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    cores = quota_cores(quota)
    limited = cores is not None and cores < affinity
    return {"affinity": affinity, "quota": quota, "quota_cores": cores,
            "usable": cores if limited else affinity, "limited_by": "quota" if limited else "affinity"}


def usable_cores():
    """How many cores this process may really use: its affinity or its cgroup's CPU quota, the smaller."""
    return cpu_cores()["usable"]


def threads_per_rank(ranks):
    """CPU threads each of `ranks` processes sharing this machine may use: the usable cores shared out among them.
    Every place that starts ranks (live ranks, the launchers, the tools' runs) sets OMP_NUM_THREADS from this."""
    return max(1, usable_cores() // max(1, ranks))


# --------------------------------------------------------------------------- ports, GPUs

def port_is_free(port, host="127.0.0.1"):
    """True if nothing listens on host:port (the rendezvous store needs it). A port whose job has just ended is free:
    its closed connections linger in TIME_WAIT for a minute, which SO_REUSEADDR lets a new listener (torch's store
    sets it too) bind over, and which once kept a finished job's buffers in /dev/shm as if the job still ran."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_CHOSEN_PORT = 20000


def ephemeral_ports(path=EPHEMERAL_RANGE_FILE):
    """(first, last): the ports the kernel hands to outgoing connections (Linux's default 32768-60999)."""
    try:
        first, last = Path(path).read_text().split()
        return int(first), int(last)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(preferred=None, rng=None):
    """`preferred` if it is free, else a free port below the kernel's ephemeral range, drawn at random.

    Not one the kernel picks (bind to port 0): that comes from the ephemeral range, and the kernel may give it to any
    outgoing connection before the rendezvous store binds it, which for live ranks is minutes later (seen in CI: the
    store's listen failed with EADDRINUSE). Drawn at random so that jobs started together do not draw alike.
    """
    if preferred and port_is_free(preferred):
        return preferred
    first, _ = ephemeral_ports()
    rng = rng or random.SystemRandom()
    if first - LOWEST_CHOSEN_PORT >= 1000:
        for _ in range(100):
            port = rng.randrange(LOWEST_CHOSEN_PORT, first)
            if port_is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # a machine with its ephemeral range set low
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count():
    """CUDA devices this process can see (0 without torch or without GPUs)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_stale_shm_buffers():
    """Delete the shared-memory all-reduce buffers that finished jobs left in /dev/shm.

    A day of runs would otherwise fill /dev/shm (RAM) until jobs die. A buffer whose port nobody listens on any
    more belongs to a job that has ended (the rendezvous store holds the port while a job runs), so it is safe
    to remove.
    """
    for path in glob.glob(SHM_BUFFER_PREFIX + "*"):
        match = re.search(r"_(\d+)_\d+$", path)
        if match and port_is_free(int(match.group(1))):
            _unlink(path)


def remove_shm_buffers(master_port):
    """Delete the buffers of the job that met on `master_port` (its ranks are gone), then any other stale ones."""
    for path in glob.glob(f"{SHM_BUFFER_PREFIX}*_{master_port}_*"):
        _unlink(path)
    remove_stale_shm_buffers()


# This environment's scripts (deepspeed, torchrun, dslab) sit beside its interpreter: the ranks they start use the
# same Python and packages.
TOOLS_DIR = Path(sys.executable).parent


def tool(name):
    """This environment's command `name` (deepspeed, torchrun, ...) if it is there, else what PATH finds."""
    local = TOOLS_DIR / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def ensure_build_tools_on_path():
    """Put the ninja installed with dslab first on PATH, for this process and every rank it starts; its path.

    DeepSpeed checks `ninja --version` on PATH before loading any JIT op, even one already built, and builds with
    whichever ninja comes first. A system ninja (1.11: build log v5) and pip's (1.13: log v7) cannot read each
    other's build log, so processes that alternate between them (an activated venv here, a plain kernel there)
    rebuild the course's ops (shm_comm, cpu_adam, fused_adam) from scratch every time: a minute of CPU per launch.
    Called before anything starts ranks or joins a process group (dslab.launch, dslab.live, dslab.this_rank.init),
    and by `dslab prepare`.
    """
    candidates = [Path(sys.executable).parent]
    try:
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != str(folder)]
            os.environ["PATH"] = os.pathsep.join([str(folder), *rest])
            return str(folder / "ninja")
    return shutil.which("ninja")
