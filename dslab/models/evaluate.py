"""Scoring self-cognition tuning so that it cannot be fooled (`dslab eval` is in dslab.cli.models).

An identity answer counts only if it holds the *whole* string the question asks for — the name for "what is your
name?", the author for "who made you?" — in the question's language (the zh form of a (zh, en) pair for a Chinese
question), and no U+FFFD: a completion that contains one emitted bytes that do not form a character.
General answers count if they hold the reference answer, with the same U+FFFD rule.
"""
from dslab.data import for_language

BROKEN_CHAR = "\ufffd"  # what decoding prints for byte tokens that do not form a UTF-8 character


def identity_hit(row, completion, name, author):
    """True if `completion` answers the identity question `row` ({"query", "lang", "asks"}) correctly."""
    target = for_language(name if row["asks"] == "name" else author, row["lang"])
    return BROKEN_CHAR not in completion and target in completion


def identity_accuracy(model, tokenizer, name, author, rows=None, max_new_tokens=48, system=None):
    """Share of held-out identity questions answered with the whole name or author asked for, and the rows.

    name, author: a str (both languages) or a (zh, en) pair, as `dslab sft --model-name/--model-author` take them.
    system: a system message put before every question, as a chat template with a default system prompt does.
    """
    from dslab import data
    from dslab.models.infer import generate
    rows = rows if rows is not None else data.identity_eval()
    answers = generate(model, tokenizer, [r["query"] for r in rows], max_new_tokens, chat=True, system=system)
    scored = [dict(r, completion=a, hit=identity_hit(r, a, name, author)) for r, a in zip(rows, answers)]
    return sum(r["hit"] for r in scored) / len(scored), scored


def general_accuracy(model, tokenizer, rows=None, max_new_tokens=32, system=None):
    """Share of general questions whose answer holds the reference answer (and no U+FFFD), and the rows."""
    from dslab import data
    from dslab.models.infer import generate
    rows = rows if rows is not None else data.general_eval()
    answers = generate(model, tokenizer, [r["query"] for r in rows], max_new_tokens, chat=True, system=system)
    scored = [dict(r, completion=a, hit=BROKEN_CHAR not in a and r["reference"] in a) for r, a in zip(rows, answers)]
    return sum(r["hit"] for r in scored) / len(scored), scored


# Plain-text openings (no chat template) a base model should continue with real text, in both languages.
RAW_PROMPTS = ["Anna walked to the", "Once upon a time", "The weather today is", "我们今天去", "从前，小明", "今天天气"]


def real_text(completion, min_words=3, min_chars=4):
    """True if a continuation is real text: no U+FFFD and at least a few words (Latin) or characters (Chinese)."""
    if BROKEN_CHAR in completion:
        return False
    hanzi = sum("\u4e00" <= ch <= "\u9fff" for ch in completion)
    return hanzi >= min_chars or len(completion.split()) >= min_words


def continuations(model, tokenizer, prompts=RAW_PROMPTS, max_new_tokens=24):
    """[{"prompt", "completion", "real"}] for plain-text prompts, greedy."""
    from dslab.models.infer import generate
    return [{"prompt": p, "completion": c, "real": real_text(c)}
            for p, c in zip(prompts, generate(model, tokenizer, list(prompts), max_new_tokens))]


def by_language(rows):
    """{lang: (hits, total)} of scored rows."""
    out = {}
    for r in rows:
        hits, total = out.get(r["lang"], (0, 0))
        out[r["lang"]] = (hits + bool(r["hit"]), total + 1)
    return dict(sorted(out.items()))

