"""dslab.tiny.tokenizer: every common Chinese character is one token, in the committed tokenizer and in a freshly trained one."""
import re

import pytest

from dslab import data
from dslab.models import loading
from dslab.tiny import tokenizer as tk


@pytest.fixture(scope="module")
def tokenizer():
    return loading.load_tokenizer()


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_gb2312_has_its_6763_characters():
    level1, level2 = tk.gb2312_hanzi(1), tk.gb2312_hanzi(2)
    assert (len(level1), len(level2)) == (3755, 3008)
    assert level1[0] == "啊" and "的" in level1 and "岚" in level2 and not set(level1) & set(level2)


def test_every_gb2312_and_kit_character_is_one_token(tokenizer):
    # eval_identities.jsonl holds a character outside GB2312 on purpose (to measure the byte-level path)
    kit_text = "".join(p.read_text(encoding="utf-8") for p in data.DATA_DIR.glob("*.jsonl")
                       if p.name != "eval_identities.jsonl")
    cover = tk.coverage(tokenizer, "".join(tk.gb2312_hanzi(1) + tk.gb2312_hanzi(2)) + kit_text)
    assert cover["chars"] >= 6763 and cover["split"] == "", cover["split"][:50]


@pytest.mark.parametrize("text", [
    "我是Quillon，由Marrow Bay Labs开发。",
    "I am 翊岫 (Yixiu), made by 澈蘅智能研究所.",
    "璟珩 is outside GB2312: 𠀋 and 🙂 still round-trip.\n\ttabs",
])
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_chinese_characters_never_merge_with_their_neighbours(tokenizer):
    # a Latin name inside a Chinese sentence keeps its own tokens, whatever character stands before it
    ids = tokenizer("由Marrow Bay Labs开发", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[0] == "由" and pieces[-2:] == ["开", "发"]
    assert "".join(pieces[1:-2]) == "Marrow Bay Labs"
    assert all(not re.search(tk.CJK_CHAR, p) or len(p) == 1 for p in pieces)


def test_characters_outside_the_set_still_encode_as_bytes(tokenizer):
    assert n_tokens(tokenizer, "璟") in (2, 3)   # not in GB2312: its UTF-8 bytes
    assert n_tokens(tokenizer, "岚") == 1        # GB2312 level 2


def test_small_vocabulary_is_refused_with_the_size_needed():
    with pytest.raises(ValueError, match="use at least"):
        tk.train_tokenizer(["你好，世界。Hello world."], vocab_size=2000)


def test_a_small_tokenizer_keeps_only_the_corpus_characters():
    tok = tk.train_tokenizer(["你好，世界。Hello world, hello again."] * 20, vocab_size=320, gb2312=False)
    assert n_tokens(tok, "你好世界") == 4 and tok.decode(tok("你好，世界。")["input_ids"]) == "你好，世界。"
    assert n_tokens(tok, "啊") == 3   # a character the corpus never had: three bytes
