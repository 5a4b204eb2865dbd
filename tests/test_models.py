"""dslab.models.loading: the committed dslab-tiny checkpoint and tokenizer load offline and behave as documented."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dslab.models import evaluate, infer, loading
from dslab.tiny import corpus
from dslab.tiny.tokenizer import SPECIAL_TOKENS

MODEL_DIR = loading.DEFAULT_MODEL_DIR
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    return loading.load_tokenizer()


@pytest.fixture(scope="module")
def model():
    return loading.load_model()


@pytest.mark.parametrize("text", [
    "Anna walked to the park in the morning.",
    "The capital of France is Paris. 2 plus 3 is 5.",
    "小明昨天去了图书馆，买了三本书。",
    "Mixed 中文 and English, with unseen words: Zyxqv 龘 🙂\n\ttabs",
])
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_compresses_both_languages(tokenizer):
    # a byte-level BPE that learned nothing would spend one token per byte
    for text in ["Anna walked to the park in the morning.", "小明昨天去了图书馆。"]:
        assert len(tokenizer.encode(text)) < len(text.encode("utf-8")) / 2.5


def test_special_tokens_and_chat_template(tokenizer):
    assert len(tokenizer) == loading.tiny_config().vocab_size
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "你好！"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == corpus.render_chat(messages) + "<|im_start|>assistant\n"
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    encoded = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    assert encoded == tokenizer.encode(text, add_special_tokens=False)
    assert encoded.count(ids["<|im_start|>"]) == 3


def test_checkpoint_files_size_and_safetensors_only():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".py"))]
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) <= 20 * 2 ** 20
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {0, 2} and generation["do_sample"] is False


def test_model_shape_matches_tiny_config(model):
    cfg, ref = model.config, loading.tiny_config()
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings"]:
        assert getattr(cfg, key) == getattr(ref, key), key
    assert cfg.model_type == "qwen2"
    assert 5e6 < loading.count_parameters(model) < 6e6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert next(model.parameters()).dtype == torch.float32


def test_loads_offline_in_a_fresh_process():
    code = ("from transformers import AutoModelForCausalLM, AutoTokenizer; import sys; p = sys.argv[1]; "
            "m = AutoModelForCausalLM.from_pretrained(p); t = AutoTokenizer.from_pretrained(p); "
            "print(type(m).__name__, len(t))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    out = subprocess.run([sys.executable, "-c", code, str(MODEL_DIR)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Qwen2ForCausalLM", str(loading.tiny_config().vocab_size)]


def test_resolve_model(monkeypatch):
    monkeypatch.delenv("DSLAB_MODEL", raising=False)
    assert loading.resolve_model() == str(MODEL_DIR)
    monkeypatch.setenv("DSLAB_MODEL", "Qwen/Qwen2-0.5B")
    assert loading.resolve_model() == "Qwen/Qwen2-0.5B"
    assert loading.resolve_model("some/dir") == "some/dir"


def test_tiny_config_overrides_and_seeded_build():
    cfg = loading.tiny_config(num_hidden_layers=2, hidden_size=128, intermediate_size=344)
    a, b = loading.build_model(cfg, seed=3), loading.build_model(cfg, seed=3)
    c = loading.build_model(cfg, seed=4)
    assert a.config.num_hidden_layers == 2
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert loading.count_parameters(a) < loading.count_parameters(loading.build_model(loading.tiny_config()))


def test_base_model_answers_simple_questions_in_both_languages(model, tokenizer):
    _, rows = evaluate.general_accuracy(model, tokenizer)
    for lang in ("en", "zh"):
        hits = [r["hit"] for r in rows if r["lang"] == lang]
        assert sum(hits) >= 3 and len(hits) == 6, (lang, [r["completion"] for r in rows if not r["hit"]])


def test_base_model_continues_plain_text(model, tokenizer):
    [text] = infer.generate(model, tokenizer, ["Anna walked to the"], max_new_tokens=16)
    words = text.split()
    assert len(words) >= 3 and all(w.isascii() for w in words)
    rows = evaluate.continuations(model, tokenizer)
    assert all(r["real"] for r in rows), [r for r in rows if not r["real"]]


def test_real_text_rule():
    assert evaluate.real_text("station in the spring.") and evaluate.real_text("去了图书馆。")
    assert not evaluate.real_text(".") and not evaluate.real_text("") and not evaluate.real_text("？")
    assert not evaluate.real_text("去了图书\ufffd馆。")


def test_build_base_smoke(tmp_path):
    """`dslab build-base` trains the tokenizer, runs real DeepSpeed steps and saves a loadable checkpoint."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", CI="1")
    cmd = [sys.executable, "-m", "dslab.cli", "build-base", "--output", str(tmp_path / "m"), "--steps", "3",
           "--max-docs", "300", "--quiet"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "valid perplexity" in out.stdout
    report = json.loads((tmp_path / "m" / "build_report.json").read_text())
    assert report["steps"] == 3 and len(report["loss_log"]) == 1
    assert report["valid_perplexity"] < report["vocab_size"]  # 3 steps already beat guessing
    built = loading.load_model(tmp_path / "m")   # 300 documents teach fewer merges: a smaller vocabulary
    expected = loading.build_model(loading.tiny_config(vocab_size=report["vocab_size"]))
    assert loading.count_parameters(built) == loading.count_parameters(expected)


def test_base_model_knows_the_general_evaluation_facts(model, tokenizer):
    """The retention set holds facts the base answers right, so identity tuning can be checked against it."""
    accuracy, rows = evaluate.general_accuracy(model, tokenizer)
    # 9 of 12 (data/README.md): a 5.5M model still mixes up a capital or a colour now and then
    assert accuracy >= 0.75, [r["completion"] for r in rows if not r["hit"]]


def test_base_model_has_a_default_identity(model, tokenizer):
    answers = infer.generate(model, tokenizer, ["Who are you?", "你是谁？"], max_new_tokens=32, chat=True)
    assert all(corpus.BASE_NAME in a for a in answers)
