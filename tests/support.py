"""Helpers several test files share (pytest puts tests/ on sys.path: `from support import ...`)."""
import psutil

from dslab import config


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
    cfg = config.make_config(zero_stage=2, precision=precision, micro_batch_size=4, grad_accum_steps=2, world_size=2)
    return config.deep_merge(cfg, changes)
