"""The ZeRO explorer: set a control, check the chart's data (theory) and the measured overlay."""
import re

import pytest

from dslab import memory, widgets


def _rects(svg):
    """(rank, kind, part, bytes) of every bar segment drawn in the SVG."""
    return [(int(r), k, p, int(b)) for r, k, p, b in
            re.findall(r'data-rank="(-?\d+)" data-kind="([\w-]+)" data-part="(\w+)" data-bytes="(\d+)"', svg)]


def _fake_measure(factor=1.0, params=1_406_080):
    """A measure_fn returning a report shaped like dslab.memory.measure's, off theory by `factor`."""
    calls = []

    def run(zero_stage, world_size, offload_optimizer, offload_param):
        calls.append((zero_stage, world_size, offload_optimizer, offload_param))
        t = memory.theory(params, world_size, zero_stage, "bf16", offload_optimizer, offload_param)
        measured = [{"rank": r, **{p: int(t[p] * factor) for p in memory.PARTS}, "buffers": 1000,
                     "offloaded": t["offloaded"], "host_buffers": 0} for r in range(world_size)]
        for m in measured:
            m["total"] = m["params"] + m["grads"] + m["optimizer"]
        return memory.report(params, world_size, zero_stage, "bf16", offload_optimizer, offload_param, measured)

    run.calls = calls
    return run


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


def test_measure_button_overlays_measured_bars():
    fake = _fake_measure(factor=1.01)
    z = widgets.ZeroExplorer(params=7e9, world_size=2, zero_stage=3, measure_fn=fake)
    z.measure_button.click()
    assert fake.calls == [(3, 2, False, False)]
    assert round(z.params.value) == 1_406_080                    # the slider now shows the measured model's size
    assert z.data["theory"] == memory.theory(1_406_080, 2, 3)      # theory of what was measured
    measured = [(r, p, b) for r, k, p, b in _rects(z.chart.value) if k == "measured"]
    assert {r for r, _, _ in measured} == {0, 1} and any(p == "buffers" for _, p, _ in measured)
    assert all(abs(x - 1.01) < 1e-3 for x in z.data["ratios"])
    assert "1.00%" in z.summary.value and not z.measure_button.disabled
    z.stage.value = 2                                             # the controls moved on: the overlay is stale
    assert z.measured is None and not any(k == "measured" for _, k, _, _ in _rects(z.chart.value))


def test_measure_keeps_overlay_when_nothing_changed_and_drops_it_on_a_real_slider_move():
    z = widgets.ZeroExplorer(params=7e9, world_size=2, zero_stage=1, measure_fn=_fake_measure())
    z.measure()
    z.params.value = z.params.value  # no change
    assert z.measured is not None
    z.params.value = 3e9
    assert z.measured is None and z.data["theory"] == memory.theory(3e9, 2, 1)


def test_measure_failure_is_shown_not_raised():
    def broken(*args):
        raise RuntimeError("rank 1 failed")

    z = widgets.ZeroExplorer(world_size=2, measure_fn=broken)
    assert z.measure() is None
    assert "rank 1 failed" in z.status.value and not z.measure_button.disabled and z.measured is None


def test_measure_is_refused_for_world_sizes_this_machine_cannot_run(explorer):
    assert explorer.world_size.value == 8 and explorer.measure_button.disabled
    explorer.measure_fn = _fake_measure()
    assert explorer.measure() is None and "measure runs" in explorer.status.value


def test_controls_have_stable_classes_for_browser_tests(explorer):
    classes = {c for w in (explorer.stage, explorer.offload_optimizer, explorer.offload_param, explorer.world_size,
                           explorer.params, explorer.measure_button, explorer.chart, explorer.summary, explorer.status,
                           explorer.widget) for c in w._dom_classes}
    assert {"dslab-zero-stage", "dslab-zero-offload-optimizer", "dslab-zero-offload-param", "dslab-zero-world-size",
            "dslab-zero-params", "dslab-zero-measure", "dslab-zero-chart", "dslab-zero-summary",
            "dslab-zero-status", "dslab-zero-explorer"} <= classes
    assert explorer.stage.description == "ZeRO stage" and explorer.measure_button.description == "measure"


def test_zero_explorer_returns_a_displayable_widget():
    import ipywidgets

    w = widgets.zero_explorer(params=1e9, world_size=4)
    assert isinstance(w, ipywidgets.VBox) and "dslab-zero-explorer" in w._dom_classes
