"""The settings and the step that change ZeRO's collectives (dslab.zero.partition, dslab.comm.zero3_fetch), gloo's
reduce and broadcast, NCCL's rings (dslab.comm.nccl_bytes), chapter 10's table (dslab.comm.bytes_table), and all of
them on real ranks."""
import functools

import pytest

from dslab import launch, plots
from dslab.comm import bytes_table, gloo_bytes, nccl_bytes, step_bytes, zero3_fetch
from dslab.config.build import deep_merge
from dslab.zero import partition

# A shape no other test uses: 3 layers, untied embeddings (the output head is its own module).
SHAPE = {"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 700, "intermediate_size": 160,
         "tie_word_embeddings": False}
HEADER = gloo_bytes.HEADER_BYTES
OWNERS = {"zero_optimization": {"use_multi_rank_bucket_allreduce": False}}


@functools.cache
def _trace():
    return zero3_fetch.model_trace(SHAPE)


def _collectives(stage, n, first_step=False, **extra):
    cfg = deep_merge(step_bytes.comm_config(stage, n), extra)
    return step_bytes.deepspeed_collectives(_trace(), n, cfg, first_step)[0]


def _ops(collectives):
    return [(c["op"], c["numel"], c["dtype"], c.get("root")) for c in collectives]


# --------------------------------------------------------------------------- gloo: reduce and broadcast

@pytest.mark.parametrize("n", [2, 3, 4, 7])
@pytest.mark.parametrize("root", [0, 1])
def test_gloo_reduce_at_two_segments_per_rank_is_a_reduce_scatter_then_a_gather_to_the_root(n, root):
    segment = 1000
    nbytes = 2 * n * segment  # gloo's minimum: 2N segments, here all full
    per_rank = gloo_bytes.reduce(nbytes, 2, n, root)
    ring = (2 * n - 2) * (segment + 2 * HEADER) + (2 * n - 2) * HEADER   # sends and receives of the ring round
    chunk = 2 * segment + 2 * HEADER                                     # a rank's reduced chunk, to the root
    assert per_rank[root] == ring + (n - 1) * HEADER                     # the root only receives the chunks
    assert all(b == ring + chunk for r, b in enumerate(per_rank) if r != root)
    assert sum(per_rank) - n * (ring + HEADER) == (n - 1) * chunk - HEADER   # (N-1) chunks in all


def test_gloo_reduce_past_the_segment_cap_sends_all_but_two_segments_in_its_ring():
    n, segment = 2, gloo_bytes.MAX_SEGMENT_BYTES
    nbytes = 6 * segment                     # 6 segments of 1 MiB, 3 per rank: the ring sends 4, not 3
    root, other = gloo_bytes.reduce(nbytes, 4, n, root=0)
    assert root == 4 * (segment + 2 * HEADER) + 4 * HEADER + HEADER
    assert other == 4 * (segment + 2 * HEADER) + 4 * HEADER + 3 * segment + 2 * HEADER
    assert gloo_bytes.reduce(0, 2, 3) == [0, 0, 0] and gloo_bytes.reduce(10, 2, 1) == [0]


@pytest.mark.parametrize("n, root", [(2, 0), (3, 1), (5, 2), (8, 0), (8, 5)])
def test_gloo_broadcast_is_a_binomial_tree_of_n_minus_1_sends(n, root):
    per_rank = gloo_bytes.broadcast(100, n, root)
    sends = [(b - HEADER * (r != root)) // (100 + 2 * HEADER) for r, b in enumerate(per_rank)]
    assert sum(sends) == n - 1                              # every rank but the root receives it once
    assert sends[root] == (n - 1).bit_length()              # the root sends once per level of the tree
    assert all((b - HEADER * (r != root)) % (100 + 2 * HEADER) == 0 for r, b in enumerate(per_rank))
    assert gloo_bytes.broadcast(0, 2) == [2 * HEADER, HEADER]   # an empty one still sends its preambles


# --------------------------------------------------------------------------- NCCL's rings

@pytest.mark.parametrize("n", [2, 3, 8])
def test_nccl_rings_send_the_textbook_volumes(n):
    m = 3 * 2**20  # bytes of a bf16 buffer of 3 x 2^19 elements
    elements = m // 2
    assert nccl_bytes.collective("all_reduce", elements, "bf16", n) == [2 * (n - 1) / n * m] * n
    assert nccl_bytes.collective("reduce_scatter_tensor", elements, "bf16", n) == [(n - 1) / n * m] * n
    assert nccl_bytes.collective("all_gather_into_tensor", elements, "bf16", n) == [(n - 1) * m] * n
    reduce = nccl_bytes.collective("reduce", elements, "bf16", n, root=1)
    assert reduce[1] == 0 and sum(reduce) == (n - 1) * m          # a chain ending at the root
    broadcast = nccl_bytes.collective("broadcast", elements, "bf16", n, root=1)
    assert broadcast[0] == 0 and sum(broadcast) == (n - 1) * m    # a chain starting at the root, ending before it
    with pytest.raises(ValueError, match="all_reduce"):
        nccl_bytes.collective("all_to_all", 1, "bf16", n)


# --------------------------------------------------------------------------- ZeRO-1/2: who reduces where

def test_destination_slices_cut_parameters_at_partition_edges_in_bucket_order():
    numels = [5, 10, 7]            # 22 elements, 3 ranks: padded to 24, 8 per rank
    assert partition.partition_size(22, 3) == 8
    # parameter 1 spans [5, 15): 3 elements of rank 0, 7 of rank 1; parameter 2 spans [15, 22): 1 of rank 1, 6 of 2
    assert partition.destination_slices([2, 1], numels, 3) == [(1, 8), (2, 6), (0, 3)]
    assert partition.destination_slices([0, 1, 2], numels, 3) == [(0, 8), (1, 8), (2, 6)]


@pytest.mark.parametrize("keys, op", [({}, "all_reduce"),
                                      ({"use_multi_rank_bucket_allreduce": False}, "reduce"),
                                      ({"reduce_scatter": False}, "all_reduce"),
                                      ({"reduce_scatter": False, "use_multi_rank_bucket_allreduce": False},
                                       "all_reduce")])
def test_which_settings_reduce_to_owners(keys, op):
    zero = {**step_bytes.ZERO_DEFAULTS, **keys}
    ops = partition.bucket_reductions([0, 1], [6, 6], 2, zero)
    assert {o for o, _, _ in ops} == {op}
    assert sum(numel for _, numel, _ in ops) == 12
    assert [root for _, _, root in ops] == ([0, 1] if op == "reduce" else [None])


@pytest.mark.parametrize("n", [2, 3, 5])
def test_stage_2_reduces_each_bucket_to_its_owners_in_the_order_backward_meets_them(n):
    numels = _trace()["numels"]
    psi, size = sum(numels), partition.partition_size(sum(numels), n)
    reduces = [c for c in _collectives(2, n, **OWNERS) if c["op"] == "reduce"]
    assert {c["root"]: c["numel"] for c in reduces} == {r: min(size, psi - r * size) for r in range(n)}
    first_ready = zero3_fetch.ready_order(_trace())[0]   # the output head: its gradient is ready first
    assert reduces[0]["root"] == sum(numels[:first_ready]) // size
    assert reduces[-1]["root"] == 0                      # the embedding's, ready last
    # stage 1 reduces at the boundary, in parameter order: rank 0's part first
    assert [c["root"] for c in _collectives(1, n, **OWNERS) if c["op"] == "reduce"] == list(range(n))


def test_small_buckets_reduce_to_owners_one_reduce_per_owner_per_bucket():
    buckets = {"reduce_bucket_size": 40000, "use_multi_rank_bucket_allreduce": False}
    reduces = [c for c in _collectives(2, 3, zero_optimization=buckets) if c["op"] == "reduce"]
    all_reduces = [c for c in _collectives(2, 3, zero_optimization={"reduce_bucket_size": 40000})
                   if c["op"] == "all_reduce" and c["numel"] > 1]
    assert len(all_reduces) > 2 and len(reduces) >= len(all_reduces)
    assert sum(c["numel"] for c in reduces) == sum(c["numel"] for c in all_reduces) == sum(_trace()["numels"])
    for c in reduces:   # each names its owner
        assert f"to rank {c['root']}, its owner" in c["what"]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_reduce_to_owners_is_the_papers_count_on_nccl_and_the_default_costs_half_as_much_again(n):
    ring, psi_bytes = (n - 1) / n, 2 * sum(_trace()["numels"])
    quiet = {"gradient_clipping": 0.0, "bf16": {"check_grad_overflow": False}}
    default = _collectives(2, n, zero_optimization={"compute_grad_norm": False}, **quiet)
    owners = _collectives(2, n, zero_optimization={"compute_grad_norm": False, **OWNERS["zero_optimization"]},
                          **quiet)
    assert max(step_bytes.wire_bytes(owners, n, nccl_bytes)) / psi_bytes == pytest.approx(2 * ring, rel=1e-4)
    assert max(step_bytes.wire_bytes(default, n, nccl_bytes)) / psi_bytes == pytest.approx(3 * ring, rel=1e-4)
    # on gloo the reduces cost more than a reduce-scatter: the ring round, then every piece to its root
    assert max(step_bytes.wire_bytes(default, n)) > max(step_bytes.wire_bytes(owners, n)) > \
        max(step_bytes.wire_bytes(owners, n, nccl_bytes))


def test_reduce_scatter_false_runs_the_same_all_reduce_as_the_default():
    assert _ops(_collectives(2, 3, zero_optimization={"reduce_scatter": False})) == _ops(_collectives(2, 3))


# --------------------------------------------------------------------------- ZeRO-3's first step

@pytest.mark.parametrize("n", [2, 3])
def test_zero3_first_step_gathers_each_module_in_forward_and_backward_after_two_broadcasts(n):
    trace = _trace()
    first = _collectives(3, n, first_step=True)
    owners = [m for m in trace["modules"] if m]
    gathers = [c for c in first if c["op"] == "all_gather_into_tensor"]
    shard = [-(-k // n) for k in trace["numels"]]
    assert len(gathers) == 2 * len(owners)
    assert sorted(c["numel"] for c in gathers) == sorted(2 * [sum(shard[p] for p in m) for m in owners])
    assert _ops(first[:2]) == [("broadcast", 1, "int64", None), ("broadcast", 0, "int64", None)]
    steady = _collectives(3, n)
    assert [c for c in first if c["op"] not in ("broadcast", "all_gather_into_tensor")] == \
        [c for c in steady if c["op"] != "all_gather_into_tensor"]
    # the first step's gathers are what a model too big to keep gathered runs on every step
    big = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    assert step_bytes.logged(gathers) == step_bytes.logged(
        [c for c in _collectives(3, n, zero_optimization=big) if c["op"] == "all_gather_into_tensor"])


def test_first_step_of_stages_0_to_2_is_like_every_other():
    for stage in (0, 1, 2):
        assert _collectives(stage, 3, first_step=True) == _collectives(stage, 3)


def test_report_prices_nccl_and_says_which_step():
    cfg = step_bytes.comm_config(3, 2)
    rep = step_bytes.sent_per_rank(_trace(), 2, cfg, first_step=True)
    assert rep["first_step"] and "the first optimizer step" in step_bytes.format_report(rep)
    assert "NCCL" in step_bytes.format_report(rep)
    psi = rep["param_bytes"]
    assert max(rep["nccl_bytes"]) / psi == pytest.approx(1.5, abs=1e-4)      # the paper's 3(N-1)/N at N = 2
    steady = step_bytes.sent_per_rank(_trace(), 2, cfg)
    assert steady["nccl_bytes"] / psi == pytest.approx(1.0, abs=1e-4)         # one gather kept for the backward


def test_logged_messages_keeps_counts_by_size_and_drops_log_summarys_barrier():
    summary = {"summary": {"all_reduce": {4: {"count": 2, "total_latency_ms": 0.1}},
                           "log_summary_barrier": {0: {"count": 1}}}}
    assert step_bytes.logged_messages(summary) == {"all_reduce": {4: 2}}
    assert step_bytes.logged_messages(summary["summary"]) == {"all_reduce": {4: 2}}


# --------------------------------------------------------------------------- chapter 10's table

def test_table_setups_are_valid_configs_and_rows_are_in_psi():
    configs = bytes_table.setup_configs(world_size=2)
    assert list(configs) == list(bytes_table.SETUPS)
    assert configs["ZeRO-2 reduce to owners"]["zero_optimization"]["use_multi_rank_bucket_allreduce"] is False
    rows = {r["label"]: r for r in bytes_table.predicted_rows(world_size=2, shape=SHAPE)}
    assert rows["ZeRO-0"]["ideal"] == 1.0 and rows["ZeRO-3"]["ideal"] == 1.5
    assert rows["ZeRO-2 reduce to owners"]["nccl"] == pytest.approx(1.0, abs=1e-3)
    assert rows["ZeRO-3 first step"]["gloo"] > rows["ZeRO-3"]["gloo"]
    fig, data = plots.comm_bytes_bars(list(rows.values()))
    assert data["labels"] == list(rows) and data["measured"] == [None] * len(rows)   # no measurement: no bar
    fig.clf()


def test_per_collective_table_in_units_of_the_buffer():
    rows = {(r["collective"], r["world_size"]): r for r in bytes_table.per_collective(world_sizes=(4,))}
    assert rows["reduce_scatter_tensor", 4]["nccl"] == 0.75 and rows["all_reduce", 4]["nccl"] == 1.5
    assert rows["reduce_scatter_tensor", 4]["gloo"] == rows["all_reduce", 4]["gloo"]


# --------------------------------------------------------------------------- real ranks

@pytest.fixture(scope="module")
def three_ranks():
    """3 new ranks run the settings one after another; the first step is measured (ZeRO-3's differs)."""
    configs = {"ZeRO-1 owners": deep_merge(step_bytes.comm_config(1, 3), OWNERS),
               "ZeRO-2 owners": deep_merge(step_bytes.comm_config(2, 3), OWNERS),
               "ZeRO-2 reduce_scatter off": deep_merge(step_bytes.comm_config(2, 3),
                                                       {"zero_optimization": {"reduce_scatter": False}}),
               "ZeRO-3": step_bytes.comm_config(3, 3)}
    result = launch.run("comm_bytes", world_size=3, stream=False, timeout=900, ds_configs=list(configs.values()),
                        shape=SHAPE, warmup_steps=0)
    return {name: step_bytes.sent_per_rank(_trace(), 3, cfg, [{"rank": r["rank"], **r["runs"][i]} for r in result.results],
                                    first_step=True)
            for i, (name, cfg) in enumerate(configs.items())}


@pytest.mark.parametrize("name", ["ZeRO-1 owners", "ZeRO-2 owners", "ZeRO-2 reduce_scatter off", "ZeRO-3"])
def test_each_rank_sends_what_the_settings_predict(three_ranks, name):
    rep = three_ranks[name]
    predicted = rep["deepspeed_bytes"] if isinstance(rep["deepspeed_bytes"], list) else [rep["deepspeed_bytes"]] * 3
    for m in rep["measured"]:
        assert m["bytes"] == pytest.approx(predicted[m["rank"]], rel=0.01)
        logged = {op: {int(size): count for size, count in sizes.items()} for op, sizes in m["comms_logger"].items()}
        assert logged == rep["predicted_comms_logger"]
    if "owners" in name:   # 3 ranks: each rank is a root once, so the ranks send different amounts
        assert len(set(predicted)) > 1
