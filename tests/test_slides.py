"""The deck builder (tools/slides.py), the decks in slides/ and the zh/en glossary."""
import ast
import builtins
import contextlib
import importlib
import importlib.machinery
import io
import json
import re
import shlex
import subprocess
import sys
import tokenize
import types
from functools import lru_cache
from pathlib import Path

import pytest

from tools import slides, slides_html, slides_source

ROOT = Path(__file__).resolve().parent.parent


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
ZH_DECKS = slides_source.deck_paths(slides_source.ZH_SLIDES_DIR)
ALL_DECKS = DECKS + ZH_DECKS


def deck_id(path):
    """'04_zero' for an English deck, 'zh/04_zero' for its Chinese twin."""
    return f"zh/{path.stem}" if path.parent.name == "zh" else path.stem


SECTIONS = ["goals", "run it", "takeaways", "common mistakes"]  # headings every deck has


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
    problems = [f"{deck_id(p)}.md slide {n}: {target}: {why}" for p in ALL_DECKS
                for n, target, why in slides_source.check_deck(p)]
    assert not problems, "\n".join(problems)


def test_check_finds_missing_names(tmp_path, demo_module):
    src = _write(tmp_path, "# T\n---\n![figure](dslab._slides_demo:bars(n=dslab._slides_demo.nope()))\n"
                           "![table](dslab.nowhere:f)\n![terms](glossary: ZeRO; zeroo)\n![table](dslab._slides_demo:bars)\n")
    found = slides_source.check_deck(src)
    assert [n for n, _, _ in found] == [2, 2, 2] and len(found) == 3
    assert "nope" in found[0][2] and "dslab.nowhere" in found[1][2] and "zeroo" in found[2][2]
    assert slides.main(["check", "--src", str(tmp_path)]) == 1


# ----------------------------------------------------------------------------------------------------
# The decks' code blocks and exercises, against the package and the chapters (minutes: test_course_manifest.py)
# ----------------------------------------------------------------------------------------------------
CHECKED_PACKAGES = ("dslab", "deepspeed", "torch")  # imports resolved for real (others: peft, transformers... not)
RUNNABLE_NAMES = {"json"}  # besides builtins, a block that uses only these (and its own names) runs in the test


def python_blocks(path):
    """(line of the block's first code line, code) for every ```python block of a deck."""
    lines, blocks, start, fence = path.read_text(encoding="utf-8").splitlines(), [], None, None
    for number, line in enumerate(lines, 1):
        m = re.match(r"\s*(```|~~~)\s*(\w*)", line)
        if m and fence is None:
            fence, start = m.group(1), number + 1 if m.group(2) == "python" else None
        elif m and line.strip() == fence:
            if start is not None:
                blocks.append((start, "\n".join(lines[start - 1:number - 1])))
            fence, start = None, None
    return blocks


def strip_magics(code):
    """IPython's lines (%%px, %magic, !shell) blanked: the rest parses as Python and keeps its line numbers."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())


def imported_names(tree):
    """{name bound: (module, attribute or None)} for the imports in a syntax tree."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                names[alias.asname or top] = (alias.name if alias.asname else top, None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
    return names


@lru_cache(maxsize=None)
def chapter_imports(stem):
    """{name: [(module, attribute)]} for the imports of the English chapter's code cells: what a deck of the chapter
    may use without importing it (the zh chapter runs the same code)."""
    notebook = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    found = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            try:
                tree = ast.parse(strip_magics("".join(cell["source"])))
            except SyntaxError:
                continue
            for name, target in imported_names(tree).items():
                found.setdefault(name, [])
                if target not in found[name]:
                    found[name].append(target)
    return found


@lru_cache(maxsize=None)
def dslab_module_names():
    """The last part of every dslab module's name (wire, step_bytes, lora, live ...)."""
    return frozenset(p.stem for p in (ROOT / "dslab").rglob("*.py") if p.stem != "__init__") \
        | frozenset(p.parent.name for p in (ROOT / "dslab").rglob("__init__.py"))


def resolve(module, attr=None):
    """What `import module` / `from module import attr` binds; LookupError saying what is missing."""
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError:
        raise LookupError(f"there is no module {module}") from None
    if attr is None or hasattr(obj, attr):
        return obj if attr is None else getattr(obj, attr)
    try:
        return importlib.import_module(f"{module}.{attr}")
    except ModuleNotFoundError:
        raise LookupError(f"{module} has no {attr}") from None


def resolve_chain(obj, where, attrs):
    """Follow attrs through modules and classes (an instance's attributes may be dynamic: the walk stops there)."""
    for attr in attrs:
        if not isinstance(obj, (types.ModuleType, type)):
            return
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif isinstance(obj, types.ModuleType):
            obj = resolve(obj.__name__, attr)
        else:
            raise LookupError(f"{where} has no {attr}")
        where = f"{where}.{attr}"


def check_code_block(code, chapter):
    """[(line in the block, problem)]: the block's imports and every `name.attr...` whose name is a module it or its
    chapter imports (from dslab, deepspeed, torch) must exist; a dslab module's name used without any import is a
    problem too (the deck names something the chapter does not have)."""
    tree = ast.parse(strip_magics(code))
    problems, own, outer = [], imported_names(tree), chapter_imports(chapter)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for module, attr in imported_names(ast.Module(body=[node], type_ignores=[])).values():
                if module.split(".")[0] in CHECKED_PACKAGES:
                    try:
                        resolve(module, attr)
                    except LookupError as exc:
                        problems.append((node.lineno, f"import: {exc}"))
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name) or not isinstance(node.ctx, ast.Load) or node.id in local:
            continue
        chain, top = [node.id], node
        while isinstance(parents.get(top), ast.Attribute):
            top = parents[top]
            chain.append(top.attr)
        named = ".".join(chain)
        bindings = [own[node.id]] if node.id in own else outer.get(node.id, [])
        if not bindings:
            if node.id in dslab_module_names() and len(chain) > 1:
                problems.append((node.lineno, f"{named}: {node.id} is imported neither in the block nor by "
                                              f"notebooks/{chapter}.ipynb"))
            continue
        errors = []
        for module, attr in bindings:
            if module.split(".")[0] not in CHECKED_PACKAGES:
                errors = []
                break
            try:
                resolve_chain(resolve(module, attr), f"{module}.{attr}" if attr else module, chain[1:])
                errors = []
                break
            except LookupError as exc:
                errors.append(str(exc))
        if errors:
            problems.append((node.lineno, f"{named}: {errors[0]}"))
    return problems


def runnable(code):
    """True for a block that needs nothing but builtins, json and its own names (no ranks, no model, no magics)."""
    if code != strip_magics(code):
        return False
    tree = ast.parse(code)
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)) \
        and used <= local | RUNNABLE_NAMES | set(dir(builtins))


def run_block(code):
    """Run a runnable block; every ds_config it defines (a dict with a batch or ZeRO key) must pass dslab's checker
    for the 2 ranks the chapters run on. [(line, problem)]."""
    from dslab.config import check

    namespace = {"json": json}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "<deck>", "exec"), namespace)
    problems = []
    for name, value in namespace.items():
        if isinstance(value, dict) and {"train_micro_batch_size_per_gpu", "train_batch_size",
                                        "zero_optimization"} & set(value):
            for problem in check.check_config(value, world_size=2):
                problems.append((1, f"{name}: {problem.problem}" + (f" ({problem.fix})" if problem.fix else "")))
    return problems


def deck_code_problems(path, chapter=None):
    """'deck:line: problem' for every python block of a deck: not Python, names that do not resolve, a runnable
    block that fails or defines a ds_config dslab's checker refuses."""
    chapter = chapter or path.stem
    where = deck_id(path) + ".md"
    found = []
    for start, code in python_blocks(path):
        try:
            problems = check_code_block(code, chapter)
        except SyntaxError as exc:
            found.append(f"{where}:{start + (exc.lineno or 1) - 1}: not Python ({exc.msg}); write `...` where code "
                         "is left out, as a value")
            continue
        if not problems and runnable(code):
            try:
                problems = run_block(code)
            except Exception as exc:  # noqa: BLE001  (any failure of the deck's own code)
                problems = [(1, f"running the block raised {type(exc).__name__}: {exc}")]
        found += [f"{where}:{start + line - 1}: {problem}" for line, problem in problems]
    return found


@pytest.mark.parametrize("path", ALL_DECKS, ids=[deck_id(p) for p in ALL_DECKS])
def test_deck_code_names_what_the_package_and_chapter_have(path):
    """Every python block of every deck (en and zh) parses; its imports and the attributes it reads from dslab,
    deepspeed and torch modules exist; a block that needs nothing else runs, and its ds_config passes the checker."""
    problems = deck_code_problems(path)
    assert not problems, "\n".join(problems)


def test_deck_code_check_names_a_renamed_function(tmp_path, monkeypatch):
    """A deck that names a function the package does not have (renamed, moved, never written) fails, naming the
    deck and line; so does an unparsable block, a dslab module the chapter never imports, and a bad ds_config."""
    from dslab.comm import wire

    deck = _write(tmp_path, "# 10 · Demo\n---\n## Run it\n\n```python\n%%px\nfrom dslab.comm import wire\n"
                            "before = wire.bytes_written()\n```\n", "10_communication.md")
    assert deck_code_problems(deck) == []
    monkeypatch.delattr(wire, "bytes_written")  # the function renamed in the package
    assert deck_code_problems(deck) == [
        "10_communication.md:8: wire.bytes_written: dslab.comm.wire has no bytes_written"]
    monkeypatch.undo()

    text = ("# 06 · Demo\n---\n```python\nfrom dslab import lora\nlora.merge(adapter_dir='a')\n```\n"
            "```python\nbefore = comm.bytes_written()\nstep_bytes.logged_messages({})\n```\n"
            "```python\nx = f(a=1, ...)\n```\n"
            "```python\nds_config = {'train_micro_batch_size_per_gpu': 2, 'zero_optimisation': {'stage': 2}}\n```\n"
            "```bash\nnot python: ignored\n```\n")
    found = deck_code_problems(_write(tmp_path, text, "06_merge_lora.md"))
    assert found[:2] == ["06_merge_lora.md:4: import: dslab has no lora",
                         "06_merge_lora.md:5: lora.merge: dslab has no lora"]
    assert found[2] == ("06_merge_lora.md:8: comm.bytes_written: comm is imported neither in the block nor by "
                        "notebooks/06_merge_lora.ipynb")
    assert found[3].startswith("06_merge_lora.md:9: step_bytes.logged_messages: step_bytes is imported neither")
    assert found[4].startswith("06_merge_lora.md:12: not Python")
    assert found[5].startswith("06_merge_lora.md:15: ds_config: unknown key 'zero_optimisation'")
    assert len(found) == 6
    # the chapter's own imports count: chapter 10 imports step_bytes, so a chapter 10 deck may use it unimported
    ok = _write(tmp_path, "# T\n```python\nstep_bytes.logged_messages({})\n```\n", "10_communication.md")
    assert deck_code_problems(ok) == []


def dslab_commands(path):
    """(line, argv) for every `dslab ...` command in a deck's bash blocks (continuation lines joined, comments cut)."""
    lines, found, fence, bash, start, logical = path.read_text(encoding="utf-8").splitlines(), [], None, False, 0, ""
    for number, line in enumerate(lines, 1):
        m = re.match(r"\s*(```|~~~)\s*(\w*)", line)
        if m and fence is None:
            fence, bash = m.group(1), m.group(2) in ("bash", "sh", "shell")
            continue
        if m and line.strip() == fence:
            fence = None
            continue
        if fence is None or not bash:
            continue
        start, logical = (start if logical else number), logical + line.rstrip().rstrip("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        words, logical = shlex.split(logical, comments=True), ""
        at = next((i for i, w in enumerate(words) if w == "dslab" or w.endswith("/dslab")), None)
        if at is not None and "..." not in words:
            found.append((start, words[at + 1:]))
    return found


@pytest.mark.parametrize("path", ALL_DECKS, ids=[deck_id(p) for p in ALL_DECKS])
def test_deck_dslab_commands_parse(path):
    """Every `dslab` command a deck shows is accepted by the dslab command's own parser (subcommands and flags that
    exist, values of the right kind); nothing runs."""
    from dslab.cli import build_parser

    problems = []
    for line, argv in dslab_commands(path):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(argv)
        except SystemExit:
            said = err.getvalue().strip().splitlines()[-1:] or ["refused"]
            problems.append(f"{deck_id(path)}.md:{line}: dslab {shlex.join(argv)}: {said[0]}")
    assert not problems, "\n".join(problems)


def test_deck_dslab_command_check_names_a_renamed_flag(tmp_path):
    """A flag the dslab command does not have (renamed, misspelt) fails, naming deck and line."""
    deck = _write(tmp_path, "# T\n```bash\nFOO=1 dslab estimate --params 7e9 --world-size 8 \\\n  --zero 2  # ok\n"
                            "dslab estimate --params 7e9 --zero 2 --world-sizes 8\n"
                            ".venv/bin/dslab env\ndslab sft ...\n```\n")
    assert dslab_commands(deck) == [(3, ["estimate", "--params", "7e9", "--world-size", "8", "--zero", "2"]),
                                    (5, ["estimate", "--params", "7e9", "--zero", "2", "--world-sizes", "8"]),
                                    (6, ["env"])]
    renamed = r"42_demo.md:5: dslab estimate .* --world-sizes 8: dslab: error: unrecognized arguments"
    with pytest.raises(AssertionError, match=renamed):
        test_deck_dslab_commands_parse(deck)


def code_tokens(code):
    """A block's code as the zh and en decks must share it: its IPython lines and Python tokens, without comments."""
    magics = [line.strip() for line in code.splitlines() if line.lstrip().startswith(("%", "!"))]
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    tokens = tokenize.generate_tokens(io.StringIO(strip_magics(code)).readline)
    return magics, [tok.string for tok in tokens if tok.type not in skip]


@pytest.mark.parametrize("path", DECKS, ids=[p.stem for p in DECKS])
def test_zh_deck_shows_the_same_code(path):
    """The zh deck's python blocks are the en deck's, comments aside (the Chinese edition runs the same code)."""
    zh = slides_source.ZH_SLIDES_DIR / path.name
    en_code = [code_tokens(code) for _, code in python_blocks(path)]
    zh_code = [code_tokens(code) for _, code in python_blocks(zh)]
    assert len(en_code) == len(zh_code), f"{path.name}: {len(en_code)} python blocks, zh/{path.name}: {len(zh_code)}"
    for n, (a, b) in enumerate(zip(en_code, zh_code), 1):
        assert a == b, f"{path.name}: python block {n} differs in zh/{path.name} (beyond its comments)"


def exercise_ids(text):
    """The exercise ids a notebook checks (`exercises.check("NN.name", ...)`)."""
    return set(re.findall(r'exercises\.check\(\s*\\?"(\d\d\.\w+)', text))


@pytest.mark.parametrize("path", ALL_DECKS, ids=[deck_id(p) for p in ALL_DECKS])
def test_deck_lists_the_chapters_exercises(path):
    """The exercises slide names exactly the exercises the chapter's notebook checks (and only ids that exist)."""
    from dslab import exercises

    notebook = ROOT / "notebooks" / ("zh" if path.parent.name == "zh" else "") / f"{path.stem}.ipynb"
    want = exercise_ids(notebook.read_text(encoding="utf-8"))
    listed = set(re.findall(r"\*\*(\d\d\.\w+)\*\*", path.read_text(encoding="utf-8")))
    assert listed == want, f"{deck_id(path)}.md lists {sorted(listed - want)} that the chapter does not check and " \
                           f"leaves out {sorted(want - listed)}"
    unknown = listed - set(exercises.registered())
    assert not unknown, f"{deck_id(path)}.md lists exercises dslab.exercises does not have: {sorted(unknown)}"


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
