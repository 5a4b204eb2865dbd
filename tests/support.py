"""Helpers several test files share (pytest puts tests/ on sys.path: `from support import ...`)."""
import contextlib
import io
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

import psutil
import pytest

from dslab.config import build

# Debian's chromium, never a browser download, driven by playwright (the optional `browser` extra)
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None
BROWSER_SKIPS = [  # pytestmark of the tests that drive JupyterLab in chromium
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install -y chromium"),
    pytest.mark.skipif(sync_playwright is None, reason="needs playwright: pip install -e '.[browser]'"),
]


# What deepspeed.initialize says where the accelerator has no fp16 (DeepSpeed's own words, checked by the tests that
# force that answer: most CPUs; AVX512-FP16 / AMX-FP16 Xeons and GPUs accept fp16).
FP16_REFUSAL = "Type fp16 is not supported on your device"


def force_fp16_support(monkeypatch, supported):
    """Make DeepSpeed's accelerator answer `supported` to is_fp16_supported() for one test, on any machine: both
    branches of what depends on it (fp16 refused on most CPUs, allowed on AVX512-FP16 / AMX-FP16 Xeons and GPUs)."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: supported)


def processes_mentioning(text):
    """Live (not zombie) processes whose command line mentions `text`: stray launchers or ranks."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(text in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def assert_no_strays(text):
    """Fail if a process mentioning `text` still runs, after killing it (clean up what the test started)."""
    strays = processes_mentioning(str(text))
    for proc in strays:
        proc.kill()
    assert not strays, f"processes left running: {[(p.pid, p.info['cmdline']) for p in strays]}"


def valid_config(precision="bf16", **changes):
    """A valid ZeRO-2 config for 2 ranks, then `changes` deep-merged in unchecked (to make bad ones)."""
    cfg = build.make_config(zero_stage=2, precision=precision, micro_batch_size=4, grad_accum_steps=2, world_size=2)
    return build.deep_merge(cfg, changes)


@contextlib.contextmanager
def jupyterlab_server(home, module, settings, cwd, extra_args=(), env=None):
    """`python -m module` (JupyterLab, or a tool that starts it) on a free localhost port with throwaway user settings
    under `home` (`settings`: {"@jupyterlab/<plugin>": {...}}): yields (base url, token, server Popen) once it
    answers; then asks it to shut down (which stops its kernels) and ends every process it started."""
    from dslab.launch import free_port

    for plugin, values in settings.items():
        path = Path(home) / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(env or os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    cmd = [sys.executable, "-m", module, "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
           f"--FileCheckpoints.checkpoint_dir={home / 'checkpoints'}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly",
           *extra_args]
    if os.geteuid() == 0:  # CI runs as root; JupyterLab refuses root unless told
        cmd.append("--allow-root")
    log = open(home / "server.log", "w")
    server = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, f"{module} exited:\n" + (home / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, \
                f"{module} did not answer:\n" + (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield base, token, server
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


_RANK_EXERCISES_RUN = []


def run_rank_exercises_together():
    """Once per test session: the answers tests/test_exercises.py, tests/test_exercises_parallel.py and
    tests/test_redteam_ranks_a.py, _b.py and _c.py check on ranks, every exercise's, run in one launch per world size
    (dslab.exercises.on_ranks.batched) instead of one per exercise and world size. Starting ranks (the launcher, torch
    and DeepSpeed imported on every rank) is most of a launch's time on a small machine: benchmarks/rank_startup.py
    measures it."""
    if _RANK_EXERCISES_RUN:
        return
    _RANK_EXERCISES_RUN.append(True)
    import test_exercises
    import test_exercises_parallel
    import test_redteam_ranks_a
    import test_redteam_ranks_b
    import test_redteam_ranks_c

    from dslab.exercises import on_ranks

    with on_ranks.batched():
        for module in (test_exercises, test_exercises_parallel, test_redteam_ranks_a, test_redteam_ranks_b,
                       test_redteam_ranks_c):
            module.prepare_all_on_ranks()


# ---------------------------------------------------------------------------------------------- exercise verdicts

def said(exercise_id, answer):
    """(check's verdict, what it printed)."""
    from dslab import exercises

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        verdict = exercises.check(exercise_id, answer)
    return verdict, out.getvalue()


def refused(exercise_id, answer, words):
    """The checker refuses the answer, and its message holds `words`."""
    verdict, text = said(exercise_id, answer)
    assert verdict is False and text.startswith("Not quite: "), text
    assert words in text, f"expected {words!r} in:\n{text}"


def accepted(exercise_id, answer):
    verdict, text = said(exercise_id, answer)
    assert (verdict, text) == (True, "Correct!\n"), text
