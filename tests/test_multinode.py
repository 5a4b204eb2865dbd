"""Multi-node helpers: world info, hostfile filters, pdsh command, and a 2-node job on localhost equal to 1 node."""
import pytest

from dslab import launch, multinode


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


def test_two_nodes_equal_one_node(tmp_path, monkeypatch):
    monkeypatch.setenv("DSLAB_RUNS_DIR", str(tmp_path))
    one = launch.run("accumulation", world_size=2, stream=False)
    two = multinode.run_local_nodes("accumulation", n_nodes=2, procs_per_node=1, stream=False)
    assert [r["rank"] for r in two.results] == [0, 1]
    assert one.rank0 == two.rank0 and one.results[1] == two.results[1]
