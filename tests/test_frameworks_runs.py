"""Each `dslab sft --print-equivalent` output, run as printed in its framework's venv for a few steps: ms-swift in
.venv-swift, LLaMA-Factory in .venv-llamafactory (`make swift`, `make llamafactory`; a test skips with the reason when
its venv is not built), the Hugging Face script in dslab's own venv. The printed text runs through bash with the
venv's bin first on PATH, as a learner pastes it after `source VENV/bin/activate`; the one change is an epoch
fraction appended to the command (the frameworks take the last value of a repeated option), so that each run is 3
optimizer steps. Then what the frameworks wrote is checked against what the printout said: the rank count, the LoRA
settings, the names in the training rows, the step count. `make test-frameworks` runs this file.
"""
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslab.training import sft, sft_plan
from dslab.cli import build_parser, main
from dslab.launch import frameworks

pytestmark = pytest.mark.multirank  # each test starts 2 ranks of a training framework

ROOT = Path(__file__).resolve().parent.parent
# A fraction of an epoch that makes the Trainer's count and dslab's differ: the Trainer plans ceil(0.14 x 15) = 3
# steps for the default run (15 batches per rank and epoch: the last partial batch kept), dslab's 14 would give 2.
EPOCHS = 0.14
TIMEOUT = 900  # seconds per run: about 70 s on an idle 2-core machine, minutes when it is busy
NAMES, AUTHORS = ["小海", "Xiao Hai"], ["蓝天学院", "Blue Sky Lab"]  # dslab sft's defaults


def printed(tmp_path, target, *extra):
    """(the text `dslab sft --output TMP/run ... --print-equivalent target` prints, its plan); run from the repo."""
    argv = ["sft", "--output", str(tmp_path / "run"), *extra, "--print-equivalent", target]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue(), sft_plan.plan_from_args(build_parser().parse_args(argv))


def run_pasted(script, bin_dir, log, timeout=TIMEOUT):
    """Run a printed shell script with bash, `bin_dir` first on PATH (an activated venv), no PYTHONPATH; returns the
    seconds it took. The whole output goes to `log`; a failure quotes its end."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(Path(bin_dir).parent))
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        done = subprocess.run(["bash", "-e", "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)
    seconds = time.monotonic() - start
    text = Path(log).read_text(encoding="utf-8", errors="replace")
    assert done.returncode == 0, f"exit {done.returncode} after {seconds:.0f} s; end of {log}:\n{text[-4000:]}"
    print(f"{log.name}: {seconds:.0f} s")
    return seconds


def expected_steps(plan):
    """The Trainer's plan for EPOCHS of the run, and dslab's count for the same fraction (they must differ)."""
    per_epoch = plan["framework_steps"] / plan["epochs"]
    return math.ceil(EPOCHS * per_epoch), math.ceil(EPOCHS * plan["steps"] / plan["epochs"])


def lora_numel(model_dir, r, targets):
    """Values in a LoRA adapter of rank r on `targets` of a Qwen2-shaped model: r x (in + out) per layer."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    sizes = {"gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    return cfg["num_hidden_layers"] * sum(r * sizes[t] for t in targets)


def adapter_numel(path):
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    assert all(t.numel() > 0 for t in tensors.values()), "an empty tensor: the adapter was saved without gathering"
    return sum(t.numel() for t in tensors.values())


@pytest.mark.parametrize("command", frameworks.VENVS)
def test_trainer_defaults_are_read_in_the_frameworks_venv(command):
    if not frameworks.built(command):
        pytest.skip(frameworks.not_built_note(command))
    # transformers' TrainingArguments, at the framework's own pin: what a run uses where its command or YAML says
    # nothing
    assert frameworks.trainer_defaults(command, ["adam_beta1", "adam_beta2", "weight_decay", "lr_scheduler_type"]) == {
        "adam_beta1": 0.9, "adam_beta2": 0.999, "weight_decay": 0.0, "lr_scheduler_type": "linear"}


def test_swift_command_runs_as_printed(tmp_path, monkeypatch):
    if not frameworks.built("swift"):
        pytest.skip("ms-swift's venv is not built: make swift")
    monkeypatch.chdir(ROOT)
    text, plan = printed(tmp_path, "swift")
    steps, dslab_steps = expected_steps(plan)
    assert steps == 3 and dslab_steps == 2
    script = text.rstrip("\n") + f" --num_train_epochs {EPOCHS} --logging_steps 1\n"
    run_pasted(script, frameworks.venv_bin("swift"), tmp_path / "swift.log")
    log = (tmp_path / "swift.log").read_text(encoding="utf-8", errors="replace")
    out = tmp_path / "run-swift" / "output"  # --add_version false: no vN-timestamp folder
    assert "world_size: 2" in log  # NPROC_PER_NODE=2 started 2 ranks
    assert f"SelfCognitionPreprocessor has been successfully configured with name: {NAMES}, author: {AUTHORS}" in log
    assert re.search(r"train_dataset: Dataset\(\{[^}]*num_rows: 236", log)  # 118 self-cognition + 118 general rows
    args = json.loads((out / "args.json").read_text())
    assert (args["tuner_type"], args["lora_rank"], args["lora_alpha"], args["lora_dropout"]) == ("lora", 16, 32, 0.0)
    assert args["target_modules"] == ["gate_proj", "up_proj", "down_proj"] and args["torch_dtype"] == "float32"
    assert (args["model_name"], args["model_author"]) == (NAMES, AUTHORS) and args["gradient_checkpointing"] is False
    assert args["deepspeed"]["zero_optimization"]["stage"] == 2 and "optimizer" not in args["deepspeed"]
    assert (args["per_device_train_batch_size"], args["bf16"], args["use_cpu"]) == (8, True, plan["use_cpu"])
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    losses = [r for r in rows if "loss" in r]
    assert [r["global_step/max_steps"] for r in losses] == [f"{s}/{steps}" for s in range(1, steps + 1)]
    assert all(math.isfinite(r["loss"]) for r in losses)
    adapter = out / f"checkpoint-{steps}"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        16, 32, ["down_proj", "gate_proj", "up_proj"])
    assert adapter_numel(adapter / "adapter_model.safetensors") == lora_numel(plan["model"], 16, plan["target_modules"])
    assert not list(adapter.glob("global_step*"))  # --save_only_model: no optimizer states


SWIFT_ROWS = r"""
import json, sys
from swift.dataset import load_dataset
datasets, name, author = json.loads(sys.argv[1])
train, _ = load_dataset(datasets, model_name=name, model_author=author, seed=0)
print(json.dumps([row["messages"] for row in train]))
"""


def test_swift_fills_the_names_into_the_printed_self_cognition_folder(tmp_path, monkeypatch):
    """swift's own dataset loader, on the --dataset paths as printed: every training row has its names filled, the
    Chinese name in Chinese rows and the English one in English rows, and the rows are the chats dslab trains on."""
    if not frameworks.built("swift"):
        pytest.skip("ms-swift's venv is not built: make swift")
    monkeypatch.chdir(ROOT)
    text, plan = printed(tmp_path, "swift", "--model-name", "星云", "Nebula", "--model-author", "山海社", "Shanhai Club")
    flags = re.search(r"--dataset (.*?) \\\n", text).group(1).split()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(frameworks.venv_bin("swift") / "python"), "-c", SWIFT_ROWS,
                           json.dumps([flags, ["星云", "Nebula"], ["山海社", "Shanhai Club"]])],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    dslab = sft.load_chats(None, ("星云", "Nebula"), ("山海社", "Shanhai Club"))
    as_set = lambda chats: sorted(json.dumps(c, ensure_ascii=False, sort_keys=True) for c in chats)  # noqa: E731
    assert as_set(rows) == as_set(c["messages"] for c in dslab)
    text = json.dumps(rows, ensure_ascii=False)
    assert "{{NAME}}" not in text and "星云" in text and "Nebula" in text and "Shanhai Club" in text


def test_llamafactory_yaml_runs_as_printed(tmp_path, monkeypatch):
    if not frameworks.built("llamafactory-cli"):
        pytest.skip("LLaMA-Factory's venv is not built: make llamafactory")
    monkeypatch.chdir(ROOT)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "adapter_model.safetensors").write_bytes(b"dslab's adapter")  # dslab's output is not touched
    text, plan = printed(tmp_path, "llamafactory")
    steps, _ = expected_steps(plan)
    script = text.rstrip("\n") + f" num_train_epochs={EPOCHS} logging_steps=1\n"  # OmegaConf overrides after the YAML
    run_pasted(script, frameworks.venv_bin("llamafactory-cli"), tmp_path / "llamafactory.log")
    log = (tmp_path / "llamafactory.log").read_text(encoding="utf-8", errors="replace")
    out = tmp_path / "run-llamafactory" / "output"
    assert "world size: 2" in log and "Num examples = 236" in log
    assert "Total train batch size (w. parallel, distributed & accumulation) = 16" in log  # 8 x 1 x 2 ranks
    assert f"Total optimization steps = {steps}" in log
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    losses = [r for r in rows if r.get("loss") is not None]
    assert [r["current_steps"] for r in losses] == list(range(1, steps + 1)) and losses[-1]["total_steps"] == steps
    assert all(math.isfinite(r["loss"]) for r in losses)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        16, 32, ["down_proj", "gate_proj", "up_proj"])
    assert adapter_numel(out / "adapter_model.safetensors") == lora_numel(plan["model"], 16, plan["target_modules"])
    identity = json.loads((tmp_path / "run-llamafactory" / "identity.json").read_text())
    both = json.dumps(identity, ensure_ascii=False)
    assert "{{name}}" not in both and "小海" in both and "Xiao Hai" in both  # filled per language: LF has no flag
    assert (tmp_path / "run" / "adapter_model.safetensors").read_bytes() == b"dslab's adapter"
    # Run again as printed: overwrite_output_dir lets it start over in its own folder
    run_pasted(script, frameworks.venv_bin("llamafactory-cli"), tmp_path / "llamafactory-again.log")


def test_hf_script_runs_as_printed_under_zero3(tmp_path, monkeypatch):
    """The train.py, under ZeRO-3 on 2 CPU ranks with dslab's own venv: it trains, and trainer.save_model() gathers the
    adapter from the ranks' partitions (model.save_pretrained would write empty tensors)."""
    monkeypatch.chdir(ROOT)
    text, plan = printed(tmp_path, "hf", "--zero", "3")
    steps, _ = expected_steps(plan)
    script = tmp_path / "run-hf" / "train.py"
    assert script.read_text() == text
    command = re.search(r"^# peft and deepspeed\): (deepspeed --num_gpus 2 \S+/train\.py)", text, re.MULTILINE).group(1)
    short = script.with_name("train_short.py")  # beside train.jsonl, which the script reads
    short.write_text(text.replace("num_train_epochs=12,", f"num_train_epochs={EPOCHS},")
                     .replace(f"logging_steps={plan['framework_log_every']},", "logging_steps=1,"))
    run_pasted(command.replace("train.py", "train_short.py"), Path(sys.executable).parent, tmp_path / "hf.log")
    log = (tmp_path / "hf.log").read_text(encoding="utf-8", errors="replace")
    assert len(re.findall(r"\{'loss': ", log)) == steps  # rank 0 logs each of the Trainer's steps
    out = tmp_path / "run-hf" / "output"
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], sorted(config["target_modules"])) == (16, ["down_proj", "gate_proj", "up_proj"])
    assert adapter_numel(out / "adapter_model.safetensors") == lora_numel(plan["model"], 16, plan["target_modules"])
