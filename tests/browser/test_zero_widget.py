"""The ZeRO explorer in a real JupyterLab, driven in headless Chromium: change the stage, new measured bars follow.

A JupyterLab server starts on a free localhost port with its own settings (autosave off, so the committed
notebook is never written), opens notebooks/04_zero.ipynb, runs only the import cell (which starts 2 live ranks)
and the two widget cells, then picks stages and offload from the widget as a learner would and reads the chart
back from the page: every bar is an SVG <rect> with data-rank / data-kind / data-part / data-bytes (see
dslab/zero/widgets.py). Each change re-initializes DeepSpeed on the live ranks and re-measures: new measured bars must
appear, on both ranks, agreeing with the theory. How long a change takes (the goal: within 10 s) is measured by the
benchmark (`python benchmarks/course_bench.py --parts widget`), on a quiet machine; this test runs beside the others
and only notes the seconds. Screenshots go to tests/browser/screenshots/zero_widget_*.png (gitignored).
"""
import json
import os
import re
import time
from pathlib import Path

import pytest
from support import BROWSER_SKIPS, CHROMIUM, CHROMIUM_ARGS, jupyterlab_server, sync_playwright

from dslab.zero.widgets import STAGES

STAGE_LABELS = {stage: label for label, stage in STAGES}  # the dropdown's option texts

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NOTEBOOK = NOTEBOOKS / "04_zero.ipynb"
SHOTS = ROOT / "tests" / "browser" / "screenshots"
TIMEOUT_MS = 600_000  # a loaded 2-core machine: JupyterLab's first load, `import torch`, ranks joining a group

pytestmark = BROWSER_SKIPS

# JupyterLab user settings for the test server only: never autosave (the notebook stays as committed), render
# every cell (no windowing, so each cell is in the DOM), no news or update checks (nothing leaves localhost).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin": {"enabled": False},
}


def cell_index(cells, pattern):
    """Index of the one code cell whose source matches `pattern` (found by content, so edits elsewhere are fine)."""
    found = [i for i, c in enumerate(cells)
             if c["cell_type"] == "code" and re.search(pattern, "".join(c["source"]), re.M)]
    assert len(found) == 1, f"expected one code cell matching {pattern!r} in {NOTEBOOK.name}, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on localhost serving notebooks/; yields (base url, token); shut down with its kernels."""
    with jupyterlab_server(tmp_path_factory.mktemp("lab"), "jupyterlab", LAB_SETTINGS, cwd=NOTEBOOKS,
                           extra_args=[f"--ServerApp.root_dir={NOTEBOOKS}"],
                           env=dict(os.environ, PYTHONUNBUFFERED="1")) as (base, token, _):
        yield base, token


READ_WIDGET = """root => {
  const bars = [...root.querySelectorAll('.dslab-zero-chart rect.dslab-zero-bar')].map(r => ({
    rank: +r.dataset.rank, kind: r.dataset.kind, part: r.dataset.part, bytes: +r.dataset.bytes,
    title: r.querySelector('title').textContent}));
  const svg = root.querySelector('.dslab-zero-chart svg');
  const select = root.querySelector('.dslab-zero-stage select');
  const box = name => root.querySelector(`.dslab-zero-${name} input[type=checkbox]`);
  const pre = root.querySelector('.dslab-zero-config pre');
  return {bars, svg: svg ? svg.outerHTML : '', summary: root.querySelector('.dslab-zero-summary').innerText,
          status: root.querySelector('.dslab-zero-status').innerText, config: pre ? pre.textContent : '',
          stage: select.options[select.selectedIndex].text,
          rankLabels: [...svg.querySelectorAll('text')].map(t => t.textContent).filter(t => /^rank /.test(t)),
          offloadOptimizer: {checked: box('offload-optimizer').checked, disabled: box('offload-optimizer').disabled},
          offloadParam: {checked: box('offload-param').checked, disabled: box('offload-param').disabled}};
}"""
# New measured bars for this setup: measured <rect>s drawn and the config under the chart is the one asked for.
MEASURED = """([root, stage, offload]) => {
  const pre = root.querySelector('.dslab-zero-config pre');
  if (!pre || !root.querySelector('.dslab-zero-chart rect[data-kind=measured]')) return false;
  const cfg = JSON.parse(pre.textContent).zero_optimization;
  return cfg.stage === stage && (cfg.offload_optimizer || {device: 'none'}).device === offload;
}"""


def per_rank(state, kind="theory"):
    """{rank: {part: bytes}} for one kind of bar ("theory", "measured", "host", ...)."""
    out = {}
    for bar in state["bars"]:
        if bar["kind"] == kind:
            out.setdefault(bar["rank"], {})[bar["part"]] = bar["bytes"]
    return out


def run_cell(page, cell):
    """Select a cell by its prompt, run it with Shift+Enter, wait for its execution count; fail on an error output."""
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputPrompt").first.click()
    page.keyboard.press("Shift+Enter")
    prompt = cell.locator(".jp-InputArea-prompt").first  # "[ ]:" (cleared), "[*]:" (running), "[3]:" (done)
    page.wait_for_function("p => /\\[\\d+\\]/.test(p.textContent)", arg=prompt.element_handle(), timeout=TIMEOUT_MS)
    errors = cell.locator('[data-mime-type="application/vnd.jupyter.error"], '
                          '[data-mime-type="application/vnd.jupyter.stderr"]')
    assert errors.count() == 0, errors.first.inner_text()


def test_stage_and_offload_changes_show_new_measured_bars(lab, tmp_path):
    base, token = lab
    before = NOTEBOOK.read_bytes()
    cells = json.loads(before)["cells"]
    steps = [cell_index(cells, r"^ranks = live\.start\("), cell_index(cells, r"ZeroExplorer\("),
             cell_index(cells, r"^explorer\.widget\s*$")]
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000})
        page = browser.new_page()
        try:
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            notebook_cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
            page.wait_for_function(f"() => document.querySelectorAll('.jp-Notebook .jp-Cell').length === {len(cells)}",
                                   timeout=TIMEOUT_MS)
            # stored outputs hold a widget view of the last nbval run; clear them so the prompts say "[ ]:" until
            # this kernel has run the cell (nothing is saved: autosave is off)
            page.get_by_role("menuitem", name="Edit").click()
            page.get_by_role("menuitem", name="Clear Outputs of All Cells").click()
            for index in steps:  # imports + live ranks, the explorer (it measures), the cell that displays it
                run_cell(page, notebook_cells.nth(index))
            root = notebook_cells.nth(steps[-1]).locator(".dslab-zero-explorer")
            root.wait_for(state="visible")
            root.locator(".dslab-zero-chart rect.dslab-zero-bar").first.wait_for()
            states, seconds = {}, {}

            def change(name, action, stage, offload):
                """Do `action` as a learner would; wait for measured bars of (stage, offload); time it; screenshot."""
                start = time.monotonic()
                action()
                page.wait_for_function(MEASURED, arg=[root.element_handle(), stage, offload], timeout=120_000)
                seconds[name] = time.monotonic() - start
                root.scroll_into_view_if_needed()
                shot = SHOTS / f"zero_widget_{name}.png"
                root.screenshot(path=str(shot))
                states[name] = root.evaluate(READ_WIDGET)
                states[name]["shot"] = shot.read_bytes()

            pick = lambda stage: lambda: root.locator(".dslab-zero-stage select").select_option(  # noqa: E731
                label=STAGE_LABELS[stage])
            tick = lambda name: lambda: root.locator(f".dslab-zero-{name} input[type=checkbox]").click()  # noqa: E731
            # as the notebook left it: ZeRO-3 with the optimizer offloaded, 2 live ranks
            change("stage3_offload", lambda: None, 3, "cpu")
            change("stage2_offload", pick(2), 2, "cpu")
            change("stage1_offload", pick(1), 1, "cpu")
            change("stage1", tick("offload-optimizer"), 1, "none")
            change("stage0", pick(0), 0, "none")
            change("stage3", pick(3), 3, "none")
            page.screenshot(path=str(SHOTS / "zero_widget_page.png"))
        except Exception:
            page.screenshot(path=str(SHOTS / "zero_widget_failure.png"))  # what the page showed when it failed
            raise
        finally:
            browser.close()

    # how long each change took here, beside the other tests (the goal is measured by the benchmark)
    (SHOTS / "zero_widget_seconds.json").write_text(json.dumps(seconds, indent=1))
    for name, s in states.items():  # 2 live ranks, each with theory and measured bars that agree
        assert s["rankLabels"] == ["rank 0", "rank 1"], s["rankLabels"]
        theory, measured = per_rank(s), per_rank(s, "measured")
        assert sorted(theory) == sorted(measured) == [0, 1], name
        for rank in (0, 1):
            t = sum(theory[rank].get(p, 0) for p in ("params", "grads", "optimizer"))
            m = sum(measured[rank].get(p, 0) for p in ("params", "grads", "optimizer"))
            assert abs(m - t) <= 0.02 * t + 64, (name, rank, m, t)  # measured = theory within 2 %
        assert "measured in" in s["status"] and "Measured" in s["summary"], name
    # The paper's per-rank bytes, N = 2, each against the Ψ of its own measured model (the explorer measures the
    # largest model that fits its budget, and that depends on the stage). Zero-byte parts draw no <rect>.
    t0, t1, t2, t3 = (per_rank(states[n])[0] for n in ("stage0", "stage1", "stage2_offload", "stage3"))
    psi = t0["params"] / 2
    assert t0 == pytest.approx({"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi}, rel=1e-6)
    psi = t1["params"] / 2
    assert t1 == pytest.approx({"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi / 2}, rel=1e-6)
    assert t2.get("grads", 0) == 0 and t2.get("optimizer", 0) == 0       # ZeRO-2 + offload: on the host
    assert per_rank(states["stage2_offload"], "host-measured")[0]["offloaded"] > 0
    psi = t3["params"]  # 2 bytes x Ψ/2
    assert t3 == pytest.approx({"params": psi, "grads": psi, "optimizer": 6 * psi}, rel=1e-6)
    assert states["stage0"]["offloadOptimizer"] == {"checked": False, "disabled": True}
    assert states["stage3"]["offloadParam"]["disabled"] is False
    for name, per_param in (("stage0", 16), ("stage1", 2 + 2 + 12 / 2), ("stage3", 16 / 2)):
        assert f"That is {per_param:.3g} bytes per parameter" in states[name]["summary"], states[name]["summary"]
    assert len({s["shot"] for s in states.values()}) == len(states), "screenshots of different setups are identical"
    # the server ran with autosave off: the committed notebook (and its stored outputs) are untouched
    assert NOTEBOOK.read_bytes() == before
