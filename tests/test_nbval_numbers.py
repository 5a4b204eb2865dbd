"""tests/nbval_numbers.py: stored notebook outputs hold on other machines, and the comparison stays strict."""
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import nbval_numbers as rule

ROOT = Path(__file__).resolve().parent.parent
EXACT = {"rtol": 0.0, "atol": 0.0, "integers": False}


def test_words_and_integers_are_exact_decimals_within_the_tolerance():
    tol = rule.tolerance({}, {})
    assert tol == rule.DEFAULT
    assert rule.match_text("loss 2.181 after 12 steps", "loss 2.180 after 12 steps", tol) == (True, [])
    assert not rule.match_text("loss 2.181 after 12 steps", "loss 2.181 after 13 steps", tol)[0]
    assert not rule.match_text("loss 2.181 after 12 steps", "loss 2.181 after 12 epochs", tol)[0]
    same, problems = rule.match_text("loss 2.181", "loss 2.281", tol)   # the second significant digit
    assert not same and "2.281 where 2.181 was stored" in problems[0] and "rtol 0.005" in problems[0]
    assert rule.match_text("bf16 weights: 5,525,760", "bf16 weights: 5,525,760", tol)[0]
    assert not rule.match_text("bf16 weights: 5,525,760", "bf16 weights: 5,525,761", tol)[0]
    assert rule.match_text("fp16  1.0e-08   3", "fp16  1.00e-08  3", tol)[0]   # columns re-padded
    assert rule.split("avx512_bf16 py311 0.19.8 ZeRO-3")[1] == ["0.19", "3"]  # names keep their digits


def test_the_printed_precision_counts_and_zero_is_exact():
    assert rule.half_unit("2.181") == pytest.approx(5e-4) and rule.half_unit("7.5e-09") == pytest.approx(5e-11)
    assert rule.half_unit("0") == rule.half_unit("0.0e+00") == 0 and rule.half_unit("0.000") == pytest.approx(5e-4)
    assert rule.match_text("loss 2.181", "loss 2.180", EXACT)[0]      # one printed unit apart: both round 2.1805
    assert not rule.match_text("loss 2.181", "loss 2.179", EXACT)[0]
    assert not rule.match_text("grads zero 0", "grads zero 4.77e-07", rule.DEFAULT)[0]
    assert rule.match_text("grads zero 0", "grads zero 4.77e-07", {**rule.DEFAULT, "atol": 1e-5})[0]


def test_cells_declare_their_own_tolerance_and_kernel_counts():
    notebook = {"dslab": {"tolerance": {"rtol": 1e-3}}}
    cell = {"dslab": {"tolerance": {"rtol": 0.05, "integers": True, "why": "held-out answers after training"}}}
    assert rule.tolerance(notebook, {}) == {**rule.DEFAULT, "rtol": 1e-3}
    assert rule.tolerance(notebook, cell) == {"rtol": 0.05, "atol": 0.0, "integers": True}
    assert rule.match_text("38/40 answers", "39/40 answers", rule.tolerance(notebook, cell))[0]
    assert not rule.match_text("38/40 answers", "39/40 answers", rule.tolerance(notebook, {}))[0]


def _loss_cell(path):
    """A stored chapter's first code cell that prints losses with 4 decimals: (notebook, cell)."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        if cell.cell_type == "code" and re.search(r"\b\d\.\d{4}\b", text) and "NBVAL_IGNORE" not in cell.source:
            return nb, cell
    raise AssertionError(f"no stored loss in {path.name}")


def _altered(outputs, change):
    """A copy of stored outputs with the first 4-decimal loss changed by change(value) -> new text."""
    outputs = copy.deepcopy(outputs)
    for output in outputs:
        if output.get("output_type") == "stream":
            text = "".join(output["text"])
            match = re.search(r"\b\d\.\d{4}\b", text)
            if match:
                output["text"] = text[:match.start()] + change(match.group()) + text[match.end():]
                return outputs, match.group()
    raise AssertionError("no loss in the outputs")


@pytest.mark.parametrize("chapter", ["01_distributed_basics", "04_zero"])
def test_a_stored_loss_changed_in_its_second_digit_fails_and_one_within_tolerance_passes(chapter):
    """On the stored outputs of a real chapter: what nbval then compares, through the same function."""
    nb, cell = _loss_cell(ROOT / "notebooks" / f"{chapter}.ipynb")
    tol = rule.tolerance(nb.metadata, cell.metadata)
    stored = cell.outputs
    far, loss = _altered(stored, lambda v: v[:2] + str((int(v[2]) + 1) % 10) + v[3:])   # 7.3851 -> 7.4851
    near, _ = _altered(stored, lambda v: f"{float(v) * (1 + tol['rtol'] / 2):.4f}")   # within the tolerance
    aligned, problems = rule.align(near, stored, tol)
    assert aligned == stored and problems == []
    aligned, problems = rule.align(far, stored, tol)
    assert aligned != stored and len(problems) == 1 and f"where {loss} was stored" in problems[0]


def _notebook(path, cells, recorded_on):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["dslab"] = {"recorded_on": recorded_on}
    for code, stored, metadata in cells:
        cell = nbformat.v4.new_code_cell(code, metadata=metadata)
        cell.execution_count = 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
        nb.cells.append(cell)
    nbformat.write(nb, path)


def test_nbval_compares_by_the_rule(tmp_path):
    """Real nbval runs (kernels) with the plugin: which cells pass and which fail, and why."""
    from dslab.env import accelerator_info

    here = accelerator_info()
    depends = {"dslab": {"depends_on": ["fp16_supported"]}}
    _notebook(tmp_path / "rule.ipynb", [
        ('print(f"loss {2.1804:.3f}")', "loss 2.181\n", {}),                      # Cell 0: rounding, passes
        ('print(f"loss {2.1804:.3f}")', "loss 2.281\n", {}),                      # Cell 1: 2nd digit, fails
        ('print("steps", 12)', "steps 13\n", {}),                                 # Cell 2: an integer, fails
        ('print("fp16 on this machine")', "no fp16 on this machine\n", depends),  # Cell 3: same facts: compared
    ], here)
    _notebook(tmp_path / "other_machine.ipynb", [
        ('print("fp16 on this machine")', "no fp16 on this machine\n", depends),  # recorded elsewhere: not compared
        ('print("steps", 12)', "steps 13\n", depends),
    ], {**here, "fp16_supported": not here["fp16_supported"]})
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "nbval_numbers", "--nbval", "-q", "-rf",
                          "-p", "no:cacheprovider", "rule.ipynb", "other_machine.ipynb"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    out = run.stdout
    failed = sorted(set(re.findall(r"FAILED (\S+::Cell \d)", out)))
    assert failed == ["rule.ipynb::Cell 1", "rule.ipynb::Cell 2", "rule.ipynb::Cell 3"], out[-3000:]
    assert "2.180 where 2.281 was stored" in out and "13" in out and "4 passed" not in out
    assert "3 failed, 3 passed" in out, out[-1500:]
