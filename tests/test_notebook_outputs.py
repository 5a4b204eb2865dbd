"""Stored notebook outputs carry nothing a learner should not see: broken UTF-8, stray tracebacks, warnings,
linker errors, or a bare True/False left by a cell that ends in a function call."""
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# A cell whose traceback *is* the lesson says so with the tag nbconvert and nbval already honour.
TRACEBACK_TAG = "raises-exception"
PROBLEMS = (
    ("U+FFFD (broken UTF-8)", re.compile("\ufffd")),
    ("a traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("a WARNING log line", re.compile(r"WARNING")),
    ("a Python warning", re.compile(r"\b\w*Warning: ")),
    ("a linker error ('cannot find -l...')", re.compile(r"cannot find -l")),
    ("a bare True/False line", re.compile(r"^\s*(True|False)\s*$", re.M)),
)


def output_text(output):
    """The text of one stored output (stream text, text/plain of a result, or an error's name and traceback)."""
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") == "error":
        return "Traceback (most recent call last)\n" + "\n".join(output.get("traceback", []))
    data = output.get("data", {})
    return data.get("text/plain", "") if isinstance(data.get("text/plain", ""), str) else "".join(data["text/plain"])


def problems(path):
    """['notebook cell N: what was found: the line'] for every stored output that should not be there."""
    nb = nbformat.read(path, as_version=4)
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        for output in cell.get("outputs", []):
            text = output_text(output)
            for what, pattern in PROBLEMS:
                if what == "a traceback" and TRACEBACK_TAG in tags:
                    continue
                match = pattern.search(text)
                if match:
                    line = text[text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0].strip()
                    found.append(f"{path.name} cell {index}: {what}: {line[:120]!r}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_are_clean(path):
    found = problems(path)
    assert not found, "\n".join(found)


def test_the_scan_finds_each_problem(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("print(bytes([0xe4]).decode(errors='replace'))",
                                  outputs=[nbformat.v4.new_output("stream", name="stdout", text="\ufffd\n")]),
        nbformat.v4.new_code_cell("1 / 0", outputs=[nbformat.v4.new_output(
            "error", ename="ZeroDivisionError", evalue="division by zero", traceback=["ZeroDivisionError"])]),
        nbformat.v4.new_code_cell("import deepspeed", outputs=[nbformat.v4.new_output(
            "stream", name="stdout", text="[2026-01-01 00:00:00,000] [WARNING] [real_accelerator.py:1] CPU\n")]),
        nbformat.v4.new_code_cell("op.load()", outputs=[nbformat.v4.new_output(
            "stream", name="stderr", text="/usr/bin/ld: cannot find -laio: No such file or directory\n")]),
        nbformat.v4.new_code_cell("check(None)", outputs=[nbformat.v4.new_output(
            "execute_result", data={"text/plain": "False"}, execution_count=None)]),
        nbformat.v4.new_code_cell("warnings.warn('x')", outputs=[nbformat.v4.new_output(
            "stream", name="stderr", text="<stdin>:1: UserWarning: x\n")]),
        nbformat.v4.new_code_cell("1 / 0", metadata={"tags": [TRACEBACK_TAG]}, outputs=[nbformat.v4.new_output(
            "error", ename="ZeroDivisionError", evalue="division by zero", traceback=["ZeroDivisionError"])]),
        nbformat.v4.new_code_cell("print('a True story, no warnings')", outputs=[nbformat.v4.new_output(
            "stream", name="stdout", text="a True story: DeepSpeed warns nothing\nTrue = 1 == 1\n")]),
    ]
    path = tmp_path / "demo.ipynb"
    nbformat.write(nb, path)
    found = problems(path)
    assert [f.split(":")[0] for f in found] == [f"demo.ipynb cell {i}" for i in range(6)]
    assert [f.split(": ")[1] for f in found] == ["U+FFFD (broken UTF-8)", "a traceback", "a WARNING log line",
                                                 "a linker error ('cannot find -l...')", "a bare True/False line",
                                                 "a Python warning"]
