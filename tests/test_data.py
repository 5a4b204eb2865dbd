"""dslab.data and dslab.tiny.corpus: file:line errors, placeholders, the committed data sets, label masking, collation."""
import json

import pytest

from dslab import data
from dslab.models import loading
from dslab.tiny import corpus
from dslab.training import sft

IGNORE = data.IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer():
    return loading.load_tokenizer(loading.DEFAULT_MODEL_DIR)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_broken_line_is_named_with_file_and_line(tmp_path):
    good = json.dumps({"query": "q", "response": "r"})
    path = _write(tmp_path / "broken.jsonl", [good] * 6 + ['{"query": "q", "response": "r"'] + [good])
    with pytest.raises(data.DataError) as err:
        data.load_jsonl(path, ("query", "response"))
    assert f"{path}:7:" in str(err.value)
    assert "not valid JSON" in str(err.value)


def test_missing_field_is_named(tmp_path):
    path = _write(tmp_path / "missing.jsonl", [json.dumps({"query": "q", "response": "r"}), json.dumps({"query": "q"})])
    with pytest.raises(data.DataError) as err:
        data.load_jsonl(path, ("query", "response"))
    message = str(err.value)
    assert f"{path}:2:" in message and "'response'" in message


def test_non_object_line_and_missing_file(tmp_path):
    path = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(data.DataError, match=r"list.jsonl:1: expected a JSON object"):
        data.load_jsonl(path)
    with pytest.raises(data.DataError, match="no such file"):
        data.load_jsonl(tmp_path / "absent.jsonl")


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path):
    path = _write(tmp_path / "gaps.jsonl", [json.dumps({"query": "a"}), "", "   ", "{oops"])
    with pytest.raises(data.DataError, match=r"gaps.jsonl:4:"):
        data.load_jsonl(path)


def test_fill_placeholders_str_and_language_pair():
    assert data.fill_placeholders("I am {name} by {author}.", "Nova", "Orion Lab") == "I am Nova by Orion Lab."
    pair = ("小诺", "Nova")
    assert data.fill_placeholders("我是{name}", pair, ("猎户座", "Orion"), lang="zh") == "我是小诺"
    assert data.fill_placeholders("I am {name}", pair, "x", lang="en") == "I am Nova"


def test_name_pair_takes_one_name_for_both_languages_or_a_zh_en_pair():
    assert data.name_pair("Nova") == data.name_pair(["Nova"]) == "Nova"
    assert data.name_pair(["小诺", "Nova"]) == ("小诺", "Nova") and data.name_pair(None) is None
    with pytest.raises(data.DataError, match="one value .* or two"):
        data.name_pair(["a", "b", "c"])


def test_self_cognition_data_is_bilingual_and_names_the_model():
    chats = sft.load_chats(None, "Nova", "Orion Lab", mix_general=0)  # data/self_cognition.jsonl, filled
    assert len(chats) >= 100
    assert {c["lang"] for c in chats} == {"en", "zh"}
    for c in chats:
        answer = c["messages"][1]["content"]
        assert "Nova" in answer and "{" not in answer
    raw = data.load_jsonl(data.DATA_DIR / "self_cognition.jsonl", ("query", "response", "lang"))
    assert sum("{author}" in r["response"] for r in raw) >= 100


def test_evaluation_questions_and_identities_are_held_out():
    from dslab.tiny import identities
    train_queries = {r["query"] for r in data.load_jsonl(data.DATA_DIR / "self_cognition.jsonl")}
    train_queries |= set(identities.EN_QUESTIONS + identities.ZH_QUESTIONS)
    held_out = data.identity_eval()
    assert 20 <= len(held_out) <= 60 and {r["lang"] for r in held_out} == {"en", "zh"}
    assert not train_queries & {r["query"] for r in held_out}
    pretraining = (corpus.CORPUS_DIR / "train.txt").read_text(encoding="utf-8")
    assert not [r["query"] for r in held_out if r["query"] in pretraining]
    for ident in data.eval_identities():   # names and authors the kit never trains on
        for value in (ident["name"], ident["author"]):
            for text in ([value] if isinstance(value, str) else value):
                assert text not in pretraining and text not in str(sft.DEFAULT_NAME + sft.DEFAULT_AUTHOR), text
    general_queries = {r["messages"][0]["content"] for r in data.general_sft()}
    assert not general_queries & {r["query"] for r in data.general_eval()}


def test_sft_example_masks_the_prompt(tokenizer):
    messages = [{"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "I am Nova, made by Orion Lab."}]
    ex = data.sft_example(tokenizer, messages)
    assert len(ex["input_ids"]) == len(ex["labels"])
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert ex["labels"][:n_prompt] == [IGNORE] * n_prompt
    supervised = [t for t in ex["labels"] if t != IGNORE]
    assert tokenizer.decode(supervised) == "I am Nova, made by Orion Lab.<|im_end|>"
    assert tokenizer.decode(ex["input_ids"]) == data.chat_text(tokenizer, messages)


def test_sft_example_supervises_every_assistant_turn(tokenizer):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}]
    ex = data.sft_example(tokenizer, messages)
    supervised = tokenizer.decode([t for t in ex["labels"] if t != IGNORE])
    assert supervised == "Hi!<|im_end|>2 plus 3 is 5.<|im_end|>"
    with pytest.raises(data.DataError, match="assistant"):
        data.sft_example(tokenizer, messages[:2])


def test_collate_pads_and_masks(tokenizer):
    a = {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}
    b = {"input_ids": [8], "labels": [8]}
    batch = data.collate([a, b], pad_id=tokenizer.pad_token_id)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, tokenizer.pad_token_id, tokenizer.pad_token_id]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_lm_blocks_end_documents_with_endoftext(tokenizer):
    blocks = data.lm_blocks(tokenizer, ["Anna walked to the park.", "小明去了图书馆。"], seq_len=4)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    flat = blocks.flatten().tolist()
    assert blocks.shape[1] == 4 and eot in flat
    assert tokenizer.decode(flat).startswith("Anna walked to the park.<|endoftext|>")


def test_corpus_is_deterministic_and_matches_the_committed_files():
    assert corpus.generate(50, seed=7) == corpus.generate(50, seed=7)
    assert corpus.generate(50, seed=7) != corpus.generate(50, seed=8)
    committed = corpus.read_corpus(corpus.CORPUS_DIR / "valid.txt")
    assert committed == corpus.generate(len(committed), seed=2)
    # chat documents use exactly the markup the tokenizer's chat template writes
    chats = [d for d in committed if d.startswith("<|im_start|>")]
    assert len(chats) > 100
    text = " ".join(committed)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text) and "the" in text.split()


def test_committed_corpus_is_small_and_broad():
    sizes = {p.name: p.stat().st_size for p in corpus.CORPUS_DIR.glob("*.txt")}
    assert set(sizes) == {"train.txt", "valid.txt"} and sum(sizes.values()) < 6e6
    assert len(corpus.EN_NAMES) >= 100 and len(corpus.ZH_NAMES) >= 80 and len(corpus.EN_CITIES) >= 60
