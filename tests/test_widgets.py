"""The ZeRO explorer: set a control, check the chart's data (theory), and measure on 2 real live ranks."""
import html
import json
import re

import pytest

from dslab.zero import memory, runner, widgets


def _rects(svg):
    """(rank, kind, part, bytes) of every bar segment drawn in the SVG."""
    return [(int(r), k, p, int(b)) for r, k, p, b in
            re.findall(r'data-rank="(-?\d+)" data-kind="([\w-]+)" data-part="(\w+)" data-bytes="(\d+)"', svg)]


@pytest.fixture
def explorer():
    return widgets.ZeroExplorer(params=7e9, world_size=8, zero_stage=2)


def test_starts_with_the_theory_of_its_settings(explorer):
    assert explorer.data["theory"] == memory.theory(7e9, 8, 2)
    theory_bars = [b for b in explorer.data["bars"] if b["kind"] == "theory"]
    assert [b["rank"] for b in theory_bars] == list(range(8))
    drawn = {(rank, part): size for rank, kind, part, size in _rects(explorer.chart.value) if kind == "theory"}
    assert drawn[(3, "params")] == 14_000_000_000 and drawn[(3, "grads")] == 1_750_000_000
    assert "24.45 GiB" in explorer.summary.value


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_dropdown_redraws_the_bars(explorer, stage):
    explorer.stage.value = stage
    t = memory.theory(7e9, 8, stage)
    assert explorer.data["theory"] == t
    drawn = {(r, p): b for r, k, p, b in _rects(explorer.chart.value) if k == "theory" and r == 0}
    for part in memory.PARTS:
        assert drawn.get((0, part), 0) == t[part]


def test_world_size_and_model_size_sliders(explorer):
    explorer.world_size.value = 2
    assert explorer.data["theory"]["optimizer"] == 12 * 7e9 / 2
    assert len([b for b in explorer.data["bars"] if b["kind"] == "theory"]) == 2
    explorer.params.value = 1e9
    assert explorer.data["theory"] == memory.theory(1e9, 2, 2)
    explorer.world_size.value = 64   # too many bars to draw: one stands for every rank
    assert [b["rank"] for b in explorer.data["bars"] if b["kind"] == "theory"] == [-1]
    assert "every rank" in explorer.chart.value


def test_offload_toggles_follow_the_stage_rules(explorer):
    assert explorer.offload_param.disabled and not explorer.offload_optimizer.disabled
    explorer.offload_optimizer.value = True
    t = explorer.data["theory"]
    assert t["optimizer"] == 0 and t["grads"] == 0 and t["offloaded"] == (12 + 4) * 7e9 / 8
    assert any(k == "host" and p == "offloaded" for _, k, p, _ in _rects(explorer.chart.value))
    explorer.stage.value = 3
    assert not explorer.offload_param.disabled
    explorer.offload_param.value = True
    assert explorer.data["theory"]["total"] == 0
    explorer.stage.value = 2   # offload_param needs stage 3: switched off and disabled
    assert not explorer.offload_param.value and explorer.offload_param.disabled
    explorer.stage.value = 0   # offload_optimizer needs a ZeRO stage
    assert not explorer.offload_optimizer.value and explorer.offload_optimizer.disabled
    assert explorer.data["theory"] == memory.theory(7e9, 8, 0)


def test_measure_failure_is_shown_not_raised():
    def broken(*args):
        raise RuntimeError("rank 1 failed")

    z = widgets.ZeroExplorer(world_size=2, measure_fn=broken)
    assert z.measure() is None
    assert "rank 1 failed" in z.status.value and not z.measure_button.disabled and z.measured is None


def test_measure_is_refused_for_world_sizes_this_machine_cannot_run(explorer):
    assert explorer.world_size.value == 8 and explorer.measure_button.disabled
    assert explorer.measure() is None and "measures on" in explorer.status.value


# ----------------------------------------------------------------------------- on real live ranks

@pytest.fixture(scope="module")
def live_explorer(live_two_ranks):
    """An explorer on the session's 2 live ranks; it measures ZeRO-1 at once."""
    return widgets.ZeroExplorer(ranks=live_two_ranks, params=2e6, world_size=2, zero_stage=1)


def test_live_explorer_measures_at_once_and_shows_its_config(live_explorer):
    z = live_explorer
    rep = z.measured
    assert rep is not None and rep["zero_stage"] == 1 and abs(rep["params"] / 2e6 - 1) < 0.15
    assert all(abs(r - 1) < 0.02 for r in z.data["ratios"])                   # measured = theory, both ranks
    assert round(z.params.value) == rep["params"] and z.data["theory"] == memory.theory(rep["params"], 2, 1)
    assert rep["ds_config"] == runner.explorer_config(1, 2) and z.data["ds_config"] == rep["ds_config"]
    shown = json.loads(html.unescape(re.search(r"<pre>(.*)</pre>", z.config_view.value, re.S).group(1)))
    assert shown == rep["ds_config"] and shown["zero_optimization"]["stage"] == 1
    measured = {(r, p) for r, k, p, _ in _rects(z.chart.value) if k == "measured"}
    assert {r for r, _ in measured} == {0, 1} and ("optimizer" in {p for _, p in measured})


def test_stage_and_offload_changes_remeasure_on_the_same_ranks(live_two_ranks, live_explorer):
    z, engines = live_explorer, list(live_two_ranks.pids["engines"])
    z.stage.value = 3                       # what the dropdown does in the browser
    rep = z.measured
    assert rep["zero_stage"] == 3 and rep["ds_config"]["zero_optimization"]["stage"] == 3
    assert all(m["params"] == rep["params"] for m in rep["measured"])        # bf16: 2 bytes x Ψ/2 on each rank
    assert z.seconds < 60, z.seconds        # seconds, not a launch (the browser test holds it to 10 s)
    z.offload_param.value = True            # an offload box re-measures too
    rep = z.measured
    assert rep["offload_param"] and rep["ds_config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert all(m["params"] == 0 for m in rep["measured"]) and all(abs(r - 1) < 0.02 for r in
                                                                   memory.ratios(rep, "offloaded"))
    z.stage.value = 2                       # switches offload_param off: one measurement of plain ZeRO-2
    assert (z.measured["zero_stage"], z.measured["offload_param"]) == (2, False)
    assert not z.offload_param.value and z.offload_param.disabled
    assert live_two_ranks.pids["engines"] == engines  # no new processes: the same live ranks re-initialized DeepSpeed


def test_a_model_too_big_for_the_budget_is_measured_at_the_largest_size_that_fits(live_explorer):
    z = live_explorer
    z.params.value = 7e9
    assert z.measured is None               # a slider move drops the stale overlay; the button measures
    z.measure_button.click()
    rep = z.measured
    assert rep["requested_params"] == 7_000_000_000 and rep["needed_bytes"] > z.budget
    assert rep["params"] < 7e9 and runner.fit_params(rep["params"], 2, 2)[1] <= z.budget
    assert "largest model that fits" in z.status.value and all(abs(r - 1) < 0.02 for r in z.data["ratios"])


def test_live_world_size_other_than_the_ranks_is_theory_only(live_explorer):
    z = live_explorer
    z.world_size.value = 4
    assert z.measure_button.disabled and z.measured is None
    assert z.measure() is None and "measures on 2 rank(s)" in z.status.value
    z.world_size.value = 2


def test_controls_have_stable_classes_for_browser_tests(explorer):
    classes = {c for w in (explorer.stage, explorer.offload_optimizer, explorer.offload_param, explorer.world_size,
                           explorer.params, explorer.measure_button, explorer.chart, explorer.summary, explorer.status,
                           explorer.config_view, explorer.widget) for c in w._dom_classes}
    assert {"dslab-zero-stage", "dslab-zero-offload-optimizer", "dslab-zero-offload-param", "dslab-zero-world-size",
            "dslab-zero-params", "dslab-zero-measure", "dslab-zero-chart", "dslab-zero-summary",
            "dslab-zero-status", "dslab-zero-config", "dslab-zero-explorer"} <= classes
    assert explorer.stage.description == "ZeRO stage" and explorer.measure_button.description == "measure"


def test_zero_explorer_returns_a_displayable_widget():
    import ipywidgets

    w = widgets.zero_explorer(params=1e9, world_size=4)
    assert isinstance(w, ipywidgets.VBox) and "dslab-zero-explorer" in w._dom_classes
