"""The ZeRO explorer in a real JupyterLab, driven in headless Chromium: change the stage, the per-rank bars follow.

A JupyterLab server starts on a free localhost port with its own settings (autosave off, so the committed
notebook is never written), opens notebooks/04_zero.ipynb, runs only the import cell and the two widget cells
(not the multi-rank measurements), then picks stages from the widget's dropdown and reads the chart back from
the page: every bar is an SVG <rect> with data-rank / data-part / data-bytes (see dslab/widgets.py).
Screenshots go to tests/browser/screenshots/zero_widget_*.png (gitignored) so a run can be looked at.
"""
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dslab.widgets import STAGES

STAGE_LABELS = {stage: label for label, stage in STAGES}  # the dropdown's option texts

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NOTEBOOK = NOTEBOOKS / "04_zero.ipynb"
SHOTS = ROOT / "tests" / "browser" / "screenshots"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
# Debian's chromium, never a browser download; the same switches as the slide test, plus a fresh profile each run
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 240_000  # a loaded 2-core machine: JupyterLab's first page load and `import torch` take a while

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # the optional `browser` extra
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(sync_playwright is None, reason="needs playwright: pip install -e '.[browser]'"),
]

# JupyterLab user settings for the test server only: never autosave (the notebook stays as committed), render
# every cell (no windowing, so each cell is in the DOM), no news or update checks (nothing leaves localhost).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin": {"enabled": False},
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cell_index(cells, pattern):
    """Index of the one code cell whose source matches `pattern` (found by content, so edits elsewhere are fine)."""
    found = [i for i, c in enumerate(cells)
             if c["cell_type"] == "code" and re.search(pattern, "".join(c["source"]), re.M)]
    assert len(found) == 1, f"expected one code cell matching {pattern!r} in {NOTEBOOK.name}, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on localhost serving notebooks/; yields (base url, token); shut down with its kernels."""
    import psutil

    home = tmp_path_factory.mktemp("lab")
    for plugin, values in LAB_SETTINGS.items():
        path = home / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={NOTEBOOKS}",
           f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
           f"--FileCheckpoints.checkpoint_dir={home / 'checkpoints'}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"]
    if os.geteuid() == 0:  # CI runs as root; JupyterLab refuses root unless told
        cmd.append("--allow-root")
    log = open(home / "server.log", "w")
    server = subprocess.Popen(cmd, cwd=NOTEBOOKS, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, "JupyterLab exited:\n" + (home / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, \
                "JupyterLab did not answer:\n" + (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield base, token
    finally:
        # Kernels run in their own sessions, so killing the server's process group would leave them behind:
        # note every descendant first, ask the server to shut down (it stops its kernels), then end stragglers.
        try:
            family = [server] + psutil.Process(server.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        try:
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=10).close()
        except OSError:
            pass
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGTERM)
        for proc in family:
            try:
                proc.wait(timeout=10)
            except (psutil.TimeoutExpired, subprocess.TimeoutExpired):
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()


READ_WIDGET = """root => {
  const bars = [...root.querySelectorAll('.dslab-zero-chart rect.dslab-zero-bar')].map(r => ({
    rank: +r.dataset.rank, kind: r.dataset.kind, part: r.dataset.part, bytes: +r.dataset.bytes,
    title: r.querySelector('title').textContent}));
  const svg = root.querySelector('.dslab-zero-chart svg');
  const select = root.querySelector('.dslab-zero-stage select');
  const box = name => root.querySelector(`.dslab-zero-${name} input[type=checkbox]`);
  return {bars, svg: svg ? svg.outerHTML : '', summary: root.querySelector('.dslab-zero-summary').innerText,
          stage: select.options[select.selectedIndex].text,
          rankLabels: [...svg.querySelectorAll('text')].map(t => t.textContent).filter(t => /^rank /.test(t)),
          offloadOptimizer: {checked: box('offload-optimizer').checked, disabled: box('offload-optimizer').disabled},
          offloadParam: {checked: box('offload-param').checked, disabled: box('offload-param').disabled}};
}"""


def per_rank(state, kind="theory"):
    """{rank: {part: bytes}} for one kind of bar ("theory", "host", ...)."""
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


def test_stage_dropdown_redraws_per_rank_bars(lab, tmp_path):
    base, token = lab
    before = NOTEBOOK.read_bytes()
    cells = json.loads(before)["cells"]
    steps = [cell_index(cells, r"^from dslab import"), cell_index(cells, r"ZeroExplorer\("),
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
            for index in steps:  # the imports, the explorer, the cell that displays it; nothing that launches ranks
                run_cell(page, notebook_cells.nth(index))
            root = notebook_cells.nth(steps[-1]).locator(".dslab-zero-explorer")
            root.wait_for(state="visible")
            root.locator(".dslab-zero-chart rect.dslab-zero-bar").first.wait_for()
            states = {}

            def show(stage, pick=True):
                """Pick `stage` in the dropdown (as a learner would), wait for the redraw to settle, screenshot."""
                old_svg = root.evaluate(READ_WIDGET)["svg"]
                if pick:
                    root.locator(".dslab-zero-stage select").select_option(label=STAGE_LABELS[stage])
                    page.wait_for_function(
                        "([el, old]) => { const s = el.querySelector('.dslab-zero-chart svg');"
                        " return s && s.outerHTML !== old; }", arg=[root.element_handle(), old_svg])
                settled = None  # one change can redraw twice (the stage, then an offload box it switches off)
                while settled != (svg := root.evaluate(READ_WIDGET)["svg"]):
                    settled = svg
                    page.wait_for_timeout(1000)
                root.scroll_into_view_if_needed()
                shot = SHOTS / f"zero_widget_stage{stage}.png"
                root.screenshot(path=str(shot))
                states[stage] = root.evaluate(READ_WIDGET)
                states[stage]["shot"] = shot.read_bytes()

            show(2, pick=False)  # as the notebook left it: ZeRO-2, optimizer offloaded, 8 ranks, 7B parameters
            show(3)
            show(0)
            show(1)
            page.screenshot(path=str(SHOTS / "zero_widget_page.png"))
        except Exception:
            page.screenshot(path=str(SHOTS / "zero_widget_failure.png"))  # what the page showed when it failed
            raise
        finally:
            browser.close()

    s2, s3, s0, s1 = states[2], states[3], states[0], states[1]
    for stage, s in states.items():  # the dropdown shows the stage, and there is one labelled bar per rank of 8
        assert s["stage"].startswith(f"ZeRO-{stage}"), s["stage"]
        assert s["rankLabels"] == [f"rank {r}" for r in range(8)], s["rankLabels"]
        assert sorted(per_rank(s)) == list(range(8))
        assert all(bars == per_rank(s)[0] for bars in per_rank(s).values()), "ranks differ in theory"

    # The paper's per-rank bytes (Ψ parameters, N = 8 ranks, bf16 + Adam), checked as ratios so the Ψ slider's
    # rounding does not matter. Zero-byte parts draw no <rect>, hence .get(part, 0).
    t2, t3, t0, t1 = (per_rank(s)[0] for s in (s2, s3, s0, s1))
    psi = t2["params"] / 2
    # ZeRO-2 + offload optimizer: 2Ψ of parameters stay; gradient partition and optimizer states go to the host
    assert s2["offloadOptimizer"]["checked"] and t2.get("grads", 0) == 0 and t2.get("optimizer", 0) == 0
    host = per_rank(s2, "host")[0]["offloaded"]
    assert host > 12 * psi / 8  # at least the optimizer partition
    # ZeRO-3 partitions the parameters too: 8x fewer parameter bytes; the same host bytes
    assert t3["params"] == pytest.approx(2 * psi / 8, rel=1e-6) and per_rank(s3, "host")[0]["offloaded"] == host
    assert not s3["offloadParam"]["disabled"]  # offloading parameters is allowed at stage 3 only
    # ZeRO-0 keeps everything on every rank: 2Ψ + 2Ψ + 12Ψ; offload switches itself off (it needs stage >= 1)
    assert t0 == pytest.approx({"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi}, rel=1e-6)
    assert s0["offloadOptimizer"] == {"checked": False, "disabled": True} and not per_rank(s0, "host")
    # ZeRO-1 partitions the optimizer states only
    assert t1 == pytest.approx({"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi / 8}, rel=1e-6)
    assert s1["offloadParam"] == {"checked": False, "disabled": True}
    # the labels follow: bytes per parameter in the summary, and each bar's tooltip
    for s, per_param in ((s2, 2), (s3, 2 / 8), (s0, 16), (s1, 2 + 2 + 12 / 8)):
        assert f"That is {per_param:.3g} bytes per parameter" in s["summary"], s["summary"]
    assert len({s["summary"] for s in states.values()}) == 4
    assert {b["title"] for b in s2["bars"]} != {b["title"] for b in s3["bars"]}
    assert len({s["shot"] for s in states.values()}) == 4, "screenshots of different stages are identical"
    # the server ran with autosave off: the committed notebook (and its stored outputs) are untouched
    assert NOTEBOOK.read_bytes() == before
