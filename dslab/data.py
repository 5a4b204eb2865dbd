"""Data for the course: jsonl loading with file:line errors, the bundled data sets, names and authors per
language, chat formatting with the prompt masked (IGNORE_INDEX), SFT and pretraining batches."""
import json
import random
from pathlib import Path

from dslab.messages import say

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS_DIR = DATA_DIR / "corpus"  # the pretraining text, train.txt and valid.txt (written by dslab.tiny.corpus)
DOC_SEPARATOR = "<|endoftext|>\n"  # one document ends with this line in the corpus files
IGNORE_INDEX = -100  # label value that torch's cross-entropy skips: prompt tokens and padding


class DataError(ValueError):
    """A data file or example that cannot be used; the message names the file and line."""


def load_jsonl(path, required_fields=()):
    """Rows of a JSON-lines file (blank lines skipped); a malformed line raises DataError naming file:line."""
    path = Path(path)
    if not path.exists():
        raise DataError(say("data.no_file", path=path))
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(say("data.not_json", where=where, msg=err.msg, column=err.colno)) from None
            if not isinstance(row, dict):
                raise DataError(say("data.not_object", where=where, kind=type(row).__name__))
            missing = [k for k in required_fields if row.get(k) is None]
            if missing:
                raise DataError(say("data.missing_field", where=where, missing=", ".join(repr(k) for k in missing),
                                    required=", ".join(required_fields), found=", ".join(row) or say("data.none")))
            rows.append(row)
    return rows


def for_language(value, lang):
    """A name or author for a text in `lang`: a str serves both languages; a (zh, en) pair, as in ms-swift, gives one each."""
    if isinstance(value, (tuple, list)):
        return value[0] if lang == "zh" else value[1]
    return value


def fill_placeholders(text, name, author, lang="en"):
    """Put the model's name and author into {name}/{author}; each may be a str or a (zh, en) pair."""
    return text.replace("{name}", for_language(name, lang)).replace("{author}", for_language(author, lang))


def name_pair(value, option="a name or author"):
    """A name or author as `fill_placeholders` and the scorers take it, from what a command line or a caller gives:
    None or a str stays as it is; a list of one value serves both languages; two are (Chinese, English).
    More raise DataError naming `option` (the flag they came from)."""
    if value is None or isinstance(value, str):
        return value
    values = list(value)
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return tuple(values)
    raise DataError(say("data.name_pair", option=option, values=" ".join(map(str, values))))


def read_corpus(path):
    """Documents of a corpus file (data/corpus/*.txt)."""
    text = Path(path).read_text(encoding="utf-8")
    return [d[:-1] if d.endswith("\n") else d for d in text.split(DOC_SEPARATOR) if d.strip()]


def general_sft(path=None, limit=None):
    """General everyday dialogue ({"messages", "lang"}) that keeps identity tuning from overwriting everything."""
    rows = load_jsonl(path or DATA_DIR / "general_sft.jsonl", ("messages",))
    return rows[:limit] if limit is not None else rows


def identity_eval(path=None):
    """Held-out identity questions (never trained on): [{"query", "lang", "asks"}]; asks is "name" or "author"."""
    rows = load_jsonl(path or DATA_DIR / "identity_eval.jsonl", ("query", "lang", "asks"))
    for r in rows:
        if r["asks"] not in ("name", "author") or r["lang"] not in ("en", "zh"):
            raise DataError(say("data.eval_question", path=path or DATA_DIR / "identity_eval.jsonl", query=r["query"],
                                lang=r["lang"], asks=r["asks"]))
    return rows


def eval_identities(path=None):
    """Identities for evaluating self-cognition tuning, none of them in the training data: [{"name", "author", "script"}].

    A (zh, en) pair is stored as a two-item list; a single string serves both languages."""
    rows = load_jsonl(path or DATA_DIR / "eval_identities.jsonl", ("name", "author"))
    return [{**r, "name": tuple(r["name"]) if isinstance(r["name"], list) else r["name"],
             "author": tuple(r["author"]) if isinstance(r["author"], list) else r["author"]} for r in rows]


def general_eval(path=None):
    """General questions whose answers must survive identity tuning: [{"query", "reference", "lang"}]."""
    return load_jsonl(path or DATA_DIR / "general_eval.jsonl", ("query", "reference", "lang"))


def chat_text(tokenizer, messages, add_generation_prompt=False):
    """The conversation rendered by the tokenizer's own chat template (a str)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def sft_example(tokenizer, messages, max_length=None):
    """Tokenize a chat for SFT: {"input_ids", "labels"}; only assistant answers (+ their end token) are supervised.

    The prompt text of each assistant turn is exactly what inference feeds the model
    (the template with add_generation_prompt=True), so training and generation see the same tokens.
    """
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id
    input_ids, labels, done = [], [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = chat_text(tokenizer, messages[:i], add_generation_prompt=True)
        full = chat_text(tokenizer, messages[: i + 1])
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError("the chat template does not render turns as a growing prefix; cannot mask prompts")
        prompt_ids = tokenizer.encode(prompt[len(done):], add_special_tokens=False)
        answer_ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)
        # Supervise the answer up to and including its end token; what follows it (a newline) is template.
        stop = answer_ids.index(end_id) + 1 if end_id in answer_ids else len(answer_ids)
        input_ids += prompt_ids + answer_ids
        labels += [IGNORE_INDEX] * len(prompt_ids) + answer_ids[:stop] + [IGNORE_INDEX] * (len(answer_ids) - stop)
        done = full
    if not input_ids:
        raise DataError(say("data.no_answer"))
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def collate(examples, pad_id):
    """Pad examples into a batch of tensors (input_ids, labels, attention_mask), right-padded."""
    import torch
    width = max(len(ex["input_ids"]) for ex in examples)
    batch = {"input_ids": torch.full((len(examples), width), pad_id, dtype=torch.long),
             "labels": torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long),
             "attention_mask": torch.zeros((len(examples), width), dtype=torch.long)}
    for row, ex in enumerate(examples):
        n = len(ex["input_ids"])
        batch["input_ids"][row, :n] = torch.tensor(ex["input_ids"])
        batch["labels"][row, :n] = torch.tensor(ex["labels"])
        batch["attention_mask"][row, :n] = 1
    return batch


def sft_batches(examples, micro_batch_size, pad_id, seed=0):
    """Endless iterator of collated SFT batches, reshuffled (seeded) every epoch."""
    r = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        r.shuffle(order)
        for start in range(0, len(order) - micro_batch_size + 1, micro_batch_size):
            yield collate([examples[i] for i in order[start:start + micro_batch_size]], pad_id)


def lm_blocks(tokenizer, documents, seq_len):
    """Pretraining blocks: documents tokenized, each followed by <|endoftext|>, concatenated, cut to seq_len.

    Returns a LongTensor [n_blocks, seq_len]; the tail shorter than one block is dropped.
    """
    import torch
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stream = []
    for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        stream += ids + [eot]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def block_batches(blocks, micro_batch_size, seed=0):
    """Endless iterator of {"input_ids", "labels"} pretraining batches, blocks reshuffled every epoch (seeded)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(blocks), generator=g)
        for start in range(0, len(order) - micro_batch_size + 1, micro_batch_size):
            x = blocks[order[start:start + micro_batch_size]]
            yield {"input_ids": x, "labels": x}  # the model shifts labels by one position itself
