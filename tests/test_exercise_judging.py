"""Red-team tests of the checkers that judge configs and commands (02.bf16_config, 09.ds_config, 11.tp_dp_config,
08.hostfile_command) and of 02.amp_clip: wrong answers, one hard-coded or leaning on the chapter or the checker, are
refused with the mistake named; right answers in unusual but valid forms are accepted; and every registered wrong
answer is shown wrong by running the pinned DeepSpeed itself: its DeepSpeedConfig with the task's world size (the
world size patched into deepspeed.comm, not the checker's own route), its engine's own code for the optimizer it
builds, the Trainer's own checks, and its runner's main() on the words bash hands it, with ssh and the launch
captured instead of run. One process, no process group, no ranks."""
import base64
import contextlib
import copy
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import deepspeed  # noqa: F401  (its first import logs the accelerator it chose: here, not in a check's output)
import pytest

from dslab import compat, exercises
from dslab.exercises import ch02_amp_clip, ch08, ch09

from support import accepted, refused, said

ROOT = Path(__file__).resolve().parent.parent


def solution(chapter, exercise_id):
    import runpy

    return runpy.run_path(str(ROOT / "notebooks" / "solutions" / f"{chapter}_solutions.py"))["SOLUTIONS"][exercise_id]


# ------------------------------------------------------------------------------------- DeepSpeed, run for real

@pytest.fixture
def deepspeed_reads(monkeypatch):
    """reads(cfg, world_size): deepspeed.runtime.config.DeepSpeedConfig(cfg) itself, with deepspeed.comm answering
    rank 0 of `world_size` (what deepspeed.initialize meets on that many ranks, no mpu); the exception it raises, if
    it refuses the config."""
    from deepspeed import comm
    from deepspeed.runtime.config import DeepSpeedConfig

    def reads(cfg, world_size):
        monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
        monkeypatch.setattr(comm, "get_world_size", lambda *a, **k: world_size)
        try:
            return DeepSpeedConfig(copy.deepcopy(cfg))
        except Exception as err:   # DeepSpeed refusing it, in whatever words
            return err

    return reads


@pytest.fixture
def engine_optimizer(deepspeed_reads):
    """built(section): (class name, lr) of the optimizer DeepSpeed's engine code builds from an "optimizer"
    section (torch_adam added, so that no C++ op is built: the Adam/AdamW choice is made before it)."""
    import torch

    def built(section):
        section = copy.deepcopy(section)
        section.setdefault("params", {})["torch_adam"] = True
        read = deepspeed_reads({"train_micro_batch_size_per_gpu": 1, "optimizer": section}, 1)
        optimizer = compat.engine_basic_optimizer(read, torch.nn.Linear(4, 2).parameters())
        return type(optimizer).__name__, optimizer.param_groups[0]["lr"]

    return built


@pytest.mark.parametrize("section", [
    {"type": "Adam"}, {"type": "Adam", "params": {"adam_w_mode": True, "lr": 3e-4}},
    {"type": "Adam", "params": {"adam_w_mode": False}}, {"type": "AdamW", "params": {"adam_w_mode": False}},
    {"type": "ADAMW", "params": {"lr": 1e-4}}])
def test_the_optimizer_the_checkers_resolve_is_the_one_the_engine_builds(section, engine_optimizer):
    """exercises.resolved_optimizer reads an "optimizer" section as deepspeed.initialize builds it: "Adam" is AdamW
    unless adam_w_mode is false, "AdamW" stays AdamW whatever adam_w_mode says, the lr defaults to 1e-3."""
    with_torch_adam = copy.deepcopy(section)
    with_torch_adam.setdefault("params", {})["torch_adam"] = True
    kind, lr, built = exercises.resolved_optimizer(exercises.resolved_config(
        {"train_micro_batch_size_per_gpu": 1, "optimizer": with_torch_adam}, 1))
    assert (kind, lr) == engine_optimizer(section) and built == kind


# --------------------------------------------------------------------------------------------- 02.bf16_config

def _bf16(**changes):
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def test_bf16_config_red_team():
    refused("02.bf16_config", _bf16(train_batch_size=4),   # written for one rank: DeepSpeed derives 4 // (4 x 2)
            "gradient_accumulation_steps 0 x world_size 2")
    refused("02.bf16_config", _bf16(train_micro_batch_size_per_gpu=None, train_batch_size=16,
                                    gradient_accumulation_steps=2), "a micro batch of 4")
    refused("02.bf16_config", _bf16(optimizer={"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}),
            "classic Adam")
    refused("02.bf16_config", _bf16(optimizer={"type": "SGD", "params": {"lr": 1e-3}}), "the optimizer is 'SGD'")
    refused("02.bf16_config", _bf16(gradient_clip=1.0), "unknown key 'gradient_clip'")   # DeepSpeed ignores it
    # DeepSpeed derives the missing batch key, reads "Adam" as AdamW, "bfloat16" as bf16 and a true zero section as
    # stage 1, and the optimizers it builds default to lr 1e-3
    accepted("02.bf16_config", _bf16(train_micro_batch_size_per_gpu=None, train_batch_size=8,
                                     gradient_accumulation_steps=1))
    accepted("02.bf16_config", _bf16(train_batch_size=8, optimizer={"type": "Adam", "params": {
        "lr": 1e-3, "adam_w_mode": True, "torch_adam": True}}))
    accepted("02.bf16_config", _bf16(bf16=None, bfloat16={"enabled": True}, optimizer={"type": "adamw"}))
    accepted("02.bf16_config", _bf16(zero_optimization=True, train_batch_size=8, gradient_accumulation_steps=1))


def test_bf16_config_wrong_answers_are_wrong_in_deepspeed(deepspeed_reads, engine_optimizer):
    """Each registered wrong config: DeepSpeed refuses it on 2 ranks, or reads a run other than the task's (bf16,
    ZeRO-1, 8 = 4 x 1 x 2, AdamW with lr 1e-3)."""
    for cfg, words in exercises.get("02.bf16_config").wrong:
        read = deepspeed_reads(cfg, 2)
        if isinstance(read, Exception):
            continue
        optimizer = engine_optimizer(cfg["optimizer"])
        assert (read.bfloat16_config.enabled, read.zero_optimization_stage, read.train_batch_size,
                read.train_micro_batch_size_per_gpu, read.gradient_accumulation_steps, optimizer) \
            != (True, 1, 8, 4, 1, ("AdamW", 1e-3)), words


def test_the_chapters_config_passes_and_deepspeed_reads_the_task_from_it(deepspeed_reads):
    cfg = solution("02", "02.bf16_config")
    accepted("02.bf16_config", cfg)
    read = deepspeed_reads(cfg, 2)
    assert (read.bfloat16_config.enabled, read.zero_optimization_stage, read.train_batch_size) == (True, 1, 8)


# ------------------------------------------------------------------------------------------- 11.tp_dp_config

def _tp(**changes):
    cfg = {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def test_tp_dp_config_red_team():
    refused("11.tp_dp_config", _tp(train_batch_size=32, train_micro_batch_size_per_gpu=4,
                                   gradient_accumulation_steps=2), "counts the 4 model replicas")   # hard-coded 32
    refused("11.tp_dp_config", _tp(train_batch_size=32, train_micro_batch_size_per_gpu=4),
            "gradient_accumulation_steps, which the config leaves out")   # DeepSpeed derives 32 // (4 x 8) = 1
    refused("11.tp_dp_config", _tp(train_batch_size=64, gradient_accumulation_steps=4), "a micro batch of 2")
    refused("11.tp_dp_config", _tp(tensor_parallel={"tp": {"tp_size": 2}}, train_micro_batch_size_per_gpu=4,
                                   gradient_accumulation_steps=2), "no tensor_parallel.autotp_size")
    # every batch form DeepSpeed accepts on 8 ranks for micro 4 x accumulation 2
    accepted("11.tp_dp_config", _tp(train_batch_size=64, train_micro_batch_size_per_gpu=4))
    accepted("11.tp_dp_config", _tp(train_batch_size=64, gradient_accumulation_steps=2, bf16=None,
                                    fp16={"enabled": True}))                  # 8 GPUs: fp16 is theirs to choose
    accepted("11.tp_dp_config", _tp(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                                    zero_optimization={"stage": 1, "reduce_bucket_size": 2**22}))


def test_tp_dp_config_wrong_answers_are_wrong_in_deepspeed(deepspeed_reads):
    """DeepSpeed refuses each on 8 ranks (AutoTP training passes no mpu, so its batch check counts all 8), or reads
    a grid, stage, micro batch or number of distinct samples other than the task's."""
    for cfg, words in exercises.get("11.tp_dp_config").wrong:
        read = deepspeed_reads(cfg, 8)
        if isinstance(read, Exception):
            continue
        tp = read.tensor_parallel_config.autotp_size
        samples = read.train_micro_batch_size_per_gpu * read.gradient_accumulation_steps * (8 // max(tp, 1))
        assert (tp, read.zero_optimization_stage, read.train_micro_batch_size_per_gpu, samples) != (2, 1, 4, 32), words


def test_autotp_training_passes_no_mpu_to_deepspeeds_config():
    """The source of the rule the exercise teaches: deepspeed.initialize builds DeepSpeedConfig(config, mpu, ...) with
    the mpu it was given (None for AutoTP training), and runtime/config.py then takes dist.get_world_size()."""
    import inspect

    import deepspeed
    from deepspeed.runtime import config

    assert "config_class = DeepSpeedConfig(config, mpu, mesh_device=mesh_device)" in inspect.getsource(
        deepspeed.initialize)
    assert "self.world_size = dist.get_world_size()" in inspect.getsource(config.DeepSpeedConfig.__init__)


# ---------------------------------------------------------------------------------------------- 09.ds_config

def _trainer(**changes):
    cfg = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def test_ds_config_red_team():
    numbers = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    refused("09.ds_config", _trainer(**numbers, train_batch_size=8),   # one process's total, written in
            "train_batch_size counts every rank")
    refused("09.ds_config", _trainer(), "neither train_batch_size nor train_micro_batch_size_per_gpu is set")
    refused("09.ds_config", _trainer(train_batch_size="auto"),   # the Trainer fills 16, DeepSpeed derives 8 x 1
            "a micro batch of 8 and gradient_accumulation_steps 1")
    refused("09.ds_config", _trainer(**numbers, optimizer={"type": "AdamW"}), "lr 0.001")
    refused("09.ds_config", _trainer(**numbers, zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}),
            "stage3_gather_16bit_weights_on_model_save")
    # "auto" or the same number on both sides: the task's numbers typed in, without train_batch_size
    accepted("09.ds_config", _trainer(**numbers, bf16={"enabled": True},
                                      optimizer={"type": "AdamW", "params": {"lr": 1e-4}}))
    accepted("09.ds_config", _trainer(**numbers, train_batch_size=16, gradient_clipping="auto"))   # 2 x 4 x 2 ranks
    accepted("09.ds_config", _trainer(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=4,
                                      train_batch_size=16, gradient_clipping=1.0,
                                      zero_optimization={"stage": 3, "gather_16bit_weights_on_model_save": True},
                                      optimizer={"type": "Adam", "params": {"lr": "auto", "torch_adam": True}}))


def test_ds_config_wrong_answers_are_wrong_for_the_trainer_or_deepspeed(deepspeed_reads):
    """The Trainer's own checks (transformers' trainer_config_process / trainer_config_finalize on the chapter's 2
    ranks) refuse each registered wrong config, or DeepSpeed reads from what the Trainer hands it a run other than
    the task's (ZeRO-3 with the gather flag, 2 x 4, AdamW with lr 1e-4, bf16)."""
    for cfg, words in exercises.get("09.ds_config").wrong:
        try:
            handed = ch09.trainer_resolution(cfg, **ch09.TRAINER_ARGS)
        except ValueError:
            continue
        read = deepspeed_reads(handed, 2)
        if isinstance(read, Exception):
            continue
        params = read.optimizer_params or {}
        kind = read.optimizer_name
        adamw = kind == "adamw" or (kind == "adam" and params.get("adam_w_mode", True))
        assert (read.zero_optimization_stage, read.zero_config.gather_16bit_weights_on_model_save,
                read.train_micro_batch_size_per_gpu, read.gradient_accumulation_steps, adamw,
                params.get("lr", 1e-3), read.bfloat16_config.enabled) != (3, True, 2, 4, True, 1e-4, True), words


# ------------------------------------------------------------------------------------- 08.hostfile_command

FAKE_PROGRAM = '''#!{python}
import json, os, sys
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({{"program": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "env": {{k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ}}}}) + "\\n")
'''


def _bash_calls(tmp_path, command):
    """The programs bash starts for `command` (run in tmp_path, with deepspeed, python and torchrun stand-ins that
    record their words): [{"program", "argv", "env"}, ...]."""
    bin_dir, venv_bin, calls = tmp_path / "bin", tmp_path / ".venv" / "bin", tmp_path / "calls.jsonl"
    for folder in (bin_dir, venv_bin):
        folder.mkdir(parents=True, exist_ok=True)
    for path in (bin_dir / "deepspeed", bin_dir / "python", bin_dir / "torchrun", venv_bin / "deepspeed"):
        path.write_text(FAKE_PROGRAM.format(python=sys.executable))
        path.chmod(0o755)
    calls.write_text("")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "HOME": str(tmp_path)}
    subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, timeout=30)
    return [json.loads(line) for line in calls.read_text().splitlines()]


class _Launched(Exception):
    pass


def runner_would_run(monkeypatch, tmp_path, answer):
    """What DeepSpeed's runner does with the answer, run for real: bash splits the command; the runner's main()
    runs on the words it hands deepspeed (in tmp_path, the hostfile written there), with ssh and pdsh answered and
    the launch captured. {"slots": the GPUs this launch starts ranks on, "port", "script", "exports"}, or the reason
    it would not launch. A launch with a fixed --node_rank (--no_ssh) starts that node's ranks only; pdsh's %n
    starts every node's."""
    from deepspeed.launcher import runner

    for name in ("hostfile", "hf"):
        (tmp_path / name).write_text(answer["hostfile"])
    calls = _bash_calls(tmp_path, answer["command"])
    if not calls:
        return "bash ran none of the stand-ins"
    call = calls[0]
    argv = call["argv"]
    if call["program"] == "python" and argv[:2] == ["-m", "deepspeed.launcher.runner"]:
        argv = argv[2:]
    elif call["program"] != "deepspeed":
        return f"bash runs {call['program']}, not DeepSpeed's runner"
    assert not os.path.exists(runner.DLTS_HOSTFILE)
    launched = {}

    def popen(cmd, env=None, **kwargs):
        launched["cmd"] = cmd
        raise _Launched()

    fake = type("FakeSubprocess", (), {"check_call": staticmethod(lambda *a, **k: 0),
                                       "check_output": staticmethod(lambda *a, **k: b"10.0.0.1\n"),
                                       "Popen": staticmethod(popen), "CalledProcessError": Exception,
                                       "DEVNULL": subprocess.DEVNULL})
    monkeypatch.setattr(runner, "subprocess", fake)
    monkeypatch.setattr(signal, "signal", lambda *a, **k: None)
    for cls in runner.LAUNCHER_CLASSES.values():
        monkeypatch.setattr(cls, "backend_exists", lambda self: True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for key, value in call["env"].items():
        monkeypatch.setenv(key, value)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            runner.main(argv)
    except _Launched:
        pass
    except (SystemExit, ValueError, AssertionError, RuntimeError, NotImplementedError) as err:
        return f"the runner stops: {type(err).__name__} {err}"
    words = launched["cmd"]
    launch = words.index("deepspeed.launcher.launch")
    rest = words[launch + 1:]
    options = [w for w in rest[:next(i for i, w in enumerate(rest) if not w.startswith("--"))]]
    script = rest[len(options)]
    info = dict(o[2:].split("=", 1) for o in options if "=" in o)
    slots = json.loads(base64.urlsafe_b64decode(info["world_info"]))
    if info.get("node_rank", "%n") != "%n":
        host = list(slots)[int(info["node_rank"])]
        slots = {host: slots[host]}
    exports = " ".join(w for w in words[:launch] if "export" in w)
    return {"slots": slots, "port": int(info["master_port"]), "script": script, "exports": exports}


def test_hostfile_command_red_team():
    hostfile = "worker-0 slots=4\nworker-1 slots=4\n"
    refused("08.hostfile_command", {"hostfile": "worker-0 slots=2\nworker-1 slots=4\n",
                                    "command": "deepspeed --master_port 29600 train.py --hostfile hostfile"},
            "--hostfile comes after train.py: DeepSpeed's runner reads its own options only before the script")
    refused("08.hostfile_command", {"hostfile": hostfile, "command": "deepspeed --num_gpus 2 train.py"},
            "its default hostfile, /job/hostfile")            # the chapter's one-machine command, copied
    refused("08.hostfile_command", {"hostfile": hostfile, "command": "deepspeed -H hostfile -i worker-0:0,1@worker-1 "
                                                                     "--launcher=mpi --master_port 29600 train.py"},
            "knows no launcher 'mpi'")
    refused("08.hostfile_command", {"hostfile": hostfile, "command": "python train.py --hostfile hostfile"},
            "the command runs 'python'")
    refused("08.hostfile_command", {"hostfile": hostfile, "command": "deepspeed --hostfile hostfile --include "
                                    "worker-0:0,1@worker-1 --master_port 29600 --module train.py"}, "--module runs")
    accepted("08.hostfile_command", {"hostfile": hostfile, "command": "deepspeed \\\n  --hostfile hostfile \\\n"
                                     "  --include worker-0:0,1@worker-1 \\\n  --master_port 29600 \\\n  train.py"})
    accepted("08.hostfile_command", {"hostfile": "worker-0 slots=2\nworker-1 slots=4\n",
                                     "command": ".venv/bin/deepspeed --hostfile hf --master_port=29600 train.py "
                                                "--epochs 2  # the job"})


def test_hostfile_command_answers_run_through_deepspeeds_runner(monkeypatch, tmp_path):
    """Every registered wrong answer makes the real runner stop, or start ranks on other GPUs, another port or
    another script; every right answer the checker knows starts exactly the task's ranks."""
    wanted = {"worker-0": [0, 1], "worker-1": [0, 1, 2, 3]}
    for answer, words in exercises.get("08.hostfile_command").wrong:
        with monkeypatch.context() as patch:
            run = runner_would_run(patch, tmp_path, answer)
        assert isinstance(run, str) or (run["slots"], run["port"], run["script"]) != (wanted, 29600, "train.py"), \
            (answer, run)
    rights = (solution("08", "08.hostfile_command"), *ch08.OTHER_RIGHT_HOSTFILE_COMMANDS)
    for answer in rights:
        with monkeypatch.context() as patch:
            run = runner_would_run(patch, tmp_path, answer)
        assert not isinstance(run, str), (answer, run)
        assert (run["slots"], run["port"], run["script"]) == (wanted, 29600, "train.py"), (answer, run)
        assert "CUDA_VISIBLE_DEVICES" not in run["exports"]   # the runner does not pass it to the nodes


# ------------------------------------------------------------------------------------------------ 02.amp_clip

@pytest.fixture(scope="module")
def amp_case():
    """One drawn case (fixed seed), shared by the 02.amp_clip tests: each check then runs only the answer."""
    return ch02_amp_clip.amp_case(random.Random(2024))


@pytest.fixture
def fixed_amp_case(monkeypatch, amp_case):
    monkeypatch.setattr(ch02_amp_clip, "amp_case", lambda *a, **k: amp_case)
    return amp_case


def _forward(model, x, y):
    import torch

    with torch.amp.autocast(device_type="cpu", dtype=torch.float16):
        return torch.nn.functional.mse_loss(model(x).float(), y)


def clip_scaled_then_optimizer_step(model, optimizer, scaler, x, y, max_norm):
    """No unscale_, no scaler.step: the scaled gradients clipped straight to max_norm, then optimizer.step();
    torch's scaler.update() then finds no inf check and asserts."""
    import torch

    optimizer.zero_grad()
    scaler.scale(_forward(model, x, y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()


def clip_scaled_no_update(model, optimizer, scaler, x, y, max_norm):
    """The same without scaler.update(): clipping to max_norm hides the scale on ordinary steps (the same
    gradients as the reference's, to clip_grad_norm_'s 1e-6), and it steps on inf when the scaled gradients
    overflow."""
    import torch

    optimizer.zero_grad()
    scaler.scale(_forward(model, x, y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()


def unscaled_by_hand(model, optimizer, scaler, x, y, max_norm):
    """Divides the gradients by the scale itself instead of unscale_, then scaler.step: unscales them twice."""
    import torch

    optimizer.zero_grad()
    scaler.scale(_forward(model, x, y)).backward()
    for p in model.parameters():
        p.grad /= scaler.get_scale()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def zero_grad_last(model, optimizer, scaler, x, y, max_norm):
    """Right, written otherwise: zero_grad at the end, the parameters taken from the optimizer, no return."""
    import torch

    scaler.scale(_forward(model, x, y)).backward()
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, norm_type=2.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def skips_overflow_by_hand(model, optimizer, scaler, x, y, max_norm):
    """Right, written otherwise: model.zero_grad, the clipped norm checked, inf/nan gradients zeroed before
    scaler.step (which still skips: unscale_ noted the inf), the loss returned detached."""
    import torch

    model.zero_grad()
    loss = _forward(model, x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not torch.isfinite(total):
        optimizer.zero_grad()         # what the step would apply is inf/nan: let the scaler skip and back off
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


# What test_amp_clip_red_team and test_amp_clip_skipping_by_hand_is_right check, declared for
# tests/test_redteam_coverage.py (the configs and the command above are not coding exercises: it counts none of them).
REDTEAM = {
    "02.amp_clip": {
        "wrong": [(ch02_amp_clip.optimizer_step, "call scaler.step(optimizer), not optimizer.step()"),
                  (clip_scaled_then_optimizer_step,
                   "neither scaler.unscale_(optimizer) nor scaler.step(optimizer) ran"),
                  (clip_scaled_no_update, "the scaled gradients overflowed fp16 (inf)"),
                  (ch02_amp_clip.clip_scaled_step, "= max_norm / 65536"),
                  (unscaled_by_hand, "or you divided them by the scale yourself"),
                  (ch02_amp_clip.chapter_norm_step, "you clipped to 0.0001"),
                  (ch02_amp_clip.calls_the_reference_step, "the checker's own reference")],
        "right": [zero_grad_last, skips_overflow_by_hand],
        "hard_coded": [ch02_amp_clip.chapter_norm_step, ch02_amp_clip.calls_the_reference_step],
    },
}


def test_amp_clip_red_team(fixed_amp_case):
    refused("02.amp_clip", ch02_amp_clip.optimizer_step, "call scaler.step(optimizer), not optimizer.step()")
    refused("02.amp_clip", clip_scaled_then_optimizer_step,
            "neither scaler.unscale_(optimizer) nor scaler.step(optimizer) ran")
    refused("02.amp_clip", clip_scaled_no_update, "the scaled gradients overflowed fp16 (inf)")
    refused("02.amp_clip", ch02_amp_clip.clip_scaled_step, "= max_norm / 65536")
    refused("02.amp_clip", unscaled_by_hand, "or you divided them by the scale yourself")
    refused("02.amp_clip", ch02_amp_clip.chapter_norm_step, "you clipped to 0.0001")   # hard-coded max_norm
    refused("02.amp_clip", ch02_amp_clip.calls_the_reference_step, "the checker's own reference")
    accepted("02.amp_clip", solution("02", "02.amp_clip"))
    accepted("02.amp_clip", zero_grad_last)


def test_amp_clip_skipping_by_hand_is_right(fixed_amp_case):
    """Zeroing inf gradients before scaler.step still lets the scaler skip: unscale_ recorded the inf already."""
    accepted("02.amp_clip", skips_overflow_by_hand)


def test_amp_clip_mistakes_are_wrong_when_run(amp_case):
    """What each registered mistake does on the drawn case, measured on the gradients the optimizer applied: it
    steps on inf (optimizer.step), applies max_norm / scale (clipped while scaled), more than max_norm
    (unclipped), zeros (no scaling), the chapter's 1e-4; the reference skips the overflowing steps and applies
    max_norm. Every registered wrong answer is refused on this case."""
    case, want = amp_case
    steps, max_norm = want["steps"], case["max_norm"]
    assert [k for k, row in enumerate(steps) if not row["stepped"]] == case["overflow_steps"]
    assert math.isclose(steps[0]["norm"], max_norm, rel_tol=1e-2)
    assert all(row["norm"] <= max_norm * (1 + 1e-6) for row in steps if row["stepped"])
    run = {fn.__name__: ch02_amp_clip.run_steps(fn, case, starts=want["starts"])["steps"]
           for fn in ch02_amp_clip.KNOWN_MISTAKES}
    first = case["overflow_steps"][0]
    assert run["optimizer_step"][first]["stepped"] and not run["optimizer_step"][first]["finite"]
    assert math.isclose(run["clip_scaled_step"][0]["norm"], max_norm / 2**16, rel_tol=1e-3)
    assert run["unclipped_step"][0]["norm"] > 1.05 * max_norm
    assert run["no_scaler_step"][0]["zero"]
    assert math.isclose(run["chapter_norm_step"][0]["norm"], ch02_amp_clip.CHAPTER_MAX_NORM, rel_tol=2e-2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ch02_amp_clip, "amp_case", lambda *a, **k: amp_case)
        for answer, words in exercises.get("02.amp_clip").wrong:
            refused("02.amp_clip", answer, words)


def test_amp_cases_drawn_tell_every_mistake_apart():
    """On another draw too, every known mistake is named (the checker relies on its draw rules, not on a rerun)."""
    for seed in (7,):
        case, want = ch02_amp_clip.amp_case(random.Random(seed))
        for mistake in ch02_amp_clip.KNOWN_MISTAKES:
            got = ch02_amp_clip.run_steps(mistake, case, starts=want["starts"])
            assert ch02_amp_clip.diagnose(got, want, case), mistake.__name__
