"""Bytes per optimizer step: gloo's per-collective rules, the ZeRO paper's ideal, DeepSpeed's algorithm, measured."""
import contextlib
import functools
import io
import json

import pytest

from dslab import cli
from dslab.comm import gloo_bytes, step_bytes, zero3_fetch
from dslab.config.build import deep_merge

# A shape no other test uses: 353,376 parameters, tied embeddings, 3 layers.
SHAPE_ARGS = ["--hidden-size", "96", "--layers", "3", "--vocab-size", "500"]
SHAPE = {"hidden_size": 96, "num_hidden_layers": 3, "vocab_size": 500, "intermediate_size": 256}  # what those flags build
HEADERS = 3 * gloo_bytes.HEADER_BYTES  # per message: two preambles from the sender, one from the receiver


@functools.cache
def _trace():
    return zero3_fetch.model_trace(SHAPE)


def _trace_copy():
    t = _trace()
    return {"numels": list(t["numels"]), "modules": [list(m) for m in t["modules"]]}


def _predicted(stage, n, precision="bf16", **extra):
    cfg = deep_merge(step_bytes.comm_config(stage, n, precision), extra)
    return step_bytes.deepspeed_collectives(_trace_copy(), n, cfg)


# --------------------------------------------------------------------------- gloo, one collective

@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("segments_per_rank", [2, 7])  # 7: past gloo's 1 MiB segment cap
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer_plus_headers(n, segments_per_rank):
    segment = 4 * (1 << 20) // 4 if segments_per_rank > 2 else 4096
    nbytes = n * segments_per_rank * segment  # divides evenly: no short segment anywhere
    messages = 2 * (n * segments_per_rank - segments_per_rank)  # both phases
    expected = 2 * (n - 1) * nbytes // n + messages * HEADERS
    assert gloo_bytes.all_reduce(nbytes, 4, n) == [expected] * n


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_a_one_element_all_reduce_is_mostly_headers_and_ranks_differ(n):
    per_rank = gloo_bytes.all_reduce(4, 4, n)
    # the element travels N-1 hops to be summed and N-1 hops back: 2(N-1) messages in all, whoever sends them
    assert sum(per_rank) == 2 * (n - 1) * (4 + 2 * gloo_bytes.HEADER_BYTES) + 2 * (n - 1) * gloo_bytes.HEADER_BYTES
    assert (len(set(per_rank)) > 1) == (n > 2)


@pytest.mark.parametrize("n", [2, 3, 6])
def test_all_gather_sends_the_shard_n_minus_1_times_and_reduce_scatter_costs_an_all_reduce(n):
    shard = 1000 * 2
    assert gloo_bytes.collective("all_gather_into_tensor", 1000, "bf16", n) == [(n - 1) * shard
                                                                                  + 2 * (n - 1) * HEADERS] * n
    assert gloo_bytes.collective("reduce_scatter_tensor", 999 * n, "bf16", n) == \
        gloo_bytes.all_reduce(999 * n * 2, 2, n)
    with pytest.raises(ValueError, match="all_reduce"):
        gloo_bytes.collective("all_to_all", 10, "bf16", n)


# --------------------------------------------------------------------------- the ideal

@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("precision, size", [("bf16", 2), ("fp32", 4)])
def test_ideal_bytes_are_the_zero_papers_ring_formulas(n, precision, size):
    psi = 1_234_567 * size
    for stage in (0, 1, 2):
        assert step_bytes.ideal_bytes(1_234_567, n, stage, precision) == round(2 * (n - 1) / n * psi)
    assert step_bytes.ideal_bytes(1_234_567, n, 3, precision) == round(3 * (n - 1) / n * psi)


# --------------------------------------------------------------------------- DeepSpeed's algorithm, no ranks

def _ops(collectives):
    return [(c["op"], c["numel"], c["dtype"], c["count"]) for c in collectives]


@pytest.mark.parametrize("n", [2, 4, 5, 16])
def test_stage_0_is_one_gradient_all_reduce_and_fp32_clipping_adds_a_norm(n):
    psi = sum(_trace()["numels"])
    assert _ops(_predicted(0, n)[0]) == [("all_reduce", psi, "bf16", 1)]
    fp32 = _ops(_predicted(0, n, "fp32")[0])
    assert fp32 == [("all_reduce", psi, "fp32", 1), ("all_reduce", 1, "fp32", 1)]
    assert _ops(_predicted(0, n, "fp32", gradient_clipping=0.0)[0]) == fp32[:1]


@pytest.mark.parametrize("n", [2, 4, 5, 16])
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_all_reduce_the_bucket_then_all_gather_the_padded_partitions(n, stage):
    psi = sum(_trace()["numels"])
    partition = -(-psi // (2 * n)) * 2  # the flat buffer is padded to a multiple of 2N elements
    ops = _ops(_predicted(stage, n)[0])
    assert ops == [("all_reduce", psi, "bf16", 1), ("all_reduce", 1, "uint8", 1), ("all_reduce", 1, "fp32", 1),
                   ("all_gather_into_tensor", partition, "bf16", 1)]
    quiet = _predicted(stage, n, gradient_clipping=0.0, bf16={"check_grad_overflow": False},
                       zero_optimization={"compute_grad_norm": False})
    assert _ops(quiet[0]) == [ops[0], ops[3]]
    # with accumulation, stage 2 reduces at every micro-step, stage 1 only at the boundary
    accum = _predicted(stage, n, gradient_accumulation_steps=3, train_batch_size=2 * 3 * n)[0]
    assert accum[0]["count"] == (3 if stage == 2 else 1)


def test_reduce_buckets_follow_the_order_gradients_become_ready():
    ops = _predicted(2, 3, zero_optimization={"reduce_bucket_size": 60000})[0]
    buckets = [c["numel"] for c in ops if c["op"] == "all_reduce" and c["numel"] > 1]
    assert sum(buckets) == sum(_trace()["numels"]) and max(buckets) <= 60000 and len(buckets) == 7
    # the tied embedding's gradient is complete only after the embedding's own backward: it is in the last bucket
    assert buckets[-1] >= _trace()["numels"][0]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_stage_3_fetches_everything_once_per_step_and_reduce_scatters_once(n):
    numels = _trace()["numels"]
    shards = sum(-(-k // n) for k in numels)
    ops = _ops(_predicted(3, n)[0])
    assert ops == [("all_gather_into_tensor", shards, "bf16", 1), ("reduce_scatter_tensor", n * shards, "bf16", 1),
                   ("all_reduce", 1, "fp64", 1)]
    # the same volume as the paper's 3(N-1)/N x Ψ, for another reason: gloo's reduce-scatter is an all-reduce
    ratio = max(step_bytes.wire_bytes(_predicted(3, n)[0], n)) / step_bytes.ideal_bytes(sum(numels), n, 3)
    assert ratio == pytest.approx(1.0, abs=0.01)


def test_stage_3_persistent_parameters_are_regathered_after_the_step():
    ops = _ops(_predicted(3, 3, zero_optimization={"stage3_param_persistence_threshold": 100000})[0])
    gathers = [o for o in ops if o[0] == "all_gather_into_tensor"]
    assert len(gathers) == len(_trace()["numels"])  # every parameter here has <= 1e5 elements: one by one


def test_stage_3_fetch_replay_without_prefetch_gathers_module_by_module_and_reuse_distance_0_regathers():
    trace = _trace_copy()
    per_module = zero3_fetch.fetch_calls(trace, 0, 10**9)
    owners = [m for m in trace["modules"] if m]
    assert per_module == [m for i, m in enumerate(owners) if m not in owners[:i]]  # each needed set once
    calls = zero3_fetch.fetch_calls(trace, 20000, 0)
    gathered = [p for call in calls for p in call]
    assert set(gathered) == set(range(len(trace["numels"]))) and len(gathered) > len(set(gathered))
    # a prefetch bucket holding the whole model: the prefetcher looks past every later use at once, so nothing is
    # freed between forward and backward, whatever the reuse distance
    (whole,) = zero3_fetch.fetch_calls(trace, 10**9, 0)
    assert sorted(whole) == list(range(len(trace["numels"])))


@pytest.mark.parametrize("extra, words", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, "fp16"),
])  # use_multi_rank_bucket_allreduce / reduce_scatter false are modelled: tests/test_comm_settings.py
def test_setups_that_are_not_modelled_are_refused(extra, words):
    with pytest.raises(ValueError, match=words):
        step_bytes.deepspeed_collectives([10, 20], 2, {**step_bytes.comm_config(2, 2), **extra})


def test_ddp_all_reduces_once_per_synced_micro_step():
    both = step_bytes.wire_bytes(step_bytes.ddp_collectives(_trace_copy(), 3, "fp32", 2), 3)
    once = step_bytes.wire_bytes(step_bytes.ddp_collectives(_trace_copy(), 3, "fp32", 1), 3)
    assert [b / o for b, o in zip(both, once)] == [2.0] * 3


def test_cli_refuses_offload_at_stage_0_before_starting_ranks(capsys):
    assert cli.main(["comm", "--zero", "0", "--offload", "--json"] + SHAPE_ARGS) == 1
    assert "stage 1, 2 or 3" in capsys.readouterr().err


# --------------------------------------------------------------------------- real ranks

@pytest.fixture(scope="module")
def three_ranks():
    """`dslab comm --zero 0 1 2 3 --world-size 3 --json`: one launch, the four stages one after another."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["comm", "--zero", "0", "1", "2", "3", "--world-size", "3", "--json"] + SHAPE_ARGS)
    assert code == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_rank_sends_what_deepspeeds_algorithm_predicts(three_ranks, stage):
    rep = three_ranks[stage]
    assert (rep["zero_stage"], rep["world_size"], rep["params"]) == (stage, 3, sum(_trace()["numels"]))
    predicted = rep["deepspeed_bytes"] if isinstance(rep["deepspeed_bytes"], list) else [rep["deepspeed_bytes"]] * 3
    assert [m["rank"] for m in rep["measured"]] == [0, 1, 2]
    for m in rep["measured"]:
        assert m["bytes"] == pytest.approx(predicted[m["rank"]], rel=0.02)
        # DeepSpeed's comms logger saw exactly the collectives the prediction lists
        logged = {op: {int(size): count for size, count in sizes.items()} for op, sizes in m["comms_logger"].items()}
        assert logged == {op: {int(size): count for size, count in sizes.items()}
                          for op, sizes in rep["predicted_comms_logger"].items()}


def test_ideal_bytes_of_the_measured_runs_are_the_ring_formulas(three_ranks):
    for rep in three_ranks:
        psi = 2 * rep["params"]  # bf16
        factor = 3 if rep["zero_stage"] == 3 else 2
        assert rep["ideal_bytes"] == round(factor * 2 / 3 * psi)


def test_ddp_no_sync_halves_the_bytes_of_two_micro_steps():
    plain, no_sync = step_bytes.measure_ddp(world_size=2, shape=SHAPE, micro_steps=2, stream=False)
    assert (plain["no_sync"], no_sync["no_sync"]) == (False, True)
    for rep in (plain, no_sync):
        for m in rep["measured"]:
            assert m["ratio"] == pytest.approx(1.0, abs=0.01)
    assert [a["bytes"] / b["bytes"] for a, b in zip(plain["measured"], no_sync["measured"])] == \
        pytest.approx([2.0, 2.0], abs=0.01)
