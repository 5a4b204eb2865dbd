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


def test_node_commands_are_the_public_per_node_launchers():
    ds = multinode.node_commands("train.py", "hf", n_nodes=2, master_port=29600)
    assert ds[1] == "deepspeed --hostfile hf --no_ssh --node_rank=1 --master_addr 127.0.0.1 --master_port 29600 train.py"
    tr = multinode.node_commands("collectives", "hf", launcher="torchrun", procs_per_node=2)
    assert tr[0].startswith("torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 ") and tr[0].endswith(
        "-m dslab.recipes.collectives")
    assert multinode.local_hostfile(2, 3) == "node0 slots=3\nnode1 slots=3\n"


def test_runner_accepts_no_ssh_and_node_rank():
    from deepspeed.launcher.runner import parse_args

    args = parse_args(["--hostfile", "hf", "--no_ssh", "--node_rank=1", "--master_addr", "10.0.0.1", "train.py"])
    assert args.no_ssh and args.node_rank == 1 and args.master_addr == "10.0.0.1"


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_two_nodes_equal_one_node(tmp_path, monkeypatch, launcher, accumulation_on_two_ranks):
    monkeypatch.setenv("DSLAB_RUNS_DIR", str(tmp_path))
    one = accumulation_on_two_ranks   # the same driver on one node with 2 ranks (launched once per session)
    two = multinode.run_local_nodes("accumulation", n_nodes=2, procs_per_node=1, launcher=launcher, stream=False)
    assert [r["rank"] for r in two.results] == [0, 1]
    assert one.rank0 == two.rank0 and one.results[1] == two.results[1]
