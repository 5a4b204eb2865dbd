"""What this machine offers a job: free ports, GPUs, this environment's tools, and the /dev/shm buffers that
finished jobs leave behind."""
import glob
import os
import re
import shutil
import socket
import sys
from pathlib import Path

# DeepSpeed's CPU backend maps a ~70 MB file per rank in /dev/shm, named after the master port and the rank, and
# never unlinks it.
SHM_BUFFER_PREFIX = "/dev/shm/deepspeed_allreduce_buffer_"


def port_is_free(port, host="127.0.0.1"):
    """True if nothing listens on host:port (the rendezvous store needs it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred=None):
    """`preferred` if it is free, else a port the kernel says is unused."""
    if preferred and port_is_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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
