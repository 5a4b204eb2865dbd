"""Faults from outside the inputs: a rank killed by a signal, an output that cannot be written, Ctrl-C during
`dslab sft`. Each must end every rank, say what happened, and keep what was already on disk."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dslab import data, launch
from dslab.launch import guard, supervise
from support import assert_no_strays, processes_mentioning

# Rank 1 dies from SIGKILL right after the process group is up (what the OOM killer does): no traceback,
# no exit handler. Rank 0 is waiting for it in a collective, so it fails too, with a mere echo of the loss.
KILLED = """
import os
import signal
import time
import torch
import torch.distributed as torch_dist
from dslab import this_rank
torch_dist.init_process_group("gloo")  # torch only: cheaper than DeepSpeed for this test
if this_rank.rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
torch_dist.all_reduce(torch.ones(1))
time.sleep(120)
"""


def test_rank_killed_by_a_signal_is_named_and_nothing_is_left(tmp_path):
    script = tmp_path / "killed_rank.py"
    script.write_text(textwrap.dedent(KILLED))
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.run(str(script), world_size=2, stream=False, run_dir=tmp_path / "runs", timeout=60)
    elapsed = time.monotonic() - start
    assert_no_strays(str(script))
    message = str(info.value).split("\n")[0]
    assert elapsed < 30, f"the failure took {elapsed:.0f} s to surface"
    # The rank that died is named, not rank 0, which only lost its peer ("Connection reset by peer").
    assert "rank 1" in message and "rank 0 failed" not in message, message
    # The launcher passes on the signal when it sees rank 1's death first; when rank 0's echo comes in the same
    # poll, the message still says rank 1 died without a traceback.
    assert "killed by SIGKILL" in message or "without a traceback" in message, message


def test_a_silent_rank_is_named_even_when_the_launcher_passes_on_its_peers_echo(tmp_path):
    # The race the test above can lose under load, made certain: the launcher exits with rank 0's status 1 (an
    # echo of the lost peer), and rank 1 left no traceback.
    echo = "Traceback (most recent call last):\n  ...\nRuntimeError: Connection closed by peer [127.0.0.1]:1234"
    with pytest.raises(launch.LaunchError) as info:
        supervise._raise_failure("job", 2, {0: echo, 1: "started\n"}, ["launcher output"], [1], tmp_path)
    message = str(info.value).split("\n")[0]
    assert "rank 1 failed without a traceback" in message and "launcher exit status 1" in message, message


# --------------------------------------------------------------------------- output that cannot be written

def _sft_cli(*args, **kwargs):
    # A shell without job control starts background commands with SIGINT ignored, and children inherit that
    # (a CI runner may do the same); Ctrl-C in a terminal arrives at a process with the default handler.
    return subprocess.Popen([sys.executable, "-m", "dslab.cli", "sft", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=kwargs.pop("cwd"), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def _identity_file(folder):
    """8 self-cognition rows: 2 ranks x micro-batch 2 gives 2 steps per epoch."""
    rows = data.load_jsonl(data.DATA_DIR / "self_cognition.jsonl")[:8]
    path = folder / "identity.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _wait_for_first_checkpoint(proc, checkpoints, poll_s):
    deadline = time.monotonic() + 240
    while not (checkpoints / "latest").exists():
        assert proc.poll() is None, f"dslab sft ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(poll_s)


def test_unwritable_output_fails_before_any_rank_starts(tmp_path):
    """Tests run as root here, so chmod cannot make a folder unwritable; a path *under a regular file* cannot be
    created by anyone (ENOTDIR), which is the same failure for `dslab sft`."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    start = time.monotonic()
    proc = _sft_cli("--output", str(blocker / "adapter"), "--epochs", "1", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, err
    assert "--output" in err and str(blocker) in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()  # the launcher never ran
    assert blocker.read_text() == "not a folder"
    assert elapsed < 60, f"refusing took {elapsed:.0f} s"


def test_unwritable_checkpoint_dir_fails_before_any_rank_starts(tmp_path, monkeypatch):
    from dslab.training import sft

    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="--checkpoint-dir"):
        sft.run(output=str(tmp_path / "adapter"), save_every=1, checkpoint_dir=str(blocker / "checkpoints"))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("full, save_every, option", [(False, 0, "--output"), (True, 10, "--checkpoint-dir")])
def test_a_nearly_full_disk_fails_before_any_rank_starts(tmp_path, monkeypatch, full, save_every, option):
    """The disk has room for the output but not for the checkpoints of a full fine-tune (7x the weight files:
    fp32 master weights and two Adam moments), or not even for the output: refused, saying how much is needed."""
    import shutil

    from dslab import files
    from dslab.models import loading
    from dslab.training import sft

    weights = (Path(loading.resolve_model()) / "model.safetensors").stat().st_size
    free = 3 * weights if full else weights // 2
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * weights, 10 * weights - free, free))
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(OSError, match=f"{option} .*MiB free on that disk, about .*MiB needed; free some space"):
        sft.run(output=str(tmp_path / "out"), full=full, save_every=save_every)
    assert time.monotonic() - start < 10
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- Ctrl-C during training

def _tree_digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_ctrl_c_stops_every_rank_and_keeps_the_checkpoint(tmp_path):
    from dslab.training import sft_settings
    from dslab.models.checkpoints import STATE_FILE, latest_checkpoint

    if "save_every" not in sft_settings.DEFAULTS:
        pytest.skip("dslab sft has no --save-every: nothing is written before the end to keep")
    identity = _identity_file(tmp_path)
    output, checkpoints = tmp_path / "adapter", tmp_path / "checkpoints"
    proc = _sft_cli("--output", str(output), "--data", str(identity), "--mix-general", "0", "--epochs", "2000",
                    "--micro-batch-size", "2", "--save-every", "1", "--lora-r", "4", "--checkpoint-dir", str(checkpoints),
                    "--model-name", "Whale", "--model-author", "DSLab", cwd=tmp_path)
    try:
        _wait_for_first_checkpoint(proc, checkpoints, poll_s=0.5)
        time.sleep(0.5)
        tag = (checkpoints / "latest").read_text().strip()
        first = _tree_digest(checkpoints / tag)
        assert proc.poll() is None, "training ended before it could be interrupted; raise --epochs"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, f"dslab sft was not interrupted:\n{out[-3000:]}\n{err[-3000:]}"
    assert_no_strays(str(output))  # the ranks got --output on their command lines
    assert _tree_digest(checkpoints / tag) == first  # the checkpoint written before Ctrl-C is intact
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    assert (latest / STATE_FILE).exists()  # `latest` names a complete checkpoint
    assert not output.exists()  # no half-written adapter
    latest_checkpoint(checkpoints)  # resumable


# --------------------------------------------------------------------------- the starter killed with -9

SLEEPER = """
import time
import torch.distributed as torch_dist
torch_dist.init_process_group("gloo")
print("ranks up", flush=True)
time.sleep(300)
"""


def test_kill_9_of_the_command_takes_the_launcher_and_ranks_with_it(tmp_path):
    """What a lost terminal or a job scheduler does: SIGKILL to the process group of `dslab launch`. The deepspeed
    launcher runs in a session of its own, so it is not in that group; it must still go, with its ranks, at once."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    proc = subprocess.Popen([sys.executable, "-m", "dslab.cli", "launch", "--world-size", "2", str(script)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while len([p for p in processes_mentioning(str(script)) if p.pid != proc.pid]) < 3:  # launcher + 2 ranks
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the ranks did not start within 240 s"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while processes_mentioning(str(script)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_no_strays(str(script))


def test_kill_9_of_the_process_group_of_dslab_sft_leaves_nothing_and_resume_continues_the_loss_curve(
        tmp_path, monkeypatch):
    """`setsid dslab sft ...` ended by `kill -9 -PGID` (what a lost terminal or a job scheduler does): only
    `dslab sft` is in that group, yet within 5 s no launcher and no rank of the run is left (the launcher, in a
    session of its own, gets SIGTERM from the kernel when dslab dies, and dslab's guard stops the rest). Then
    `dslab sft --resume OUTPUT` (the run's own --output) finds OUTPUT-checkpoints and picks up at the last complete
    checkpoint: at most --save-every steps are lost, and the losses from there on are exactly those of a run that
    was never interrupted (same data order, optimizer moments and learning-rate schedule)."""
    from dslab.training import sft
    from dslab.models.checkpoints import latest_checkpoint

    monkeypatch.chdir(tmp_path)
    identity = _identity_file(tmp_path)
    save_every, epochs = 4, 24  # 8 chats / 2 ranks / 2 per micro-batch = 2 steps per epoch: 48 steps
    reference = sft.run(output=tmp_path / "reference", data=str(identity), mix_general=0, epochs=epochs,
                        micro_batch_size=2, lora_r=4, lora_alpha=8, model_name="Whale", model_author="DSLab",
                        stream=False, timeout=600)
    assert len(reference["loss_log"]) == reference["steps"] == 2 * epochs

    output, checkpoints = tmp_path / "adapter", tmp_path / "adapter-checkpoints"
    common = ["--output", str(output), "--data", str(identity), "--mix-general", "0", "--epochs", str(epochs),
              "--micro-batch-size", "2", "--lora-r", "4", "--lora-alpha", "8", "--model-name", "Whale",
              "--model-author", "DSLab", "--log-every", "1"]
    proc = _sft_cli(*common, "--save-every", str(save_every), cwd=tmp_path)  # a session of its own, as setsid gives
    try:
        _wait_for_first_checkpoint(proc, checkpoints, poll_s=0.05)
        time.sleep(0.5)  # a few more steps, maybe into the middle of the next checkpoint write
        assert proc.poll() is None, "training ended before it could be killed; raise epochs"
        job = [p for p in processes_mentioning(str(output)) if p.pid != proc.pid]
        assert len(job) >= 3, job  # the deepspeed command, the per-node launcher, 2 ranks (all name OUTPUT)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert guard.wait_gone(job, timeout=5), "launcher or ranks still running 5 s after kill -9 -PGID"
    assert_no_strays(str(output))
    assert not output.exists()  # no adapter that looks finished
    # the ranks' logs sit beside the output, as its checkpoints do, not in the directory the run started from
    assert (tmp_path / "adapter-logs").is_dir() and not (tmp_path / "runs").exists()
    last_logged = max(int(line.split("step")[1].split("/")[0]) for line in out.splitlines() if "] step " in line)
    tag_dir, state = latest_checkpoint(checkpoints)  # `latest` names a complete checkpoint
    assert state["step"] % save_every == 0 and last_logged - state["step"] <= save_every  # steps lost

    resumed = _sft_cli(*common, "--resume", str(output), cwd=tmp_path)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"saved the adapter to {output}" in out and f"{2 * epochs} steps" in out, out[-3000:]
    assert (output / "adapter_model.safetensors").exists()
    log = json.loads((output / "loss_log.json").read_text())
    assert [e["step"] for e in log] == list(range(state["step"] + 1, 2 * epochs + 1))
    assert [e["loss"] for e in log] == [e["loss"] for e in reference["loss_log"][state["step"]:]]
