"""dslab.messages: one catalogue in English and Chinese; the locale or --lang picks the language."""
import argparse
import ast
import json
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import messages
from dslab.config import check

ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")


def _fields(text):
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


@pytest.mark.parametrize("key", sorted(messages.CATALOGUE))
def test_every_message_has_both_languages_with_the_same_fields(key):
    entry = messages.CATALOGUE[key]
    assert set(entry) == set(messages.LANGUAGES), key
    # the same fields, except English's plural ending {s}, which Chinese does not need
    assert _fields(entry["zh"]) <= _fields(entry["en"]) and _fields(entry["en"]) - _fields(entry["zh"]) <= {"s"}, key


def test_every_key_the_code_says_exists_and_every_entry_is_used():
    said = set()
    for path in (ROOT / "dslab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "say" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                said.add(node.args[0].value)
    assert said - set(messages.CATALOGUE) == set(), "said but not in the catalogue"
    assert set(messages.CATALOGUE) - said == set(), "in the catalogue but never said"


@pytest.mark.parametrize("env,expected", [
    ({"LANG": "zh_CN.UTF-8"}, "zh"),
    ({"LANG": "en_US.UTF-8"}, "en"),
    ({"LC_ALL": "C.UTF-8", "LANG": "zh_CN.UTF-8"}, "en"),          # LC_ALL wins, as for any POSIX program
    ({"LC_MESSAGES": "zh_TW.UTF-8", "LANG": "en_US.UTF-8"}, "zh"),
    ({"LANG": "zh_CN.UTF-8", "DSLAB_LANG": "en"}, "en"),           # --lang / DSLAB_LANG wins over the locale
    ({}, "en"),
])
def test_the_language_follows_the_locale(monkeypatch, env, expected):
    for var in ("DSLAB_LANG", "LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert messages.language() == expected


def test_a_problem_is_explained_in_chinese(monkeypatch):
    monkeypatch.setenv("DSLAB_LANG", "zh")
    bad = {"train_micro_batch_size_per_gpu": "4", "zero_optimization": {"stage": 5}, "gradient_clippng": 1.0}
    problems = check.check_config(bad, world_size=2, device="any")
    assert [p.key for p in problems] == ["train_micro_batch_size_per_gpu", "gradient_clippng",
                                         "zero_optimization.stage"]
    for p in problems:
        assert CJK.search(p.problem) and CJK.search(p.fix), p
    assert "'gradient_clipping'" in problems[1].fix  # keys stay as they are written in a config
    assert "修改方法" in str(problems[0])


def _cli(args, **env):
    base = {k: v for k, v in __import__("os").environ.items() if k not in ("DSLAB_LANG", "LC_ALL", "LC_MESSAGES")}
    return subprocess.run([sys.executable, "-m", "dslab.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**base, **env}, timeout=300)


def test_config_check_speaks_chinese_in_a_chinese_locale(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2, "overlap_com": True},
                               "bf16": {"enabled": True}}))
    zh = _cli(["config", "check", str(bad), "--world-size", "2", "--device", "cpu"], LANG="zh_CN.UTF-8")
    assert zh.returncode == 1
    assert "2 个问题" in zh.stdout and "train_batch_size 16 != " in zh.stdout and "是不是想写" in zh.stdout, zh.stdout
    en = _cli(["--lang", "en", "config", "check", str(bad), "--world-size", "2", "--device", "cpu"],
              LANG="zh_CN.UTF-8")
    assert "2 problems" in en.stdout and "did you mean 'zero_optimization.overlap_comm'?" in en.stdout, en.stdout
    assert not CJK.search(en.stdout)


def test_the_async_io_note_names_what_uses_it_in_both_languages():
    """Written out in each language rather than filled in from dslab.env's English AIO_OP."""
    from dslab import env

    entry = messages.CATALOGUE["env.aio_use"]
    assert env.AIO_OP[2] in entry["en"] and "NVMe 卸载" in entry["zh"] and "检查点" in entry["zh"]


def _options_named(parser, option, path=()):
    """(command path, option) for every sub-command parser, at any depth, that defines `option` itself."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(path + (name,), option)] if option in sub._option_string_actions else []
                found += _options_named(sub, option, path + (name,))
    return found


def test_no_command_has_its_own_lang_option():
    """argparse copies a sub-command's defaults over the global options: a command with its own --lang would reset
    `dslab --lang zh COMMAND ...` to the locale's language (dslab eval's question filter is --question-lang)."""
    from dslab.cli import build_parser

    parser = build_parser()
    assert _options_named(parser, "--lang") == []
    args = parser.parse_args(["--lang", "zh", "eval", "--model-name", "小海", "--model-author", "蓝天学院",
                              "--question-lang", "en"])
    assert args.lang == "zh" and args.question_lang == "en"


def test_data_and_resume_errors_are_explained_in_chinese(monkeypatch, tmp_path):
    from dslab import data
    from dslab.models import checkpoints

    monkeypatch.setenv("DSLAB_LANG", "zh")
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"query": "你是谁？"}\n', encoding="utf-8")
    with pytest.raises(data.DataError, match=r"mine.jsonl:1：缺少字段 'response'"):
        data.load_jsonl(bad, ("query", "response"))
    with pytest.raises(checkpoints.CheckpointError, match="这里没有完整的检查点.*--save-every K"):
        checkpoints.find_checkpoints(tmp_path / "run")



def _refusals(tmp_path):
    """Errors a learner meets before any rank starts: a bad adapter, a missing data file, an impossible launch."""
    from dslab import launch
    from dslab.models import loading
    from dslab.training import sft

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    (tmp_path / "full" / "model.safetensors").write_bytes(b"")
    return {
        "no adapter directory": lambda: loading.read_adapter(tmp_path / "nowhere"),
        "a full model given as an adapter": lambda: loading.read_adapter(tmp_path / "full"),
        "no data file": lambda: sft.run(output=tmp_path / "out", data=str(tmp_path / "missing.jsonl")),
        "no ranks": lambda: launch.check_environment(0, None),
        "not a launcher command": lambda: launch.run_commands("python train.py"),
    }


def _raised_in(language, monkeypatch, refusal):
    monkeypatch.setenv("DSLAB_LANG", language)
    with pytest.raises((ValueError, RuntimeError)) as caught:
        refusal()
    return caught.value


@pytest.mark.parametrize("case", ["no adapter directory", "a full model given as an adapter", "no data file",
                                  "no ranks", "not a launcher command"])
def test_refusals_before_launch_speak_the_learners_language(tmp_path, monkeypatch, case):
    refusal = _refusals(tmp_path)[case]
    english, chinese = (_raised_in(language, monkeypatch, refusal) for language in ("en", "zh"))
    assert type(english) is type(chinese)
    assert not CJK.search(str(english)) and CJK.search(str(chinese)), (english, chinese)
    # paths, options, commands and numbers stay as typed: each quoted word, --option and number of the English is
    # in the Chinese too
    kept = set(re.findall(r"'[^']*'|--[\w-]+|\b\d+\b", str(english)))
    assert kept and all(word in str(chinese) for word in kept), kept
