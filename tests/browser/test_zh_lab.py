"""The Chinese lab (`make lab-zh` = `python -m tools.zh_lab`) in headless Chromium: the UI is in Chinese, a zh chapter
opens, and its kernel runs in notebooks/ like the English chapter's (so `runs/05`, `../data` resolve the same).

The server is started with the exact arguments of tools.zh_lab, plus a port, a token and throwaway user settings
(autosave off, so the committed notebook is never written). Screenshot: tests/browser/screenshots/zh_lab.png.
"""
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "tests" / "browser" / "screenshots"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
NOTEBOOK = "zh/00_setup.ipynb"

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # the optional `browser` extra
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(sync_playwright is None, reason="needs playwright: pip install -e '.[browser]'"),
]


def _free_port():
    from dslab.launch import free_port

    return free_port()


@pytest.fixture(scope="module")
def zh_lab_server(tmp_path_factory):
    """`python -m tools.zh_lab` on localhost; yields (base url, token, server pid); shut down with its kernels."""
    import psutil

    home = tmp_path_factory.mktemp("zh-lab")
    # throwaway user settings: never autosave (the committed notebook stays as it is), no news or update checks
    for plugin, values in {"docmanager-extension/plugin": {"autosave": False},
                           "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}}.items():
        path = home / "settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    cmd = [sys.executable, "-m", "tools.zh_lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
           f"--FileCheckpoints.checkpoint_dir={home / 'checkpoints'}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"]
    if os.geteuid() == 0:  # CI runs as root; JupyterLab refuses root unless told
        cmd.append("--allow-root")
    log = open(home / "server.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, "tools.zh_lab exited:\n" + (home / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "no answer:\n" + (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield base, token, server.pid
    finally:
        family = [server] + psutil.Process(server.pid).children(recursive=True) if server.poll() is None else [server]
        try:
            urllib.request.urlopen(urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST",
                                                          data=b""), timeout=10).close()
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

