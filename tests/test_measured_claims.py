"""A chapter says "measured" only where its run measures and asserts: every "measured" in a chapter's text (实测 in
the zh twin) is followed by a code cell that asserts. Goals, summaries and asides that speak of a measurement made
elsewhere word it as what it is ("section 6 asserts ...", "printed, not compared"), and a prediction or a sourced fact
is never worded as a measurement."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) + sorted((NOTEBOOKS / "zh").glob("[0-9][0-9]_*.ipynb"))
WORDS = {"en": re.compile(r"\bmeasured\b", re.IGNORECASE), "zh": re.compile("实测")}


def unbacked_claims(cells, word):
    """['cell N: ...the words around it...'] for each use of `word` in a text cell whose next code cell asserts
    nothing, with the asserts that back the others: ([unbacked], {cell: first assert line})."""
    unbacked, backed = [], {}
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        following = next(("".join(c["source"]) for c in cells[index + 1:] if c["cell_type"] == "code"), "")
        checks = [line.strip() for line in following.splitlines() if line.strip().startswith("assert")]
        for found in word.finditer(text):
            if checks:
                backed[index] = checks[0]
            else:
                around = " ".join(text[max(0, found.start() - 70):found.end() + 40].split())
                unbacked.append(f"cell {index}: ...{around}...")
    return unbacked, backed


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: f"{p.parent.name}/{p.stem}" if p.parent.name == "zh"
                         else p.stem)
def test_every_measured_claim_is_asserted_by_the_next_code_cell(path):
    word = WORDS["zh" if path.parent.name == "zh" else "en"]
    unbacked, _ = unbacked_claims(json.loads(path.read_text(encoding="utf-8"))["cells"], word)
    assert not unbacked, (f"{path.name}: 'measured' with no assert in the next code cell (assert it there, or say "
                          "where it is asserted, or word it as a prediction):\n" + "\n".join(unbacked))


def test_the_scan_tells_a_backed_claim_from_an_unbacked_one():
    def cell(kind, text):
        return {"cell_type": kind, "source": [text]}

    cells = [cell("markdown", "The bytes, measured:"), cell("code", "b = f()\nassert b == 16"),
             cell("markdown", "Speed is measured below."), cell("code", "print(speed())"),
             cell("markdown", "A formula predicts it."), cell("code", "x = 1")]
    unbacked, backed = unbacked_claims(cells, WORDS["en"])
    assert backed == {0: "assert b == 16"}
    assert unbacked == ["cell 2: ...Speed is measured below...."]
    assert unbacked_claims([cell("markdown", "这里实测了。"), cell("code", "pass")], WORDS["zh"])[0]
