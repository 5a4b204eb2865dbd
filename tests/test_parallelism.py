"""Chapter 11's library: DeepSpeed's pipeline schedule and its bubble, the one-process twin of a PipelineModule, the
bubble fit, and the configs and counters of the tensor-parallel and hpZ runs."""
import pytest

from dslab import compat
from dslab.parallel import hpz, pipeline, tensor_parallel


def test_schedule_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    for stages in (2, 3, 5):
        for m in (1, 2, 3, 7):
            assert set(pipeline.schedule_bubble(m, stages).values()) == {pipeline.bubble_fraction(m, stages)}
            for steps in pipeline.schedule(m, stages).values():   # every micro-batch: one forward, one backward
                names = [n for step in steps for n in step if pipeline.computes([n])]
                assert sorted(names) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    first = pipeline.schedule(4, 2)
    assert first[0][0] == ["LoadMicroBatch", "F0"] and first[1][0] == []   # stage 1 waits for the first activation
    assert "OptimizerStep" in first[0][-1] and "OptimizerStep" in first[1][-1]
    assert pipeline.bubble_table(stages=(2,), micro_batches=(1, 8)) == [{"micro-batches": 1, "2 stages": 0.5},
                                                                        {"micro-batches": 8, "2 stages": 0.111}]


def test_in_flight_micro_batches_follow_1f1b_and_deepspeeds_buffers():
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    assert pipeline.in_flight(4, 2) == {0: 2, 1: 1}
    for stages in (2, 3, 5):
        for m in (1, 2, 3, 7):
            for stage, most in pipeline.in_flight(m, stages).items():
                assert most == min(stages - stage, m)
                assert TrainSchedule(m, stages, stage).num_pipe_buffers() == max(2, most)


def test_bubble_report_recovers_the_slots_of_a_schedule():
    slot = 0.05
    report = pipeline.bubble_report({m: (m + 3 - 1) * slot for m in (1, 2, 4, 8)}, stages=3)
    assert report["slots"] == pytest.approx(2) and report["slope_s"] == pytest.approx(slot)
    assert [r["measured_bubble"] for r in report["rows"]] == pytest.approx([r["theory_bubble"] for r in report["rows"]])
    skewed = pipeline.bubble_report({m: m * slot for m in (1, 2, 4, 8)}, stages=2)   # no bubble at all
    assert skewed["slots"] == pytest.approx(0, abs=1e-9)


def test_sequential_twin_has_the_weights_a_pipeline_module_builds():
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from dslab import this_rank

    this_rank.init_single_process(quiet=True)
    specs = [LayerSpec(pipeline.Embed, 64, 16), LayerSpec(pipeline.Block, 16, 32), LayerSpec(pipeline.Head, 16, 64)]
    net = PipelineModule(layers=specs, num_stages=1, loss_fn=pipeline.lm_loss, partition_method="uniform",
                         seed_layers=True, base_seed=pipeline.BASE_SEED)
    twin = pipeline.sequential_twin(specs)
    built = [p for layer in net.forward_funcs for p in layer.parameters()]
    assert len(built) == len(list(twin.parameters())) > 0
    assert all(torch.equal(a, b) for a, b in zip(built, twin.parameters()))
    assert pipeline.stage_parameters(net) == {"layers": ["Embed", "Block", "Head"],
                                              "params": sum(p.numel() for p in twin.parameters())}
    other = pipeline.sequential_twin(specs, base_seed=pipeline.BASE_SEED + 1)   # the seed matters
    assert not torch.equal(next(other.parameters()), next(twin.parameters()))


def test_hpz_config_is_valid_and_counters_add_up():
    from dslab.config.check import check_config

    plain, hier = hpz.zero3_config(), hpz.zero3_config(zero_hpz_partition_size=2)
    assert check_config(plain, world_size=4, device="cpu") == [] and check_config(hier, world_size=4, device="cpu") == []
    assert "zero_hpz_partition_size" not in plain["zero_optimization"]
    assert hier["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert hpz.shard_bytes([[256, 3], [1024, 2]]) == 256 * 3 + 1024 * 2   # what the comms logger's sizes add up to
    # what a rank writes on gloo: (group - 1) x each shard, plus 48-byte preambles (4 per peer-step and half-shard)
    assert hpz.gloo_gather_bytes([[256, 3]], 4) == 3 * (3 * 256 + 2 * 3 * (2 * 48 + 48))
    assert hpz.gloo_gather_bytes([[1024, 1]], 2) == 1024 + 2 * (2 * 48 + 48)
    raw = {"all_reduce | [Caller Func: forward]": {8: [2, [0.1, 0.2], [], []], 16: [1, [0.3], [], []]}}
    assert tensor_parallel.collectives(raw) == {"all_reduce | [Caller Func: forward]": {"calls": 3, "bytes": 32}}


def test_tcp_bytes_counts_each_connection_and_names_its_peer():
    """dslab.comm.wire.tcp_bytes: payload bytes per connection, keyed by the peer's end (as local_endpoints names it)."""
    import socket
    import sys

    from dslab.comm import wire

    if not sys.platform.startswith("linux"):
        pytest.skip("TCP_INFO byte counters are Linux's")
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            client.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(accepted.recv(1 << 16))
            accepted.sendall(b"y" * 7)
            assert client.recv(16) == b"y" * 7
            counts = wire.tcp_bytes()   # {the other end: [sent, received]} for both ends, both in this process
            assert counts[accepted.getsockname()] == [100_000, 7]   # the client's connection
            assert counts[client.getsockname()] == [7, 100_000]     # the server's end of it
            ends = wire.local_endpoints()
            assert client.getsockname() in ends and accepted.getsockname() in ends


def test_tiny_layers_are_dslab_tinys_pieces_in_order():
    layers = pipeline.tiny_layers(blocks=3, vocab_size=64, hidden_size=16, intermediate_size=32)
    assert [type(layer).__name__ for layer in layers] == ["Embed", "Block", "Block", "Block", "Head"]
    assert sum(p.numel() for p in layers[0].parameters()) == 64 * 16
    again = pipeline.tiny_layers(blocks=3, vocab_size=64, hidden_size=16, intermediate_size=32)
    assert all((a == b).all() for a, b in zip(layers.parameters(), again.parameters()))   # seeded: the same weights


def test_forget_groups_clears_what_a_later_engine_would_read(monkeypatch):
    """What DeepSpeed keeps is read in tests/test_compat.py; here, that forget_groups clears all of it."""
    from deepspeed.utils import groups

    for name in compat.PARALLEL_GROUP_NAMES:
        monkeypatch.setattr(groups, name, object())   # what a pipeline's or AutoTP's engine leaves behind
    tensor_parallel.forget_groups()
    assert all(getattr(groups, name) is None for name in compat.PARALLEL_GROUP_NAMES)
