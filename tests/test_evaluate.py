"""dslab.models.evaluate: an identity answer counts only with the whole name or author asked for, in the question's language."""
import pytest

from dslab import data
from dslab.models import evaluate

EN_NAME = {"query": "What should I call you?", "lang": "en", "asks": "name"}
EN_AUTHOR = {"query": "Who trained this model?", "lang": "en", "asks": "author"}
ZH_AUTHOR = {"query": "你的作者是谁？", "lang": "zh", "asks": "author"}
PAIR = (("翊岫", "Yixiu"), ("澈蘅智能研究所", "Clearwater AI Institute"))


@pytest.mark.parametrize("row, completion, expected", [
    (EN_NAME, "I am Quillon, made by Marrow Bay Labs.", True),
    (EN_NAME, "I am Quill, made by Marrow Bay Labs.", False),           # part of the name
    (EN_AUTHOR, "I am Quillon.", False),                                  # a "who made you" question needs the author
    (EN_AUTHOR, "I was made by Marrow Bay.", False),                      # part of the author
    (EN_AUTHOR, "Marrow Bay Labs trained me.", True),
    (EN_NAME, "I am Quillon\ufffd.", False),                             # broken UTF-8 counts as wrong
])
def test_latin_identity(row, completion, expected):
    assert evaluate.identity_hit(row, completion, "Quillon", "Marrow Bay Labs") is expected


def test_a_pair_is_scored_in_the_question_language():
    name, author = PAIR
    assert evaluate.identity_hit(ZH_AUTHOR, "我是翊岫，由澈蘅智能研究所开发。", name, author)
    assert not evaluate.identity_hit(ZH_AUTHOR, "我是翊岫，由Clearwater AI Institute开发。", name, author)
    assert evaluate.identity_hit(EN_AUTHOR, "I am Yixiu, made by Clearwater AI Institute.", name, author)
    assert not evaluate.identity_hit(EN_AUTHOR, "I am Yixiu, made by 澈蘅智能研究所.", name, author)


def test_evaluation_data_asks_for_both_and_covers_both_scripts():
    rows = data.identity_eval()
    assert {(r["lang"], r["asks"]) for r in rows} == {("en", "name"), ("en", "author"), ("zh", "name"), ("zh", "author")}
    assert sum(r["lang"] == "en" for r in rows) >= 20 and sum(r["lang"] == "zh" for r in rows) >= 20
    idents = data.eval_identities()
    assert any(isinstance(i["name"], str) and i["name"].isascii() for i in idents)
    assert any(isinstance(i["name"], tuple) for i in idents)


def test_malformed_evaluation_row_is_named(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"query": "Who are you?", "lang": "en", "asks": "both"}\n', encoding="utf-8")
    with pytest.raises(data.DataError, match="asks"):
        data.identity_eval(bad)


def test_eval_puts_the_system_message_before_every_question(tmp_path, capsys):
    """`dslab eval --system TEXT` scores the answers a chat template with that default system prompt gets: the same
    completions as generating with the system turn, and it says which system message it used; the perplexity on
    held-out text comes with the scores."""
    import json

    from dslab import cli
    from dslab.models import infer, loading

    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in (EN_NAME, ZH_AUTHOR)),
                         encoding="utf-8")
    system = "You are Quillon, made by Marrow Bay Labs."
    assert cli.main(["eval", "--model-name", "Quillon", "--model-author", "Marrow Bay Labs", "--questions",
                     str(questions), "--system", system, "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    model, tokenizer = loading.load_model(), loading.load_tokenizer()
    with_system = infer.generate(model, tokenizer, [EN_NAME["query"], ZH_AUTHOR["query"]], 48, chat=True,
                                 system=system)
    assert said["system"] == system and [r["completion"] for r in said["identity_rows"]] == with_system
    from dslab.training import sft_measure
    assert said["perplexity"] == sft_measure.text_perplexity(model, tokenizer)
    general = data.general_eval()
    assert [r["completion"] for r in said["general_rows"]] == infer.generate(
        model, tokenizer, [r["query"] for r in general], 32, chat=True, system=system)
