"""Ports for a job's rendezvous, and the /dev/shm buffers that DeepSpeed names after them and finished jobs leave
behind."""
import glob
import os
import random
import re
import socket
from pathlib import Path

# DeepSpeed's CPU backend maps a ~70 MB file per rank in /dev/shm, named after the master port and the rank, and
# never unlinks it.
SHM_BUFFER_PREFIX = "/dev/shm/deepspeed_allreduce_buffer_"


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
