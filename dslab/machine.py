"""This machine's facts, one function each: the cores a process may really use (affinity, the cgroup's CPU quota)
and the threads each rank gets, the GPUs, the CPU (model, bf16/fp16 flags, oneDNN's cap), memory, the course
packages' versions, this environment's tools and build tools, and where torch caches JIT-built ops.

Nothing here imports DeepSpeed (dslab.env asks it what it makes of these facts), nor another dslab module."""
import math
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "accelerate")
# CPU flags that make bf16 fast on x86 (AVX-512 BF16 instructions, AMX tiles).
BF16_CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
# CPU flags of native fp16 arithmetic (recent Xeons): where oneDNN has them, DeepSpeed's CPU accelerator allows fp16.
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")
# oneDNN runs torch's bf16 matmuls on the best instruction set it finds; ONEDNN_MAX_CPU_ISA caps it. Its values, lowest
# first (aliases share a rank): below AVX512_CORE_BF16, bf16 matmuls run without bf16 instructions (plain AVX-512, or
# emulated at AVX2 and below), slower and with other rounding, whatever the CPU's flags say.
ONEDNN_ISAS = {"SSE41": 0, "AVX": 1, "AVX2": 2, "AVX2_VNNI": 3, "AVX2_VNNI_2": 4, "AVX512_CORE": 5,
               "AVX512_CORE_VNNI": 6, "AVX512_CORE_BF16": 7, "AVX10_1_512": 8, "AVX512_CORE_FP16": 8,
               "AVX10_1_512_AMX": 9, "AVX512_CORE_AMX": 9, "AVX10_1_512_AMX_FP16": 10, "AVX512_CORE_AMX_FP16": 10}


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
    Every place that starts ranks (live ranks, the launchers, the frameworks' runs) sets OMP_NUM_THREADS from this."""
    return max(1, usable_cores() // max(1, ranks))


# --------------------------------------------------------------------------- GPUs

def gpu_count():
    """CUDA devices this process can see (0 without torch or without GPUs)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def gpu_info():
    """Each GPU torch sees (name, memory), and `nvidia-smi topo -m` (how the GPUs are connected)."""
    import torch

    if not gpu_count():
        return {"gpus": [], "topology": None}
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                     "compute_capability": f"{props.major}.{props.minor}"})
    topology = None
    if shutil.which("nvidia-smi"):
        try:
            run = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
            topology = run.stdout.rstrip() if run.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            topology = None
    return {"gpus": gpus, "topology": topology}


# --------------------------------------------------------------------------- the CPU, memory

def onednn_cap():
    """oneDNN's instruction-set cap from the environment (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA), or
    None where nothing caps it."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return cap if cap and cap not in ("ALL", "DEFAULT") else None


def bf16_native(flags, cap):
    """True where bf16 matmuls run with bf16 instructions: the CPU has AVX512-BF16 or AMX-BF16 and no oneDNN cap
    (`cap`, onednn_cap()) below AVX512_CORE_BF16 takes them away. Ask this, not the flags, before expecting speed."""
    if not (flags.get("avx512_bf16") or flags.get("amx_bf16")):
        return False
    return cap is None or ONEDNN_ISAS.get(cap, len(ONEDNN_ISAS)) >= ONEDNN_ISAS["AVX512_CORE_BF16"]


def cpu_info():
    """Usable cores (affinity or the cgroup's CPU quota, the fewer: cpu_cores), model name, the
    bf16/fp16-related flags from /proc/cpuinfo, oneDNN's cap and whether bf16 matmuls run natively under it."""
    cores = cpu_cores()
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux
        pass
    model = model or platform.processor() or None
    known, cap = {flag: flag in flags for flag in BF16_CPU_FLAGS + FP16_CPU_FLAGS}, onednn_cap()
    return {"cores_usable": cores["usable"], "cores_total": os.cpu_count(), "cores_affinity": cores["affinity"],
            "cpu_quota": cores["quota"], "cores_quota": cores["quota_cores"], "cores_limited_by": cores["limited_by"],
            "model": model, "flags": known, "onednn_cap": cap, "bf16_native": bf16_native(known, cap)}


def memory_info():
    """Total and available RAM in GiB (one decimal)."""
    import psutil

    vm = psutil.virtual_memory()
    return {"total_gib": round(vm.total / 2**30, 1), "available_gib": round(vm.available / 2**30, 1)}


# --------------------------------------------------------------------------- software

def versions():
    """Installed version of each course package (None when missing), and Python's."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


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


def build_tools():
    """Paths of ninja, the C++ compiler torch uses ($CXX or c++), g++ and numactl (None when absent)."""
    ninja = ensure_build_tools_on_path()  # also puts pip's ninja on PATH, as DeepSpeed needs
    cxx = os.environ.get("CXX", "c++")
    return {"ninja": ninja, "c++": shutil.which(cxx), "g++": shutil.which("g++"), "numactl": shutil.which("numactl")}


def missing_build_tools(tools=None):
    """Names of the tools a JIT op build needs that are missing (ninja, c++)."""
    tools = tools or build_tools()
    return [name for name in ("ninja", "c++") if not tools[name]]


def extensions_dir():
    """Where torch caches JIT-built ops: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py311_cpu (say).

    The same rule as torch.utils.cpp_extension, without creating the folder.
    """
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"
