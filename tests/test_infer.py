"""dslab.models.infer: greedy generation, chat prompts that stop at <|im_end|>, and the `dslab infer` command (dslab.cli.models)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslab.models import infer, loading

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def loaded():
    return loading.load_model(), loading.load_tokenizer()


def _dslab(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("DSLAB_MODEL", None)
    return subprocess.run([sys.executable, "-m", "dslab.cli", "infer", *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_greedy_is_deterministic_and_prompt_free(loaded):
    model, tokenizer = loaded
    first = infer.generate(model, tokenizer, ["Anna walked to the", "小明"], max_new_tokens=12)
    assert first == infer.generate(model, tokenizer, ["Anna walked to the", "小明"], max_new_tokens=12)
    assert not first[0].startswith("Anna walked")


def test_chat_generation_stops_at_end_of_turn(loaded):
    model, tokenizer = loaded
    prompt = infer.prompt_text(tokenizer, "Hello!", chat=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=60)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    assert new[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") and len(new) < 60
    [answer] = infer.generate(model, tokenizer, ["Hello!"], max_new_tokens=60, chat=True)
    assert answer and "<|im_end|>" not in answer and "<|im_start|>" not in answer


def test_no_chat_template_is_a_clear_error(loaded):
    _, tokenizer = loaded

    class Plain:
        chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        infer.prompt_text(Plain(), "hi", chat=True)
    assert infer.prompt_text(tokenizer, "hi", chat=False) == "hi"


def test_cli_json_output(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What color is a banana?"}) + "\n" + json.dumps({"query": "你好！"}) + "\n",
                       encoding="utf-8")
    out = _dslab("--prompt", "What sound does a cow make?", "--prompts-file", str(prompts), "--chat", "--json",
                 "--max-new-tokens", "16")
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout)
    assert [r["prompt"] for r in results] == ["What sound does a cow make?", "What color is a banana?", "你好！"]
    assert all(set(r) == {"prompt", "completion"} and isinstance(r["completion"], str) for r in results)
    assert "moo" in results[0]["completion"]  # the base model knows this one (data/general_eval.jsonl)


def test_cli_text_file_and_explicit_model_dir(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Anna walked to the\n\n小明\n", encoding="utf-8")
    out = _dslab("--model", str(loading.DEFAULT_MODEL_DIR), "--prompts-file", str(prompts), "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count(">>> ") == 2 and ">>> 小明" in out.stdout


def test_cli_without_prompts_fails_with_a_hint():
    out = _dslab()
    assert out.returncode == 2 and "--prompt" in out.stderr


def test_cli_bad_prompts_file_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(Exception, match=r"bad.jsonl:2:"):
        infer.read_prompts(prompts_file=str(bad))
