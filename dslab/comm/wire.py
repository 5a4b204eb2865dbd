"""Communication basics: what each collective moves, the variables launchers set, bytes a process has sent.

Starting ranks (the deepspeed launcher, torchrun) is dslab.launch's: `launch.torchrun("collectives")`.
"""
import os

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


# struct tcp_info (linux/tcp.h): offsets of the byte counters read below (tcpi_bytes_sent needs Linux 4.19)
_TCP_INFO_LEN = 512
_TCPI_BYTES_RECEIVED = 128   # __u64 tcpi_bytes_received: payload bytes this end received
_TCPI_BYTES_SENT = 200       # __u64 tcpi_bytes_sent: payload bytes this end sent


def _tcp_connections():
    """Yield (socket, peer address) for each connected TCP socket of this process (Linux: /proc/self/fd).

    Each socket is a duplicate of the process's own descriptor, closed after use: the original stays open.
    """
    import socket

    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue  # closed meanwhile, or not ours to read
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                yield sock, tuple(sock.getpeername()[:2])
        except OSError:
            pass  # a listening socket has no peer
        finally:
            sock.close()


def tcp_bytes():
    """{(peer host, peer port): [bytes sent, bytes received]} over this process's open TCP connections.

    gloo talks to each peer over TCP connections of its own, so these say who sent what to whom: the kernel's
    per-connection payload counts (getsockopt TCP_INFO). /proc/self/io has no counterpart for received bytes (gloo's
    socket reads are not in `rchar`), which is why they come from here. Linux 4.19 or later; {} elsewhere.
    """
    import socket
    import struct

    out = {}
    if not hasattr(socket, "TCP_INFO"):  # Linux's socket option; macOS and Windows name no such counters
        return out
    for sock, peer in _tcp_connections():
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            continue
        if len(info) < _TCPI_BYTES_SENT + 8:
            continue  # a kernel too old to count bytes sent
        totals = out.setdefault(peer, [0, 0])
        totals[0] += struct.unpack_from("Q", info, _TCPI_BYTES_SENT)[0]
        totals[1] += struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)[0]
    return out


def local_endpoints():
    """[(host, port)] of this process's end of each TCP connection: how the peers' tcp_bytes name this process."""
    return [tuple(sock.getsockname()[:2]) for sock, _ in _tcp_connections()]
