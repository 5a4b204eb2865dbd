"""Communication basics: what each collective moves, the variables launchers set, bytes a process has written.

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
