"""Multi-node helpers: world info, hostfile filters, pdsh command, and a 2-node job on localhost equal to 1 node."""
import pytest

from dslab.launch import multinode


def test_world_info_round_trip_matches_deepspeed():
    from deepspeed.launcher.runner import encode_world_info

    nodes = {"node0": [0], "node1": [0]}
    assert multinode.world_info(nodes) == encode_world_info(nodes)
    assert multinode.decode_world_info(multinode.world_info(nodes)) == nodes


def test_hostfile_and_filters():
    assert multinode.parse_hostfile(multinode.EXAMPLE_HOSTFILE) == {"worker-0": 4, "worker-1": 4}
    assert multinode.resolve(multinode.EXAMPLE_HOSTFILE, exclude="worker-1:3") == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2]}
    with pytest.raises(ValueError):
        multinode.parse_hostfile("worker-0 gpus=4\n")


def test_pdsh_command_has_node_rank_placeholder():
    cmd = multinode.pdsh_command(multinode.EXAMPLE_HOSTFILE, "train.py", include="worker-1")
    assert cmd.startswith("pdsh -S -f") and "-w worker-1" in cmd and "--node_rank=%n" in cmd and "train.py" in cmd


def test_local_hostfile_names_one_node_per_line():
    assert multinode.local_hostfile(2, 3) == "node0 slots=3\nnode1 slots=3\n"


def test_runner_accepts_no_ssh_and_node_rank():
    from deepspeed.launcher.runner import parse_args

    args = parse_args(["--hostfile", "hf", "--no_ssh", "--node_rank=1", "--master_addr", "10.0.0.1", "train.py"])
    assert args.no_ssh and args.node_rank == 1 and args.master_addr == "10.0.0.1"
