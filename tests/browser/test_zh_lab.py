"""The Chinese lab (`make lab-zh` = `python -m tools.zh_lab`) in headless Chromium: the UI is in Chinese, a zh chapter
opens, and its kernel runs in notebooks/ like the English chapter's (so `runs/05`, `../data` resolve the same).

The server is started with the exact arguments of tools.zh_lab, plus a port, a token and throwaway user settings
(autosave off, so the committed notebook is never written). Screenshot: tests/browser/screenshots/zh_lab.png.
"""
import time
from pathlib import Path

import pytest
from support import BROWSER_SKIPS, CHROMIUM, CHROMIUM_ARGS, jupyterlab_server, sync_playwright


ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "tests" / "browser" / "screenshots"
NOTEBOOK = "zh/00_setup.ipynb"

pytestmark = BROWSER_SKIPS


@pytest.fixture(scope="module")
def zh_lab_server(tmp_path_factory):
    """`python -m tools.zh_lab` on localhost; yields (base url, token, server pid); shut down with its kernels."""
    # throwaway user settings: never autosave (the committed notebook stays as it is), no news or update checks
    settings = {"@jupyterlab/docmanager-extension/plugin": {"autosave": False},
                "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}}
    with jupyterlab_server(tmp_path_factory.mktemp("zh-lab"), "tools.zh_lab", settings, cwd=ROOT) as (base, token,
                                                                                                     server):
        yield base, token, server.pid


def test_lab_is_in_chinese_and_a_zh_chapter_runs_in_notebooks(zh_lab_server):
    import psutil

    base, token, pid = zh_lab_server
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}", timeout=300_000)
            menu = page.locator("#jp-MainMenu")
            menu.wait_for(timeout=300_000)
            page.wait_for_function("() => document.querySelector('#jp-MainMenu').innerText.includes('文件')",
                                   timeout=120_000)
            labels = menu.inner_text()
            # JupyterLab's own menus, translated by the zh_CN language pack: File, Edit, Kernel, Help
            for zh in ("文件", "编辑", "内核", "帮助"):
                assert zh in labels, labels
            assert "File" not in labels and "Kernel" not in labels, labels
            heading = page.locator(".jp-RenderedMarkdown h1").first
            heading.wait_for(timeout=120_000)
            assert heading.inner_text().startswith("00 · 环境准备"), heading.inner_text()
            page.screenshot(path=str(SHOTS / "zh_lab.png"))
        finally:
            browser.close()
    # Opening the notebook started its kernel: it runs where the English chapter's kernel runs.
    deadline = time.monotonic() + 60
    while True:
        kernels = [c for c in psutil.Process(pid).children(recursive=True) if "ipykernel" in " ".join(c.cmdline())]
        if kernels or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert kernels, "no kernel started for the notebook"
    assert {Path(k.cwd()) for k in kernels} == {ROOT / "notebooks"}

