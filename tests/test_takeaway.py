"""The training script chapters 05 and 08 tell learners to take to a cluster runs copied alone: in an empty folder
outside the repository, with dslab unimportable, started by the real `deepspeed` launcher on 2 ranks as its docstring
says (`--deepspeed --deepspeed_config`), for an identity the kit never trains on, and the adapter it writes answers
held-out identity questions in both languages."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import data
from dslab.models import evaluate, loading
from dslab.training import sft

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = "dslab is not installed here (blocked by tests/test_takeaway.py)"


def _script(notebook="05_lora_sft.ipynb"):
    cells = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))["cells"]
    (source,) = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"
                 and "".join(c["source"]).startswith("%%writefile") and "train_sft.py" in "".join(c["source"])]
    return source.split("\n", 1)[1]


@pytest.fixture
def alone(tmp_path):
    """An empty folder holding only the script, the two data files, a copy of dslab-tiny and a ds_config; and a
    PYTHONPATH whose `dslab` raises ImportError, as on a machine without the course."""
    folder = tmp_path / "cluster"
    folder.mkdir()
    (folder / "train_sft.py").write_text(_script(), encoding="utf-8")
    for name in ("self_cognition.jsonl", "general_sft.jsonl"):
        shutil.copy(data.DATA_DIR / name, folder / name)
    shutil.copytree(loading.resolve_model(), folder / "model")
    steps = sft.total_steps(2 * 118, 2, 8, 1, 12)
    (folder / "ds_config.json").write_text(json.dumps(sft.deepspeed_config(2, 2, 8, 1, sft.default_lr(False), steps)))
    blocker = tmp_path / "blocker" / "dslab"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(f"raise ImportError({BLOCKED!r})\n")
    env = dict(os.environ, PYTHONPATH=str(blocker.parent), HF_HUB_OFFLINE="1")
    env.pop("DSLAB_MODEL", None)
    return folder, env


def test_the_blocker_hides_dslab(alone):
    folder, env = alone
    probe = subprocess.run([sys.executable, "-c", "import dslab"], cwd=folder, env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and BLOCKED in probe.stderr


def test_the_script_copied_alone_trains_a_new_identity_on_two_ranks(alone):
    folder, env = alone
    identity = data.eval_identities()[1]          # a (zh, en) pair, in no training file of the kit
    (name_zh, name_en), (author_zh, author_en) = identity["name"], identity["author"]
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", "2", "train_sft.py", "--deepspeed", "--deepspeed_config", "ds_config.json",
           "--model", "model", "--data", "self_cognition.jsonl", "--general", "general_sft.jsonl",
           "--name", name_zh, name_en, "--author", author_zh, author_en, "--output", "adapter"]
    run = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert sorted(p.name for p in folder.iterdir()) == ["adapter", "ds_config.json", "general_sft.jsonl", "model",
                                                         "self_cognition.jsonl", "train_sft.py"]   # nothing half-written
    log = json.loads((folder / "adapter" / "loss_log.json").read_text())
    assert len(log) == 168 and log[-1]["loss"] < log[0]["loss"] / 2

    model = loading.load_model(folder / "model", adapter=folder / "adapter")
    accuracy, rows = evaluate.identity_accuracy(model, loading.load_tokenizer(folder / "model"), identity["name"],
                                                identity["author"])
    for lang in ("en", "zh"):
        hits = [r["hit"] for r in rows if r["lang"] == lang]
        assert sum(hits) >= 0.8 * len(hits), (lang, [r["completion"] for r in rows if not r["hit"]])


def test_the_readmes_and_the_script_give_the_command_this_test_runs():
    """The launch line the READMEs show and the script's docstring states: the one tested above."""
    launch_line = "deepspeed --num_gpus 2 train_sft.py --deepspeed --deepspeed_config ds_config.json"
    assert launch_line in _script()
    for readme in ("README.md", "README.zh.md"):
        text = (ROOT / readme).read_text(encoding="utf-8")
        assert launch_line in text and "tests/test_takeaway.py" in text, readme


def _commands(text, start):
    """Every command line in `text` that starts with `start`, backslash continuations joined, split as a shell would."""
    lines = text.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in (ln.strip() for ln in lines) if line.startswith(start)]


def test_the_readmes_and_chapter_14_give_the_same_gpu_commands():
    """Qwen2-1.5B-Instruct on GPUs: the download and the take-away script's launch that chapter 14 prints (en and zh)
    are the ones both READMEs show, and the script declares every flag the launch gives it."""
    printed = {}
    for notebook in ("14_swift_and_llamafactory.ipynb", "zh/14_swift_and_llamafactory.ipynb"):
        cells = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))["cells"]
        printed[notebook] = "".join("".join(out.get("text", "")) for c in cells if c["cell_type"] == "code"
                                    for out in c["outputs"])
    shown = {readme: (ROOT / readme).read_text(encoding="utf-8") for readme in ("README.md", "README.zh.md")}
    for start in ("modelscope download --model Qwen/Qwen2-1.5B-Instruct",
                  "deepspeed --num_gpus 2 train_sft.py --deepspeed --deepspeed_config ds_config.json"):
        found = {where: [c for c in _commands(text, start) if "Qwen2-1.5B-Instruct" in c]
                 for where, text in {**printed, **shown}.items()}
        assert all(len(commands) == 1 for commands in found.values()), found
        assert len({tuple(commands[0]) for commands in found.values()}) == 1, found
    launch_words = found["README.md"][0]
    assert launch_words[launch_words.index("--model") + 1] == "Qwen2-1.5B-Instruct"
    declared = set(re.findall(r'add_argument\("(--\w+)"', _script())) | {"--deepspeed", "--deepspeed_config"}
    assert {w for w in launch_words[launch_words.index("train_sft.py"):] if w.startswith("--")} <= declared
