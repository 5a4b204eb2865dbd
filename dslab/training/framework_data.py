"""The kit's training data in the formats ms-swift and LLaMA-Factory read, and their training logs read back
(chapter 14, `dslab sft --print-equivalent`).

- ms-swift: data/swift/self-cognition/self_cognition.jsonl is the kit's self-cognition set in swift's own
  self-cognition format ({"query", "response", "tag": "zh"|"en"}, placeholders {{NAME}} and {{AUTHOR}}). swift
  fills them from --model_name/--model_author only for its registered `self-cognition` dataset: a local folder
  of that name is matched to it by name (swift/dataset/dataset_syntax.py, _get_matched_dataset_meta), so the
  folder keeps swift's self-cognition preprocessing.
- LLaMA-Factory has no such flags: its data/identity.json ({"instruction", "input", "output"}, {{name}} and
  {{author}}) is filled by hand before training; `write_llamafactory_data` does that, per language, and writes the
  dataset_info.json that names the files.
"""
import json
from pathlib import Path

from dslab import data, files

SWIFT_SELF_COGNITION = data.DATA_DIR / "swift" / "self-cognition"
SWIFT_PLACEHOLDERS = {"{name}": "{{NAME}}", "{author}": "{{AUTHOR}}"}
LLAMAFACTORY_PLACEHOLDERS = {"{name}": "{{name}}", "{author}": "{{author}}"}


def _swap(text, placeholders):
    for ours, theirs in placeholders.items():
        text = text.replace(ours, theirs)
    return text


def swift_self_cognition_rows(path=None):
    """The kit's self-cognition rows as swift's self-cognition dataset holds them."""
    rows = data.load_jsonl(path or data.DATA_DIR / "self_cognition.jsonl", ("query", "response"))
    return [{"query": _swap(r["query"], SWIFT_PLACEHOLDERS), "response": _swap(r["response"], SWIFT_PLACEHOLDERS),
             "tag": r.get("lang", "en")} for r in rows]


def write_swift_self_cognition(folder=SWIFT_SELF_COGNITION, source=None):
    """Write swift_self_cognition_rows into folder/self_cognition.jsonl (the folder must be named self-cognition)."""
    folder = Path(folder)
    if folder.name != "self-cognition":
        raise ValueError(f"{folder}: swift matches its self-cognition dataset by the folder's name; call it self-cognition")
    files.atomic_write_text(folder / "self_cognition.jsonl", "".join(
        json.dumps(r, ensure_ascii=False) + "\n" for r in swift_self_cognition_rows(source)))
    return folder


def llamafactory_identity_rows(name, author, path=None):
    """The kit's self-cognition rows in LLaMA-Factory's identity.json form, {name}/{author} filled per language
    (name, author: a str, or a (zh, en) pair as dslab and swift take them)."""
    name, author = data.name_pair(name), data.name_pair(author)
    rows = data.load_jsonl(path or data.DATA_DIR / "self_cognition.jsonl", ("query", "response"))
    return [{"instruction": data.fill_placeholders(r["query"], name, author, r.get("lang", "en")), "input": "",
             "output": data.fill_placeholders(r["response"], name, author, r.get("lang", "en"))} for r in rows]


SHAREGPT_MESSAGES = {"formatting": "sharegpt", "columns": {"messages": "messages"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant", "system_tag": "system"}}


def write_llamafactory_data(folder, name, author, general=None):
    """identity.json (names filled) and dataset_info.json in `folder`, naming two datasets: "identity" and
    "general" (the kit's general chats, or the jsonl `general`, read where it is). Returns the folder."""
    folder = Path(folder)
    rows = llamafactory_identity_rows(name, author)
    files.atomic_write_text(folder / "identity.json", json.dumps(rows, ensure_ascii=False, indent=1) + "\n")
    general = Path(general or data.DATA_DIR / "general_sft.jsonl").resolve()
    info = {"identity": {"file_name": "identity.json"}, "general": {"file_name": str(general), **SHAREGPT_MESSAGES}}
    files.atomic_write_text(folder / "dataset_info.json", json.dumps(info, indent=1) + "\n")
    return folder


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _number(value):
    """swift logs numbers as strings ('0.4215'); LLaMA-Factory as numbers."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def training_log(output_dir):
    """[{"step", "loss", "lr"}] of a swift or LLaMA-Factory run, from the log each writes in its output folder:
    swift's logging.jsonl ("global_step/max_steps": "5/180", "learning_rate"), LLaMA-Factory's trainer_log.jsonl
    ("current_steps", "lr"). The final summary line (no loss) is left out."""
    output_dir = Path(output_dir)
    if (output_dir / "logging.jsonl").exists():
        rows = [r for r in _jsonl(output_dir / "logging.jsonl") if "loss" in r]
        return [{"step": int(str(r["global_step/max_steps"]).split("/")[0]), "loss": _number(r["loss"]),
                 "lr": _number(r["learning_rate"])} for r in rows]
    if (output_dir / "trainer_log.jsonl").exists():
        rows = [r for r in _jsonl(output_dir / "trainer_log.jsonl") if r.get("loss") is not None]
        return [{"step": int(r["current_steps"]), "loss": _number(r["loss"]), "lr": _number(r["lr"])} for r in rows]
    raise FileNotFoundError(f"{output_dir}: neither swift's logging.jsonl nor LLaMA-Factory's trainer_log.jsonl is there")


def total_steps(output_dir):
    """The optimizer steps a swift or LLaMA-Factory run planned ("max_steps" / "total_steps" in its log)."""
    output_dir = Path(output_dir)
    if (output_dir / "logging.jsonl").exists():
        rows = [r for r in _jsonl(output_dir / "logging.jsonl") if "global_step/max_steps" in r]
        return int(str(rows[-1]["global_step/max_steps"]).split("/")[1])
    return int(_jsonl(output_dir / "trainer_log.jsonl")[-1]["total_steps"])
