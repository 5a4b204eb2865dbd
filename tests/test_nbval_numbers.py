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
from dslab import course

ROOT = Path(__file__).resolve().parent.parent
EXACT = {"rtol": 0.0, "atol": 0.0, "counts": rule.EXACT_COUNTS}


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
    cell = {"dslab": {"tolerance": {"rtol": 0.05, "counts": {"atol": 2}, "why": "held-out answers after training"}}}
    assert rule.tolerance(notebook, {}) == {**rule.DEFAULT, "rtol": 1e-3}
    assert rule.tolerance(notebook, cell) == {"rtol": 0.05, "atol": 0.0, "counts": {"rtol": 0.0, "atol": 2.0}}
    declared = rule.tolerance(notebook, cell)
    assert rule.match_text("38/40 answers", "39/40 answers", declared)[0]
    assert rule.match_text("38/40 answers", "36/40 answers", declared)[0]       # the declared 2 answers...
    same, problems = rule.match_text("38/40 answers", "35/40 answers", declared)  # ...and not a third
    assert not same and "35 where 38 was stored: off by 3, allowed 2" in problems[0]
    assert not rule.match_text("38/40 answers", "39/40 answers", rule.tolerance(notebook, {}))[0]
    # a count tolerance leaves the decimals' rule as it was, and the decimals' leaves the counts exact
    assert not rule.match_text("loss 2.181, 38/40", "loss 2.381, 38/40", declared)[0]
    assert not rule.match_text("loss 2.181, 38/40", "loss 2.181, 39/40", {**declared, "counts": rule.EXACT_COUNTS})[0]
    with pytest.raises(ValueError, match="unknown tolerance keys"):
        rule.tolerance({}, {"dslab": {"tolerance": {"integers": True}}})


def test_noise_is_shown_as_the_bound_it_is_checked_against():
    """Two machines' rounding noise prints the same text; noise above the bound stops the cell, naming both."""
    from dslab import noise

    assert noise.bound(2.8e-09, 1e-5) == noise.bound(3.1e-09, 1e-5) == noise.bound(-3e-9, 1e-5) == "<= 1e-05"
    with pytest.raises(ValueError, match="2e-05 is above 1e-05"):
        noise.bound(2e-5, 1e-5)
    # what a stored value printed as noise did: a number no other machine reproduces, outside any sane tolerance
    assert not rule.match_text("rel. difference 2.8e-09", "rel. difference 3.1e-09", rule.DEFAULT)[0]


KERNEL_PATHS = ("native", "AVX512_CORE", "AVX2", "AMX")


def test_every_declared_tolerance_says_what_it_covers_and_where_it_was_measured():
    """A tolerance is a measurement: its why names the kernel paths the spread was measured on. Chapters that run in
    the frameworks' venvs (course.Chapter.framework_venvs: 14) are left out: their framework cells run in those venvs
    (make test-frameworks), not under the kit's kernel paths."""
    for chapter in course.CHAPTERS:
        if chapter.framework_venvs:
            continue
        path = ROOT / chapter.notebooks[0]
        nb = nbformat.read(path, as_version=4)
        declared = [("notebook", nb.metadata)] + [(f"cell {i}", c.metadata) for i, c in enumerate(nb.cells)]
        for where, metadata in declared:
            tol = metadata.get("dslab", {}).get("tolerance")
            if tol is None:
                continue
            rule.tolerance({}, {"dslab": {"tolerance": tol}})   # only known keys
            why = tol.get("why", "")
            missing = [p for p in KERNEL_PATHS if p not in why]
            assert not missing, f"{path.name} {where}: its why names no spread measured on {missing}: {why!r}"


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
    counts = {"dslab": {"tolerance": {"counts": {"atol": 1}, "why": "one answer may flip"}}}
    _notebook(tmp_path / "rule.ipynb", [
        ('print(f"loss {2.1804:.3f}")', "loss 2.181\n", {}),                      # Cell 0: rounding, passes
        ('print(f"loss {2.1804:.3f}")', "loss 2.281\n", {}),                      # Cell 1: 2nd digit, fails
        ('print("steps", 12)', "steps 13\n", {}),                                 # Cell 2: an integer, fails
        ('print("fp16 on this machine")', "no fp16 on this machine\n", depends),  # Cell 3: same facts: compared
        ('print("en 18/20")', "en 19/20\n", counts),                              # Cell 4: within counts, passes
        ('print("en 17/20")', "en 19/20\n", counts),                              # Cell 5: beyond them, fails
        ('from dslab import noise; print("diff", noise.bound(3.1e-9, 1e-6))',       # Cell 6: a noise bound, passes
         "diff <= 1e-06\n", {}),
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
    expected = ["rule.ipynb::Cell 1", "rule.ipynb::Cell 2", "rule.ipynb::Cell 3", "rule.ipynb::Cell 5"]
    assert failed == expected, out[-3000:]
    assert "2.180 where 2.281 was stored" in out and "13" in out and "17 where 19 was stored: off by 2" in out
    assert "4 failed, 5 passed" in out, out[-1500:]


def test_the_portable_run_takes_a_bf16_path_below_the_cpus_own(tmp_path):
    """AMX or AVX512-BF16: oneDNN capped at plain AVX-512; AVX-512 alone: capped at AVX2 (bf16 emulated); below
    that every cap gives the same bf16 result, so torch's plain kernels are the path that differs."""
    avx512 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert rule.portable_path(avx512 | {"avx512_bf16"}) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}   # an EPYC here
    assert rule.portable_path(avx512 | {"amx_bf16", "avx512_fp16"}) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert rule.portable_path(avx512) == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert rule.portable_path({"avx2", "fma"}) == rule.portable_path(set()) == {"ATEN_CPU_CAPABILITY": "default"}
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512f\n")
    assert rule.cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512f"} and rule.cpu_flags(tmp_path / "none") == set()
