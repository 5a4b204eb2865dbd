"""How nbval compares a notebook's stored outputs with a new run: the words exactly, the numbers by one rule.

nbval alone compares outputs character for character, so a loss printed as 2.181 on the CPU that recorded it and
as 2.180 on another fails, though both machines are right. This plugin (loaded by the root conftest.py) gives
every notebook one rule, and keeps every check that matters strict:

- Text: exact, after tests/sanitize.cfg (runs of spaces count as one, so a table whose column widened by a digit
  still matches).
- Integers (no decimal point, no exponent): exact. Counts, bytes, shapes, parameter numbers, FLOPs, steps and
  token ids are the same on every machine, or something is wrong.
- Decimals (a decimal point or an exponent): floating results of kernels. A number matches its stored value when
  |new - stored| <= atol + rtol * |stored| + half a unit in the last printed digit of each (the print itself
  rounds: 2.1805 may be printed 2.180 or 2.181). By default rtol = 5e-3 and atol = 0 (DEFAULT below: why).
- Rounding noise (two computations that should agree, differing by 1e-9 here and 3e-9 there) is never printed as
  a value: a chapter prints the bound its assert checks (dslab.noise.bound), which every machine prints alike.
- Results of training (losses, accuracies, hit counts, perplexities, grad norms) follow the bf16 kernels, which
  oneDNN picks per CPU (AMX, AVX512-BF16, AVX-512, emulated on AVX2; ONEDNN_MAX_CPU_ISA caps it on one machine).
  A cell that prints them declares its tolerance, and why, in its metadata: "dslab": {"tolerance": {"rtol": ...,
  "atol": ..., "counts": {"rtol": ..., "atol": ...}, "why": "..."}} (a notebook may declare one for all its cells
  the same way). "counts" is the tolerance of the cell's integers (held-out answers right after training, weights
  that crossed a bf16 step): without it they stay exact. "why" names the spread measured across the kernel paths
  (tests/test_nbval_numbers.py checks that each names them), measured with this file run as a script.
- What the machine can do: a cell whose output depends on it (fp16 on this CPU, say) lists those facts in its
  metadata ("dslab": {"depends_on": ["fp16_supported"]}); the notebook's metadata keeps the recording machine's
  facts ("dslab": {"recorded_on": {...}}, dslab.env.accelerator_info()). On a machine whose facts differ, the
  cell still runs (its asserts hold everywhere) but its output is not compared.
A number outside its tolerance fails the cell as before, and the report says which number, by how much, and the
tolerance that applied.

Run as a script, it compares a stored notebook with executed copies (one per kernel path) and prints, for each
cell, the largest difference of its decimals and of its integers across them, and whether its tolerance allows it:
how the tolerances were measured (see README, "On another machine").
    python tests/nbval_numbers.py notebooks/05_lora_sft.ipynb /tmp/avx2/05_lora_sft.ipynb /tmp/amx/05_lora_sft.ipynb
With --portable-path it prints the environment of a kernel path below this CPU's own (`portable_path`).
"""
import copy
import json
import re
import sys
from decimal import Decimal
from pathlib import Path

# A number standing on its own: not the digits of a name (bf16, avx512, py311), not a version's tail.
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d+|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w])")
SPACES = re.compile(r"[ \t]+")
TEXT_FIELDS = ("text/plain",)  # the data fields besides stream text whose numbers are compared by the rule
# Losses, norms and rates after a few training steps differ in the 4th significant digit between kernel paths:
# outside the cells that declare their own tolerance, at most 6.1e-4 relative (chapter 11, oneDNN capped at
# AVX512_CORE and AVX2, and an AMX Xeon, against this AMD EPYC's native AVX512-BF16), and at most one unit in the
# last printed digit under ATEN_CPU_CAPABILITY=default. 5e-3 covers that; a number changed in its second significant
# digit (1 % or more) still fails. Integers are exact unless a cell declares "counts".
EXACT_COUNTS = {"rtol": 0.0, "atol": 0.0}
DEFAULT = {"rtol": 5e-3, "atol": 0.0, "counts": EXACT_COUNTS}


def is_decimal(token):
    """A kernel's floating result (has a decimal point or an exponent) rather than an integer."""
    return "." in token or "e" in token.lower()


def half_unit(token):
    """Half a unit in the last printed digit of a number: 2.181 -> 0.0005, 7.5e-09 -> 5e-11, 1098 -> 0.5.

    A zero printed as 0 or 0.0e+00 is exactly zero ("g" and "e" formats write anything else with an exponent);
    0.000 may be a rounded 0.0004."""
    value = Decimal(token.lstrip("+-"))
    if value == 0 and ("e" in token.lower() or not is_decimal(token)):
        return 0.0
    return 0.5 * 10.0 ** value.as_tuple().exponent


def split(text):
    """(words, numbers): the text between numbers (spaces collapsed) and the numbers, in order."""
    words, numbers, start = [], [], 0
    for match in NUMBER.finditer(text):
        words.append(SPACES.sub(" ", text[start:match.start()]))
        numbers.append(match.group())
        start = match.end()
    words.append(SPACES.sub(" ", text[start:]))
    return words, numbers


def number_problem(stored, new, tol):
    """None if `new` matches `stored` by the rule (`tol`: rtol, atol, counts), else what is wrong (in words)."""
    if stored == new:
        return None
    a, b = float(new), float(stored)
    if not (is_decimal(stored) or is_decimal(new)):   # integers: exact, or within the cell's declared counts
        counts = tol["counts"]
        allowed = counts["atol"] + counts["rtol"] * abs(b)
        if abs(a - b) <= allowed:
            return None
        if counts == EXACT_COUNTS:
            return f"{new} where {stored} was stored (integers are compared exactly)"
        return (f"{new} where {stored} was stored: off by {abs(a - b):g}, allowed {allowed:g} "
                f"(counts: rtol {counts['rtol']:g}, atol {counts['atol']:g})")
    allowed = tol["atol"] + tol["rtol"] * abs(b) + half_unit(stored) + half_unit(new)
    if abs(a - b) <= allowed:
        return None
    relative = abs(a - b) / abs(b) if b else float("inf")
    return (f"{new} where {stored} was stored: off by {abs(a - b):.3g} ({relative:.3g} relative), "
            f"allowed {allowed:.3g} (rtol {tol['rtol']:g}, atol {tol['atol']:g}, plus the printed precision)")


def match_text(stored, new, tol):
    """(matches, problems): whether `new` matches `stored` by the rule, and each number that does not."""
    if stored == new:
        return True, []
    stored_words, stored_numbers = split(stored)
    new_words, new_numbers = split(new)
    if stored_words != new_words:
        return False, []  # the words differ: nbval's own diff shows where
    problems = [p for p in (number_problem(s, n, tol) for s, n in zip(stored_numbers, new_numbers)) if p]
    return not problems, problems


def _text_slots(outputs):
    """{(kind, field): [(output, field path)]} for every text an output carries, in order."""
    slots = {}
    for output in outputs:
        if output.get("output_type") == "stream":
            slots.setdefault(("stream", output.get("name")), []).append((output, None))
        for field in TEXT_FIELDS:
            if field in output.get("data", {}):
                slots.setdefault((output.get("output_type"), field), []).append((output, field))
    return slots


def _get(output, field):
    value = output["text"] if field is None else output["data"][field]
    return "".join(value) if isinstance(value, list) else value


def _set(output, field, value):
    if field is None:
        output["text"] = value
    else:
        output["data"][field] = value


def align(new_outputs, stored_outputs, tol, sanitize=lambda s: s):
    """(outputs, problems): a copy of the new outputs in which every text that matches its stored text by the rule
    is replaced by the stored text (so nbval's exact comparison then passes), and the numbers that did not match."""
    new_outputs = copy.deepcopy(new_outputs)
    stored_slots, problems = _text_slots(stored_outputs), []
    for key, new_slots in _text_slots(new_outputs).items():
        for (new_output, field), (stored_output, stored_field) in zip(new_slots, stored_slots.get(key, [])):
            stored_text, new_text = sanitize(_get(stored_output, stored_field)), sanitize(_get(new_output, field))
            matches, why = match_text(stored_text, new_text, tol)
            if matches:
                _set(new_output, field, _get(stored_output, stored_field))
            problems += why
    return new_outputs, problems


def tolerance(notebook_metadata, cell_metadata):
    """{rtol, atol, counts: {rtol, atol}} for a cell: its own declaration, else its notebook's, else DEFAULT."""
    declared = {**DEFAULT, **notebook_metadata.get("dslab", {}).get("tolerance", {}),
                **cell_metadata.get("dslab", {}).get("tolerance", {})}
    unknown = set(declared) - {"rtol", "atol", "counts", "why"}
    if unknown:
        raise ValueError(f"unknown tolerance keys {sorted(unknown)}: a cell declares rtol, atol, counts and why")
    counts = {**EXACT_COUNTS, **declared["counts"]}
    return {"rtol": float(declared["rtol"]), "atol": float(declared["atol"]),
            "counts": {"rtol": float(counts["rtol"]), "atol": float(counts["atol"])}}


def facts_that_differ(notebook_metadata, cell_metadata, machine):
    """The facts this cell's output depends on whose value here differs from the recording machine's."""
    recorded = notebook_metadata.get("dslab", {}).get("recorded_on", {})
    return [f for f in cell_metadata.get("dslab", {}).get("depends_on", []) if recorded.get(f) != machine()[f]]


_machine = {}


def this_machine():
    """The facts of this machine a cell may depend on (dslab.env.accelerator_info, and which framework venvs are
    built: dslab.launch.frameworks.venv_facts), asked once."""
    if not _machine:
        from dslab.env import accelerator_info
        from dslab.launch.frameworks import venv_facts

        _machine.update(accelerator_info(), **venv_facts())
    return _machine


# --------------------------------------------------------------------------- the nbval hook


def compare(cell, test, ref, exact):
    """One cell's outputs by the rule above: `cell` and `exact` (nbval's own comparison) as
    dslab.compat.compare_nbval_outputs_by hands them over."""
    notebook = cell.notebook_metadata
    if facts_that_differ(notebook, cell.metadata, this_machine):
        return True  # the output shows what this machine can do; the cell's asserts still ran
    test, problems = align(test, ref, tolerance(notebook, cell.metadata), cell.sanitize)
    same = exact(test, ref)
    if not same and problems:
        cell.explain("numbers outside the declared tolerance (tests/nbval_numbers.py):\n  " + "\n  ".join(problems))
    return same


def install():
    """Make nbval compare by the rule above (called from the root conftest.py when nbval is loaded)."""
    from dslab.compat import compare_nbval_outputs_by

    compare_nbval_outputs_by(compare)


def pytest_configure(config):
    """Loaded as a plugin (`pytest -p nbval_numbers`, tests/ on the path): the same rule outside this repository."""
    install()


# --------------------------------------------------------------------------- measuring the spread


def differences(stored_path, new_path):
    """Each number of an executed copy that differs from the stored notebook, as a dict: code cell (nbval's
    number), stored, new, relative and absolute difference, and whether the cell's tolerance allows it."""
    import nbformat
    from nbval.plugin import coalesce_streams, get_sanitize_patterns

    stored, new = (nbformat.read(p, as_version=4) for p in (stored_path, new_path))
    patterns = get_sanitize_patterns((Path(__file__).parent / "sanitize.cfg").read_text())

    def sanitize(text):
        for regex, replace in patterns:
            text = re.sub(regex, replace, text)
        return text

    rows, code_cell = [], -1
    for a, b in zip(stored.cells, new.cells):
        if a.cell_type != "code":
            continue
        code_cell += 1
        if "NBVAL_IGNORE_OUTPUT" in a.source or facts_that_differ(stored.metadata, a.metadata, this_machine):
            continue
        tol = tolerance(stored.metadata, a.metadata)
        a_slots, b_slots = _text_slots(coalesce_streams(a.outputs)), _text_slots(coalesce_streams(b.outputs))
        for key, slots in a_slots.items():
            for (sa, fa), (sb, fb) in zip(slots, b_slots.get(key, [])):
                text_a, text_b = sanitize(_get(sa, fa)), sanitize(_get(sb, fb))
                # the whole text, or line by line where its words differ (a line reworded since, the rest measured)
                pairs = [(text_a, text_b)] if split(text_a)[0] == split(text_b)[0] else \
                    zip(text_a.splitlines(), text_b.splitlines())
                for line_a, line_b in pairs:
                    (wa, na), (wb, nb) = split(line_a), split(line_b)
                    if wa != wb:
                        rows.append({"cell": code_cell, "words differ": [x for x in zip(wa, wb) if x[0] != x[1]][:3]})
                        continue
                    for x, y in zip(na, nb):
                        if x != y:
                            fx, fy = float(x), float(y)
                            rows.append({"cell": code_cell, "stored": x, "new": y, "abs": abs(fx - fy),
                                         "rel": abs(fx - fy) / abs(fx) if fx else None,
                                         "allowed": number_problem(x, y, tol) is None})
    return rows


def spread(stored_path, run_paths):
    """Per code cell, across executed copies (one per kernel path): the largest relative difference of a decimal,
    the largest absolute and relative difference of an integer, whether every difference was allowed, and the runs
    whose words differ."""
    cells = {}
    for path in run_paths:
        for row in differences(stored_path, path):
            cell = cells.setdefault(row["cell"], {"decimal_rel": 0.0, "count_abs": 0.0, "count_rel": 0.0,
                                                  "allowed": True, "words_differ": []})
            if "words differ" in row:
                cell["words_differ"].append(str(path))
                continue
            if is_decimal(row["stored"]) or is_decimal(row["new"]):
                cell["decimal_rel"] = max(cell["decimal_rel"], row["rel"] if row["rel"] is not None else float("inf"))
            else:
                cell["count_abs"] = max(cell["count_abs"], row["abs"])
                cell["count_rel"] = max(cell["count_rel"], row["rel"] if row["rel"] is not None else float("inf"))
            cell["allowed"] = cell["allowed"] and row["allowed"]
    return dict(sorted(cells.items()))


# --------------------------------------------------------------------------- another kernel path on this machine


def portable_path(cpu_flags):
    """The environment that runs bf16 on a kernel path below this CPU's own (make test-notebooks-portable).

    oneDNN runs bf16 matmuls with the best instructions it finds (AMX, AVX512-BF16, AVX-512, emulated on AVX2) and
    ONEDNN_MAX_CPU_ISA caps it: a capped run computes what a lesser CPU would, nothing re-recorded. At AVX2 and
    below oneDNN emulates bf16 the same way (one result for AVX2, AVX and SSE41, measured), so on a CPU without
    AVX-512 the cap changes nothing: there torch's own plain kernels (ATEN_CPU_CAPABILITY=default) differ instead."""
    flags = set(cpu_flags)
    if flags & {"avx512_bf16", "amx_bf16"}:
        return {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    return {"ATEN_CPU_CAPABILITY": "default"}


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU's feature flags, as Linux lists them (none where there is no /proc/cpuinfo)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


if __name__ == "__main__":
    if sys.argv[1:] == ["--portable-path"]:   # for the Makefile: VAR=value words
        print(" ".join(f"{k}={v}" for k, v in portable_path(cpu_flags()).items()))
        sys.exit(0)
    for cell, found in spread(sys.argv[1], sys.argv[2:]).items():
        print(json.dumps({"cell": cell, **found}, ensure_ascii=False))
