"""Scoring self-cognition tuning so that it cannot be fooled, and the `dslab eval` command.

An identity answer counts only if it holds the *whole* string the question asks for — the name for "what is your
name?", the author for "who made you?" — in the question's language (the zh form of a (zh, en) pair for a Chinese
question), and no U+FFFD: a completion that contains one emitted bytes that do not form a character.
General answers count if they hold the reference answer, with the same U+FFFD rule.
"""
import json

from dslab.data import for_language

BROKEN_CHAR = "\ufffd"  # what decoding prints for byte tokens that do not form a UTF-8 character


def identity_hit(row, completion, name, author):
    """True if `completion` answers the identity question `row` ({"query", "lang", "asks"}) correctly."""
    target = for_language(name if row["asks"] == "name" else author, row["lang"])
    return BROKEN_CHAR not in completion and target in completion


def identity_accuracy(model, tokenizer, name, author, rows=None, max_new_tokens=48):
    """Share of held-out identity questions answered with the whole name or author asked for, and the rows.

    name, author: a str (both languages) or a (zh, en) pair, as `dslab sft --model-name/--model-author` take them.
    """
    from dslab import data
    from dslab.infer import generate
    rows = rows if rows is not None else data.identity_eval()
    answers = generate(model, tokenizer, [r["query"] for r in rows], max_new_tokens, chat=True)
    scored = [dict(r, completion=a, hit=identity_hit(r, a, name, author)) for r, a in zip(rows, answers)]
    return sum(r["hit"] for r in scored) / len(scored), scored


def general_accuracy(model, tokenizer, rows=None, max_new_tokens=32):
    """Share of general questions whose answer holds the reference answer (and no U+FFFD), and the rows."""
    from dslab import data
    from dslab.infer import generate
    rows = rows if rows is not None else data.general_eval()
    answers = generate(model, tokenizer, [r["query"] for r in rows], max_new_tokens, chat=True)
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
    from dslab.infer import generate
    return [{"prompt": p, "completion": c, "real": real_text(c)}
            for p, c in zip(prompts, generate(model, tokenizer, list(prompts), max_new_tokens))]


def by_language(rows):
    """{lang: (hits, total)} of scored rows."""
    out = {}
    for r in rows:
        hits, total = out.get(r["lang"], (0, 0))
        out[r["lang"]] = (hits + bool(r["hit"]), total + 1)
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------------
# `dslab eval`
# ----------------------------------------------------------------------------------------------------
def _cmd_eval(args):
    """Score a model (or base + adapter) on held-out identity questions and the general questions."""
    from dslab import data
    from dslab.infer import load_for_inference
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    name, author = _pair(args.model_name), _pair(args.model_author)
    rows = data.identity_eval(args.questions) if args.questions else None
    if args.lang:
        rows = [r for r in (rows or data.identity_eval()) if r["lang"] == args.lang]
    model, tokenizer = load_for_inference(args)
    identity, id_rows = identity_accuracy(model, tokenizer, name, author, rows)
    general, gen_rows = general_accuracy(model, tokenizer)
    if args.json:
        print(json.dumps({"identity": identity, "general": general, "identity_rows": id_rows,
                          "general_rows": gen_rows}, ensure_ascii=False, indent=1))
        return 0
    for r in id_rows:
        print(f"[{'ok' if r['hit'] else '--'}] ({r['lang']}, asks {r['asks']}) {r['query']}\n       {r['completion']}")
    per_lang = ", ".join(f"{lang} {h}/{n}" for lang, (h, n) in by_language(id_rows).items())
    print(f"identity: {identity:.0%} ({per_lang}); general: {general:.0%} "
          f"({sum(r['hit'] for r in gen_rows)}/{len(gen_rows)})")
    return 0


def _pair(values):
    """--model-name X, or --model-name ZH EN, as the str or (zh, en) pair the scorers take."""
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return tuple(values)
    raise SystemExit("error: give one value (both languages) or two (Chinese, then English)")


def add_commands(subparsers):
    """Register `dslab eval`."""
    from dslab.infer import add_model_arguments
    p = subparsers.add_parser("eval", help="score identity answers (whole name/author, per language) and general answers",
                              description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--model-name", nargs="+", required=True, help="the name expected: one, or zh then en")
    p.add_argument("--model-author", nargs="+", required=True, help="the author expected: one, or zh then en")
    p.add_argument("--questions", help="a .jsonl of {\"query\", \"lang\", \"asks\": \"name\"|\"author\"} "
                                       "(default: data/identity_eval.jsonl)")
    p.add_argument("--lang", choices=["en", "zh"], help="only the questions of this language")
    p.add_argument("--json", action="store_true", help="print every answer and the scores as JSON")
    p.set_defaults(func=_cmd_eval)

