"""Instructor solutions for notebooks/08_cli_and_multinode.ipynb (checked by tests/test_exercises.py)."""
from dslab.launch import multinode

# 08.world_size: resolve the filter with DeepSpeed's own runner code, then count the slots.
active = multinode.resolve(multinode.EXAMPLE_HOSTFILE, include="worker-0:0,1@worker-1")
world_size = sum(len(slots) for slots in active.values())

# 08.global_rank: node ranks follow the world-info order; ranks are numbered node by node.
nodes = {"a": [0, 1], "b": [0, 1]}
global_rank = 1 * len(nodes["a"]) + 1

# 08.hostfile_command: the hostfile lists every GPU each machine has; --include picks the job's GPUs (not
# CUDA_VISIBLE_DEVICES, which the runner drops once a hostfile is used); --master_port sets the rendezvous port.
hostfile_command = {
    "hostfile": "worker-0 slots=4\nworker-1 slots=4\n",
    "command": "deepspeed --hostfile hostfile --include worker-0:0,1@worker-1 --master_port 29600 train.py",
}

SOLUTIONS = {
    "08.world_size": world_size,
    "08.global_rank": global_rank,
    "08.hostfile_command": hostfile_command,
}
