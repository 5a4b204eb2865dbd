"""The deck builder (tools/slides.py), the decks in slides/ and the zh/en glossary."""
import ast
import importlib.machinery
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tools import slides, slides_html, slides_source

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = [f"{n:02d}" for n in range(9)]  # README's chapter table: 00 … 08


# ----------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------
def test_split_slides_ignores_separators_in_code_and_blank_slides():
    text = "# Title\n\n---\n\n## Two\n\n```bash\necho a\n---\necho b\n```\n---\n---\n## Three\n---\n"
    parts = slides_source.split_slides(text)
    assert len(parts) == 3
    assert parts[1].startswith("## Two") and "---\necho b" in parts[1]
    assert parts[2] == "## Three"


def test_parse_target_expressions_and_columns():
    module, node, cols = slides_source.parse_target('dslab.zero.memory:t(params=7.5e9, name="a|b") | stage, gb')
    assert (module, ast.unparse(node), cols) == ("dslab.zero.memory", "t(params=7500000000.0, name='a|b')", ["stage", "gb"])
    module, node, cols = slides_source.parse_target('dslab.plots:f(dslab.precision.formats.trace(steps=4), 2)["rows"][0]|name')
    assert ast.unparse(node) == "f(dslab.precision.formats.trace(steps=4), 2)['rows'][0]" and cols == ["name"]
    for bad in ("os:system", "dslab.plots", "dslab.plots:f(**k)",
                "dslab.plots:f(*a)", "dslab.plots:f()[k]", "dslab.plots:f(",
                "dslab.plots:f(x=1 + 2)", "dslab.plots:f()()", "dslab.plots:f()[0]()", "dslab.plots:[x for x in y]"):
        with pytest.raises(slides_source.SlideError):
            slides_source.parse_target(bad)


def test_evaluate_calls_names_and_subscripts(demo_module):
    def run(target):
        module, node, _ = slides_source.parse_target(target)
        return slides_source.evaluate(node, module)

    assert run("dslab._slides_demo:double(21)") == 42
    assert run("dslab._slides_demo:double(x=dslab._slides_demo.double(2))") == 8
    assert run("dslab._slides_demo:bars(n=2)[1][0]") == {"stage": 0, "bytes": 16000}
    assert run('dslab.exercises:same("A ", "a")') is True  # a real dslab module, by dotted path
    assert run("dslab._slides_demo:LIMIT") == 7 and run("dslab._slides_demo:TABLE[1]") == "b"  # constants
    assert run("dslab._slides_demo:double.__doc__") is None  # attributes of the module's own functions
    demo_module.os = __import__("os")
    with pytest.raises(slides_source.SlideError, match="os is not defined by"):
        run("dslab._slides_demo:os.system('true')")  # ...but not of what it imports
    # a repeated call is computed once, and each use gets its own copy
    demo_module.calls = 0
    first = run("dslab._slides_demo:fresh()")
    first.append("changed by a caller")
    assert run("dslab._slides_demo:fresh()") == [] and demo_module.calls == 1
    with pytest.raises(slides_source.Missing, match="no not_yet"):
        run("dslab._slides_demo:not_yet()")
    with pytest.raises(slides_source.Missing, match="dslab has no not_a_module"):
        run("dslab._slides_demo:double(dslab.not_a_module.f())")
    with pytest.raises(slides_source.SlideError, match="has no \\[9\\]"):
        run("dslab._slides_demo:bars()[1][9]")


def test_directives_found_outside_code_only():
    text = "## S\n![figure: cap](dslab.plots:f(a=1))\n```\n![table](dslab.x:g)\n```\n![terms](glossary: ZeRO)"
    assert slides_source.directives(text) == [("figure", "cap", "dslab.plots:f(a=1)"), ("terms", "", "glossary: ZeRO")]


def test_table_rows_accepts_the_usual_shapes():
    recs = [{"stage": 0, "gb": 1.5}, {"stage": 3, "gb": 0.25}]
    assert slides_html.table_rows(recs) == (["stage", "gb"], [[0, 1.5], [3, 0.25]])
    assert slides_html.table_rows({"stage": [0, 3], "gb": [1.5, 0.25]}) == (["stage", "gb"], [[0, 1.5], [3, 0.25]])
    assert slides_html.table_rows(recs, ["gb"]) == (["gb"], [[1.5], [0.25]])
    assert slides_html.table_rows({"a": 1, "b": 2}) == (["", ""], [["a", 1], ["b", 2]])
    assert slides_html.table_rows({"a": 1, "b": 2}, ["b"]) == (["", ""], [["b", 2]])
    assert slides_html.table_rows({"a": 1, "b": 2}, ["name", "value"]) == (["name", "value"], [["a", 1], ["b", 2]])
    assert slides_html.table_rows({"Block": ["o", "down"]}, ["class", "layers"]) == (["class", "layers"], [["Block", ["o", "down"]]])
    assert slides_html.table_rows(recs, ["stage", "gb:%"]) == (["stage", "gb (%)"], [[0, 150.0], [3, 25.0]])
    assert slides_html.table_rows([{"b": 3 * 2**30}], ["b:GiB"]) == (["b (GiB)"], [[3.0]])
    with pytest.raises(slides_source.SlideError, match="unknown unit"):
        slides_html.table_rows(recs, ["gb:TB"])
    with pytest.raises(slides_source.SlideError, match="no column"):
        slides_html.table_rows(recs, ["nope"])
    with pytest.raises(slides_source.SlideError):
        slides_html.table_rows(42)
    assert slides_html.format_cell(1234567) == "1,234,567" and slides_html.format_cell(0.123456) == "0.1235"
    assert slides_html.format_cell(3.4028234663852886e38) == "3.4e+38" and slides_html.format_cell(65504.0) == "65,504"


# ----------------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def demo_module(monkeypatch):
    """A stand-in content module (dslab._slides_demo) with a figure function and a failing one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mod = types.ModuleType("dslab._slides_demo")
    mod.__spec__ = importlib.machinery.ModuleSpec("dslab._slides_demo", None)

    def bars(n=3):
        fig, ax = plt.subplots(figsize=(4, 3))
        data = [{"stage": i, "bytes": 16 * 1000 // (i + 1)} for i in range(n)]
        ax.bar([d["stage"] for d in data], [d["bytes"] for d in data])
        return fig, data

    def broken():
        raise ValueError("world_size must be positive")

    def double(x):
        return 2 * x

    def fresh():
        mod.calls += 1
        return []

    for fn in (bars, broken, double, fresh):
        fn.__module__ = mod.__name__  # as if defined there
    mod.bars, mod.broken, mod.double, mod.LIMIT, mod.TABLE = bars, broken, double, 7, {1: "b"}
    mod.fresh, mod.calls = fresh, 0
    monkeypatch.setitem(sys.modules, "dslab._slides_demo", mod)
    return mod


def _write(tmp_path, text, name="42_demo.md"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_build_is_self_contained_and_counts_slides(tmp_path, demo_module):
    src = _write(tmp_path, "# 42 · Demo\n---\n## Fig\n![figure: bars](dslab._slides_demo:bars(n=4))\n---\n"
                           "## Table\n![table: numbers](dslab._slides_demo:bars(n=2) | bytes)\n---\n"
                           "## Terms\n![terms](glossary: ZeRO; gradient accumulation)\n")
    rep = slides.build_deck(src, tmp_path / "out", strict=True)
    html = rep.output.read_text(encoding="utf-8")
    assert rep.slides == 4 and not rep.pending
    assert 'data-slides="4"' in html and html.count('<section class="slide') == 4
    assert html.count("data:image/png;base64,") == 1
    assert "<td class=num>16,000</td>" in html and "<th class=num>bytes</th>" in html and "<th>stage</th>" not in html.replace("class=num", "")
    assert "零冗余优化器" in html and "梯度累积" in html
    # Nothing fetched at view time: no external scripts, styles, images or fonts.
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', html)
    assert "<link" not in html and "@import" not in html and "<script src" not in html


def test_build_is_reproducible(tmp_path, demo_module):
    src = _write(tmp_path, "# T\n---\n![figure](dslab._slides_demo:bars)\n")
    a = slides.build_deck(src, tmp_path / "a").output.read_bytes()
    b = slides.build_deck(src, tmp_path / "b").output.read_bytes()
    assert a == b


def test_missing_function_is_pending_unless_strict(tmp_path, demo_module):
    src = _write(tmp_path, "# T\n---\n## Later\n![figure: soon](dslab._slides_demo:not_written_yet)\n")
    rep = slides.build_deck(src, tmp_path / "out")
    assert rep.pending and rep.pending[0][0] == 2 and "not_written_yet" in rep.pending[0][2]
    assert 'class="pending"' in rep.output.read_text(encoding="utf-8")
    with pytest.raises(slides_source.SlideError, match="slide 2"):
        slides.build_deck(src, tmp_path / "out", strict=True)
    src2 = _write(tmp_path, "# T\n---\n![terms](glossary: no such term)\n", "43_t.md")
    with pytest.raises(slides_source.SlideError, match="no such term"):
        slides.build_deck(src2, tmp_path / "out", strict=True)


def test_failing_function_names_deck_and_slide(tmp_path, demo_module):
    src = _write(tmp_path, "# T\n---\n## ok\n---\n![figure](dslab._slides_demo:broken)\n")
    with pytest.raises(slides_source.SlideError, match=r"42_demo.md, slide 3: .*world_size must be positive"):
        slides.build_deck(src, tmp_path / "out")
    src = _write(tmp_path, "# T\n---\n![table](dslab._slides_demo:bars()[5])\n")
    with pytest.raises(slides_source.SlideError, match=r"slide 2: .*has no \[5\]"):
        slides.build_deck(src, tmp_path / "out")
    src = _write(tmp_path, "# T\n---\n![table](dslab._slides_demo:bars()[1][1] | bytes)\n")
    assert "<td class=num>8,000</td>" in slides.build_deck(src, tmp_path / "out").output.read_text()
    src = _write(tmp_path, "# T\n---\n![figure](dslab._slides_demo:double(2))\n")
    with pytest.raises(slides_source.SlideError, match="no matplotlib Figure"):
        slides.build_deck(src, tmp_path / "out")
    src = _write(tmp_path, "# T\n---\n![code](dslab._slides_demo:double(2))\n")
    with pytest.raises(slides_source.SlideError, match="shows a string"):
        slides.build_deck(src, tmp_path / "out")
    src = _write(tmp_path, '# T\n---\n![code: a <b>](dslab._slides_demo:double("a<"))\n')
    out = slides.build_deck(src, tmp_path / "out").output.read_text()
    assert '<pre class="wrap"><code>a&lt;a&lt;</code></pre><p class="caption">a &lt;b&gt;</p>' in out


def test_cli_build_and_list(tmp_path, demo_module, capsys):
    _write(tmp_path, "# 42 · Demo\n---\n## Two\n![figure](dslab._slides_demo:bars)\n")
    assert slides.main(["build", "--src", str(tmp_path), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "42_demo.html").exists()
    assert slides.main(["list", "--src", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "42_demo.md: 2 slides" in out and "figure dslab._slides_demo:bars" in out
    assert slides.main(["build", "--src", str(tmp_path / "empty")]) == 1


def test_runs_as_a_script_from_anywhere_and_is_not_a_dslab_command(tmp_path, capsys):
    """`python tools/slides.py` (no -m, any working directory) finds its sibling modules; `dslab slides` is gone."""
    _write(tmp_path, "# 42 · Demo\n---\n## Two\n![table](dslab.zero.memory:not_a_function)\n")
    script = ROOT / "tools" / "slides.py"
    ok = subprocess.run([sys.executable, str(script), "list", "--src", str(tmp_path)], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "42_demo.md: 2 slides" in ok.stdout and "slide 2: table dslab.zero.memory:not_a_function" in ok.stdout
    bad = subprocess.run([sys.executable, str(script), "check", "--src", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "not_a_function" in bad.stdout, bad.stdout + bad.stderr
    from dslab.cli import build_parser

    with pytest.raises(SystemExit):  # the learner's CLI, without the course tooling
        build_parser().parse_args(["slides", "build"])
    assert "invalid choice: 'slides'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# The course's decks
# ----------------------------------------------------------------------------------------------------
DECKS = slides_source.deck_paths()
SECTIONS = ["goals", "run it", "takeaways", "common mistakes"]  # headings every deck has


def test_every_chapter_has_a_deck():
    have = {p.name[:2] for p in DECKS}
    notebooks = {p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert set(CHAPTERS) | notebooks <= have, f"chapters without a deck: {sorted(set(CHAPTERS) | notebooks - have)}"
    for nb in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"):  # deck named after its notebook
        assert (ROOT / "slides" / f"{nb.stem}.md").exists(), f"no slides/{nb.stem}.md for {nb.name}"


@pytest.mark.parametrize("path", DECKS, ids=[p.stem for p in DECKS])
def test_deck_shape(path):
    deck = slides_source.load_deck(path)
    assert deck.title.startswith(path.name[:2]), "the title slide's heading starts with the chapter number"
    headings = [m.lower() for s in deck.slides for m in re.findall(r"^##\s+(.+)$", s, re.M)]
    for section in SECTIONS:
        assert any(h.startswith(section) for h in headings), f"{path.name}: no '## {section.title()}' slide"
    kinds = [k for s in deck.slides for k, _, _ in slides_source.directives(s)]
    assert {"figure", "table"} & set(kinds), f"{path.name}: no figure or table from the chapter's code"
    assert "terms" in kinds, f"{path.name}: no terms slide from the glossary"
    assert 6 <= len(deck.slides) <= 16


def test_every_deck_names_existing_functions_and_terms():
    """Every directive of the real decks parses and names functions and glossary terms that exist.

    Cheap (nothing runs); tests/browser/test_slides.py builds every deck strictly, running the code.
    """
    problems = [f"{p.name} slide {n}: {target}: {why}" for p in DECKS for n, target, why in slides_source.check_deck(p)]
    assert not problems, "\n".join(problems)


def test_check_finds_missing_names(tmp_path, demo_module):
    src = _write(tmp_path, "# T\n---\n![figure](dslab._slides_demo:bars(n=dslab._slides_demo.nope()))\n"
                           "![table](dslab.nowhere:f)\n![terms](glossary: ZeRO; zeroo)\n![table](dslab._slides_demo:bars)\n")
    found = slides_source.check_deck(src)
    assert [n for n, _, _ in found] == [2, 2, 2] and len(found) == 3
    assert "nope" in found[0][2] and "dslab.nowhere" in found[1][2] and "zeroo" in found[2][2]
    assert slides.main(["check", "--src", str(tmp_path)]) == 1


# ----------------------------------------------------------------------------------------------------
# Glossary
# ----------------------------------------------------------------------------------------------------
GLOSSARY_TERMS = ["ZeRO", "sharding", "gradient accumulation", "mixed precision", "offload",
                  "tensor parallelism", "self-cognition fine-tuning"]


def test_glossary_has_the_course_terms_once_each():
    rows = slides_source.load_glossary()
    expected_zh = {"ZeRO": "零冗余优化器", "sharding": "分片", "gradient accumulation": "梯度累积",
                   "mixed precision": "混合精度", "offload": "卸载", "tensor parallelism": "张量并行",
                   "self-cognition fine-tuning": "自我认知微调"}
    for term in GLOSSARY_TERMS:
        assert slides_source.glossary_lookup(term, rows)["zh"] == expected_zh[term]
    for key in ("en", "zh"):
        values = [r[key].lower() for r in rows]
        assert len(values) == len(set(values)), f"duplicate {key} terms in the glossary"
    preferred = [r["zh"] for r in rows]
    for r in rows:
        assert r["meaning"], f"{r['en']}: no meaning"
        for bad in r["avoid"]:
            assert not any(bad in p for p in preferred), f"avoided variant {bad!r} is part of a preferred term"


def _course_text():
    """(where, text) for the prose of the course: slides, docs, README, notebook Markdown cells."""
    for p in sorted((ROOT / "slides").glob("*.md")) + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        if p.name != "glossary.md" and p.exists():
            yield str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text(encoding="utf-8"))
        for i, cell in enumerate(nb.get("cells", [])):
            if cell.get("cell_type") == "markdown":
                yield f"{p.relative_to(ROOT)} cell {i}", "".join(cell.get("source", []))


def test_course_text_uses_the_glossary_terms():
    """No slide, doc or notebook text uses a Chinese variant the glossary says to avoid."""
    rows = slides_source.load_glossary()
    found = []
    for where, text in _course_text():
        for r in rows:
            for bad in r["avoid"]:
                if bad in text:
                    found.append(f"{where}: '{bad}' -> write '{r['zh']}' ({r['en']})")
    assert not found, "\n".join(found)


def test_readme_links_glossary_and_guide():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for p in ("docs/glossary.md", "docs/instructor_guide.md"):
        assert (ROOT / p).exists()
        assert f"]({p})" in readme, f"README.md does not link {p}"
