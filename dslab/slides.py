"""Build the workshop decks: slides/NN_topic.md (Markdown, `---` between slides) -> self-contained HTML.

A slide pulls live content from the kit with a directive on a line of its own:

    ![figure: caption](dslab.plots:zero_partition_map(world_size=4))        the Figure, as a PNG
    ![table: caption](dslab.memory:ladder(params=7.5e9, world_size=64) | setup, total:GB)
    ![table: caption](dslab.env:report()["features"] | name, available)      part of the data
    ![figure](dslab.plots:loss_scale_trace(dslab.precision.trace_grad_scaler()))   data -> plot
    ![code: caption](dslab.multinode:EXAMPLE_HOSTFILE)                      a string, as code
    ![terms](glossary: ZeRO; sharding)                                     rows of docs/glossary.md

The target is a small expression: calls of the module's functions (or of dotted dslab.* functions)
with literal arguments or other such calls, and literal `["key"]` subscripts; the names after `|` pick
(and convert: `total:GB`) the table's columns. A plot function returns (Figure, data); a table shows a
list of dicts, a dict of lists or a dict. So the decks show what the notebooks compute, regenerated on
every build. Each deck becomes one HTML file with its CSS, script and figures inline: it opens offline.
slides/README.md describes the format for deck authors.

    python -m dslab.slides build [DECK ...] [--strict] [--pdf]   (also: dslab slides build)
    python -m dslab.slides check [DECK ...]    every directive names a function / term that exists
"""
import argparse
import ast
import base64
import contextlib
import copy
import html
import importlib
import importlib.util
import inspect
import io
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLIDES_DIR = ROOT / "slides"
BUILD_DIR = SLIDES_DIR / "build"
GLOSSARY = ROOT / "docs" / "glossary.md"
WIDTH, HEIGHT = 1280, 720  # the slide canvas; the viewer scales it to the window
FIGURE_DPI = 144

# A directive line: ![kind: caption](target). The target runs to the last ")" on the line, so calls with
# parentheses need no escaping.
DIRECTIVE = re.compile(r"^!\[(?P<kind>figure|table|code|terms)\s*(?::\s*(?P<caption>[^\]]*))?\]\((?P<target>.*)\)\s*$")
SEPARATOR = re.compile(r"^---\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
CALL = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<call>[A-Za-z_]\w*.*)$", re.S)


class SlideError(RuntimeError):
    """A deck cannot be built; the message names the deck, the slide and what to fix."""


class Missing(LookupError):
    """A directive names a module, function or glossary term that does not exist (yet)."""


@dataclass
class Deck:
    """One parsed deck: its source file and the Markdown of each slide."""

    path: Path
    slides: list
    title: str = ""

    @property
    def name(self):
        return self.path.stem


@dataclass
class BuildReport:
    """What building one deck produced, and which directives could not be filled."""

    deck: str
    output: Path
    slides: int
    seconds: float
    pending: list = field(default_factory=list)  # (slide number, directive text, reason)


# ----------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------
def split_slides(text):
    """Split deck Markdown into slides at lines that are exactly `---` (not inside a code fence)."""
    slides, current, fence = [], [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
        if fence is None and SEPARATOR.match(line):
            slides.append("\n".join(current).strip("\n"))
            current = []
        else:
            current.append(line)
    slides.append("\n".join(current).strip("\n"))
    return [s for s in slides if s.strip()]  # a leading/trailing/doubled separator adds no blank slide


def load_deck(path):
    """Parse slides/NN_topic.md into a Deck; the title is the first slide's first `# ` heading."""
    path = Path(path)
    slides = split_slides(path.read_text(encoding="utf-8"))
    if not slides:
        raise SlideError(f"{path}: no slides (separate slides with a line `---`)")
    m = re.search(r"^#\s+(.+)$", slides[0], re.M)
    return Deck(path=path, slides=slides, title=m.group(1).strip() if m else path.stem)


def deck_paths(src=SLIDES_DIR, names=()):
    """The deck sources in src (NN_*.md, sorted), optionally only those whose stem starts with a name."""
    paths = sorted(p for p in Path(src).glob("[0-9][0-9]_*.md"))
    if names:
        paths = [p for p in paths if any(p.stem == n or p.stem.startswith(n) for n in names)]
    return paths


def directives(slide_text):
    """Every directive on a slide, as (kind, caption, target), in order (code fences skipped)."""
    found, fence = [], None
    for line in slide_text.splitlines():
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        d = DIRECTIVE.match(line.strip()) if fence is None else None
        if d:
            found.append((d.group("kind"), (d.group("caption") or "").strip(), d.group("target").strip()))
    return found


def parse_target(target):
    """'dslab.m:f(a=1)["rows"] | c1, c2' -> ('dslab.m', <parsed f(a=1)["rows"]>, ['c1', 'c2']).

    The expression may call functions of the module (bare names) or of any dslab module (dotted names,
    e.g. dslab.precision.trace_grad_scaler()), pass literals or such calls as arguments, and index the
    result with literal keys. Nothing else: a deck is content, not a script.
    """
    bar = target.rfind("|")
    tail = max(target.rfind(")"), target.rfind("]"))
    call, cols = (target[:bar], target[bar + 1:]) if bar > tail else (target, "")
    m = CALL.match(call.strip())
    if not m or not m.group("module").startswith("dslab"):
        raise SlideError(f"bad directive target {target!r}: write dslab.module:function(key=value), "
                         "optionally followed by [\"key\"] and | column, column")
    expr = m.group("call")
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        raise SlideError(f"bad expression {expr!r}: not valid Python") from None
    _check_expr(node, expr)
    # A bare function name means "call it": dslab.plots:f is dslab.plots:f(), and f["k"] is f()["k"].
    inner, parent = node, None
    while isinstance(inner, ast.Subscript):
        inner, parent = inner.value, inner
    if _dotted(inner):
        call = ast.Call(func=inner, args=[], keywords=[])
        call.auto = True  # called only if it is a function: a table can also show a module constant
        if parent is None:
            node = call
        else:
            parent.value = call
    columns = [c.strip() for c in cols.split(",") if c.strip()]
    return m.group("module"), node, columns


def _dotted(node):
    """'a.b.c' for Name/Attribute chains, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def _is_literal(node):
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _check_expr(node, expr):
    """Raise SlideError unless node is a literal, a (dslab) name, a call of one, or a literal subscript."""
    if _is_literal(node):
        return
    if isinstance(node, ast.Subscript):
        if not _is_literal(node.slice):
            raise SlideError(f"bad expression {expr!r}: subscripts must be literals, e.g. [\"rows\"] or [0]")
        return _check_expr(node.value, expr)
    if isinstance(node, ast.Call):
        if not _dotted(node.func) or any(isinstance(a, ast.Starred) for a in node.args) \
                or any(kw.arg is None for kw in node.keywords):
            raise SlideError(f"bad expression {expr!r}: call functions by name, without * or **")
        for a in list(node.args) + [kw.value for kw in node.keywords]:
            _check_expr(a, expr)
        return
    if _dotted(node):  # f, f.__doc__ (from the directive's module) or dslab.module.f
        return
    raise SlideError(f"bad expression {expr!r}: only literals, dslab functions, calls and [key] are allowed")


def _lookup(name, module_name):
    """A name from the directive's module (f, f.__doc__) or a dotted dslab.x.y name; Missing if not there.

    A name from the module must be something the module defines (not, say, its `os` import).
    """
    if not name.startswith("dslab."):
        first, *rest = name.split(".")
        obj = _lookup_in(module_name, [first], name)
        if not str(getattr(obj, "__module__", None) or "").startswith("dslab") \
                and not isinstance(obj, (str, int, float, dict, list, tuple)):
            raise SlideError(f"{name}: {first} is not defined by {module_name}")
        for attr in rest:
            if not hasattr(obj, attr):
                raise Missing(f"{module_name}.{name} does not exist")
            obj = getattr(obj, attr)
        return obj
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        prefix = ".".join(parts[:i])
        try:
            found = prefix in sys.modules or importlib.util.find_spec(prefix) is not None
        except ModuleNotFoundError:  # a prefix that is a module, not a package, has no submodules
            found = False
        if found:
            return _lookup_in(prefix, parts[i:], name)
    raise Missing(f"module {'.'.join(parts[:-1])} does not exist yet")


def _lookup_in(module_name, attrs, name):
    """module_name.attrs[0].attrs[1]...; Missing if the module or an attribute does not exist (yet)."""
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):  # the module itself (or its package) is absent
            raise Missing(f"module {module_name} does not exist yet") from None
        raise
    where = module_name
    for attr in attrs:
        if not hasattr(obj, attr):
            raise Missing(f"{where} has no {attr}" + (f" (looking up {name})" if where != module_name or len(attrs) > 1 else ""))
        obj, where = getattr(obj, attr), f"{where}.{attr}"
    return obj


_RESULTS = {}  # (id(function), call text) -> (function, result), for one build


def evaluate(node, module_name):
    """The value of a checked directive expression (see parse_target)."""
    if _is_literal(node):
        return ast.literal_eval(node)
    if isinstance(node, ast.Subscript):
        value, key = evaluate(node.value, module_name), ast.literal_eval(node.slice)
        try:
            return value[key]
        except (KeyError, IndexError, TypeError):
            raise SlideError(f"{ast.unparse(node.value)} has no [{key!r}]") from None
    if isinstance(node, ast.Call):
        func = evaluate(node.func, module_name)
        if getattr(node, "auto", False) and not callable(func):
            return func
        if not callable(func):
            raise SlideError(f"{ast.unparse(node.func)} is not a function")
        # Course functions are seeded and deterministic: the same call in another directive (say a table
        # and a figure of one experiment) reuses the result instead of running the experiment twice.
        # Each use gets its own deep copy, so a caller that changes it (attach_lora wraps a model in
        # place) cannot change what the next directive sees.
        key = (id(func), ast.unparse(node))
        if key in _RESULTS:
            return copy.deepcopy(_RESULTS[key][1])
        args = [evaluate(a, module_name) for a in node.args]
        kwargs = {kw.arg: evaluate(kw.value, module_name) for kw in node.keywords}
        try:
            result = func(*args, **kwargs)
        except Exception as exc:
            raise SlideError(f"{ast.unparse(node)} raised {type(exc).__name__}: {exc}") from exc
        try:
            _RESULTS[key] = (func, copy.deepcopy(result))  # holding func keeps its id from being reused
        except Exception:  # not copyable (an open file, a figure with a live canvas...): not cached
            pass
        return result
    return _lookup(_dotted(node), module_name)


# ----------------------------------------------------------------------------------------------------
# Glossary (docs/glossary.md is the single source of zh/en terms)
# ----------------------------------------------------------------------------------------------------
def load_glossary(path=GLOSSARY):
    """Rows of the glossary's term tables as dicts with keys en, zh, meaning, avoid (list)."""
    rows = []
    if not Path(path).exists():
        return rows
    header = None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        row = dict(zip(header, cells))
        if "english" not in row or "中文" not in row:
            continue
        avoid = row.get("avoid", "")
        rows.append({
            "en": _plain(row["english"]),
            "zh": _plain(row["中文"]),
            "meaning": row.get("meaning", ""),
            "avoid": [a.strip() for a in re.split(r"[;；、]", _plain(avoid)) if a.strip() and a.strip() != "—"],
        })
    return rows


def _plain(cell):
    """Markdown cell text without emphasis or code marks."""
    return re.sub(r"[*`]", "", cell).strip()


def glossary_lookup(term, rows):
    """The glossary row whose English term (or the part before a parenthesis) equals term, any case."""
    key = term.strip().lower()
    for row in rows:
        full = row["en"].lower()
        if key in (full, full.split(" (")[0].strip()):
            return row
    raise Missing(f"glossary term {term!r} is not in docs/glossary.md")


# ----------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------
def figure_html(fig, caption):
    """A matplotlib Figure as an inline PNG <figure>."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    # No Software/date metadata: the same figure gives the same bytes, so builds are reproducible.
    fig.savefig(buf, format="png", dpi=FIGURE_DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    cap = f"<figcaption>{_inline(caption)}</figcaption>" if caption else ""
    return f'<figure class="dsfig"><img alt="{html.escape(_plain(caption) or "figure")}" src="data:image/png;base64,{data}">{cap}</figure>'


def _fmt(v):
    """A table cell: thousands separators up to millions, then 3-digit scientific; 4 significant digits below."""
    if isinstance(v, bool) or v is None:
        return {None: "", True: "yes", False: "no"}[v]
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v) or "—"
    if isinstance(v, (int, float)) and abs(v) >= 1e7:
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "—"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


UNITS = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20, "KiB": 2**10, "%": 0.01}


def _unit_columns(columns):
    """['total:GB', 'setup'] -> (['total', 'setup'], {'total': 'GB'}): a unit divides the column's numbers."""
    names, units = [], {}
    for c in columns:
        name, _, unit = c.partition(":")
        if unit and unit not in UNITS:
            raise SlideError(f"unknown unit {unit!r} in column {c!r}; use one of {', '.join(UNITS)}")
        names.append(name.strip())
        if unit:
            units[name.strip()] = unit
    return names, units


def table_rows(data, columns=()):
    """(header, rows) from a list of dicts, a dict of lists, a dict of scalars or a list of lists.

    columns picks (and orders) columns; 'name:GB' (GiB, MB, MiB, KiB, %) also converts its numbers.
    """
    columns, units = _unit_columns(columns)
    header, rows = _table_rows(data, columns)
    for i, h in enumerate(header):
        if h in units:
            factor = UNITS[units[h]]
            header[i] = f"{h} ({units[h]})"
            for r in rows:
                if isinstance(r[i], (int, float)) and not isinstance(r[i], bool):
                    r[i] = r[i] / factor
    return header, rows


def _table_rows(data, columns):
    if hasattr(data, "to_dict"):  # a pandas DataFrame, if a chapter returns one
        data = data.to_dict(orient="records")
    if isinstance(data, dict) and len(columns) == 2 and not any(c in data for c in columns):
        return list(columns), [[k, v] for k, v in data.items()]  # two new names: key and value columns
    if isinstance(data, dict) and data and all(isinstance(v, (list, tuple)) for v in data.values()):
        keys = list(data)
        data = [dict(zip(keys, vals)) for vals in zip(*data.values())]  # a dict of columns
    if isinstance(data, dict):
        if columns and all(c in data for c in columns):  # pick these keys
            return ["", ""], [[k, data[k]] for k in columns]
        if columns:
            raise SlideError(f"no key(s) {[c for c in columns if c not in data]} in the data; keys are {list(data)}")
        return ["", ""], [[k, v] for k, v in data.items()]
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, dict) for r in data):
        header = list(columns) or list(dict.fromkeys(k for r in data for k in r))
        missing = [c for c in header if not any(c in r for r in data)]
        if missing:
            raise SlideError(f"no column(s) {missing} in the table data; columns are {list(data[0])}")
        return header, [[r.get(c) for c in header] for r in data]
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, (list, tuple)) for r in data):
        return list(columns) or [""] * len(data[0]), [list(r) for r in data]
    raise SlideError(f"cannot show {type(data).__name__} as a table: return a list of dicts or a dict")


def table_html(data, caption="", columns=()):
    """Data as an HTML table (numbers right-aligned)."""
    header, rows = table_rows(data, columns)
    out = ['<table class="dstable">']
    if any(header):
        numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows)
                   for i in range(len(header))]  # right-align the heading of a numbers column
        out.append("<thead><tr>" + "".join(f'<th{" class=num" if num else ""}>{html.escape(str(h))}</th>'
                                           for h, num in zip(header, numeric)) + "</tr></thead>")
    out.append("<tbody>")
    for r in rows:
        cells = []
        for v in r:
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            text = html.escape(_fmt(v)) if num else _inline(_fmt(v))  # `code` in a string cell shows as code
            cells.append(f'<td{" class=num" if num else ""}>{text}</td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if caption:  # below the table, as wide as the slide (a <caption> would wrap at the table's width)
        out.append(f'<p class="caption">{_inline(caption)}</p>')
    return "".join(out)


def terms_html(target, rows):
    """The named glossary rows as an English / 中文 / meaning table."""
    spec = target.split(":", 1)[1] if ":" in target else target
    names = [t.strip() for t in re.split(r"[;,]", spec) if t.strip()]
    found = [glossary_lookup(n, rows) for n in names]
    body = "".join(
        f"<tr><td>{html.escape(r['en'])}</td><td lang=zh>{html.escape(r['zh'])}</td><td>{_inline(r['meaning'])}</td></tr>"
        for r in found
    )
    return f'<table class="dstable terms"><thead><tr><th>English</th><th>中文</th><th>meaning</th></tr></thead><tbody>{body}</tbody></table>'


def _inline(text):
    """Glossary cell Markdown (code, bold) as inline HTML."""
    s = html.escape(text)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)


def run_directive(kind, caption, target, glossary):
    """The HTML a directive stands for; Missing if what it names is not there yet."""
    if kind == "terms":
        return terms_html(target, glossary)
    module, node, columns = parse_target(target)
    chatter = io.StringIO()  # what the functions print (library logs, warnings): shown only on failure
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            result = evaluate(node, module)
    except SlideError as exc:
        said = chatter.getvalue().strip()[-1500:]
        raise SlideError(f"{exc}" + (f"\n  it printed:\n{said}" if said else "")) from exc.__cause__
    fig, data = _split_result(result)
    name = f"{module}:{ast.unparse(node)}"
    if kind == "figure":
        if fig is None or not hasattr(fig, "canvas"):
            raise SlideError(f"{name} returned no matplotlib Figure; use ![table](...) for data")
        return figure_html(fig, caption)
    if fig is not None:
        import matplotlib.pyplot as plt

        plt.close(fig)
    if kind == "code":
        return code_html(data, caption, name)
    return table_html(data, caption, columns)


def code_html(data, caption="", name="the expression"):
    """A string (or a list of lines) as a wrapped code block: command lines, hostfiles, configs."""
    if isinstance(data, (list, tuple)) and all(isinstance(x, str) for x in data):
        data = "\n".join(data)
    if not isinstance(data, str):
        raise SlideError(f"{name} gave {type(data).__name__}; ![code] shows a string or a list of lines")
    cap = f'<p class="caption">{_inline(caption)}</p>' if caption else ""
    text = inspect.cleandoc(data)  # a docstring's indentation goes, other text is unchanged
    return f'<pre class="wrap"><code>{html.escape(text)}</code></pre>{cap}'


def _split_result(result):
    """(Figure or None, data) from what a plot or table function returned."""
    def is_fig(x):
        return hasattr(x, "savefig") and hasattr(x, "axes")

    if isinstance(result, tuple) and len(result) == 2 and is_fig(result[0]):
        return result
    if is_fig(result):
        return result, None
    return None, result


def _markdown():
    """The Markdown renderer: mistune with tables, code blocks highlighted by Pygments when present."""
    import mistune

    class Renderer(mistune.HTMLRenderer):
        def block_code(self, code, info=None):
            lang = (info or "").split()[0] if info else ""
            try:
                from pygments import highlight
                from pygments.formatters import HtmlFormatter
                from pygments.lexers import get_lexer_by_name

                return highlight(code, get_lexer_by_name(lang or "text"), HtmlFormatter(nowrap=False, cssclass="hl"))
            except Exception:  # no Pygments, or a language it does not know: plain code
                return f"<pre><code>{html.escape(code)}</code></pre>\n"

    return mistune.create_markdown(renderer=Renderer(escape=False), plugins=["table", "strikethrough"])


def pygments_css():
    """The code-highlighting CSS (from the Pygments package at build time), or '' without it."""
    try:
        from pygments.formatters import HtmlFormatter

        return HtmlFormatter(style="friendly").get_style_defs(".hl")
    except ImportError:
        return ""


def render_slide(text, md, glossary, pending, number):
    """One slide's HTML; directives that name something missing become a visible 'pending' box."""
    blocks, lines, fence = {}, [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
        d = DIRECTIVE.match(line.strip()) if fence is None else None
        if not d:
            lines.append(line)
            continue
        key = f"DSLABDIRECTIVE{len(blocks)}X"
        kind, caption, target = d.group("kind"), (d.group("caption") or "").strip(), d.group("target").strip()
        try:
            blocks[key] = run_directive(kind, caption, target, glossary)
        except Missing as exc:
            pending.append((number, line.strip(), str(exc)))
            blocks[key] = (f'<div class="pending"><strong>{kind} pending</strong>: {html.escape(str(exc))}'
                           f"<br><code>{html.escape(line.strip())}</code></div>")
        lines.extend(["", key, ""])  # its own paragraph, replaced after Markdown rendering
    out = md("\n".join(lines))
    for key, block in blocks.items():
        out = out.replace(f"<p>{key}</p>", block).replace(key, block)
    return out


def check_directive(kind, target, glossary):
    """Problems with one directive found without running anything: syntax, names, glossary terms."""
    try:
        if kind == "terms":
            terms_html(target, glossary)
            return []
        module, node, _ = parse_target(target)
        problems = []
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                try:
                    _lookup(_dotted(sub.func), module)
                except Missing as exc:
                    problems.append(str(exc))
        return problems
    except (SlideError, Missing) as exc:
        return [str(exc)]


def check_deck(path):
    """[(slide number, directive target, problem)] for a deck, without running its figure code."""
    deck, glossary = load_deck(path), load_glossary()
    return [(i, target, problem) for i, text in enumerate(deck.slides, 1)
            for kind, _, target in directives(text) for problem in check_directive(kind, target, glossary)]


def build_deck(path, out_dir=BUILD_DIR, strict=False):
    """Render one deck to out_dir/<stem>.html; returns a BuildReport. strict: missing content is an error."""
    import matplotlib

    matplotlib.use("Agg")
    t0 = time.perf_counter()
    deck = load_deck(path)
    md, glossary, pending, sections = _markdown(), load_glossary(), [], []
    for i, text in enumerate(deck.slides, 1):
        try:
            body = render_slide(text, md, glossary, pending, i)
        except SlideError as exc:
            raise SlideError(f"{deck.path.name}, slide {i}: {exc}") from exc
        cls = "slide title" if i == 1 else "slide"
        sections.append(
            f'<section class="{cls}" id="slide-{i}" data-index="{i}"><div class="content">{body}</div>'
            f'<footer><span>{html.escape(deck.title)}</span><span class="num">{i} / {len(deck.slides)}</span></footer></section>'
        )
    if strict and pending:
        raise SlideError(f"{deck.path.name}: " + "; ".join(f"slide {n}: {why}" for n, _, why in pending))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{deck.name}.html"
    out.write_text(_page(deck, sections), encoding="utf-8")
    return BuildReport(deck.name, out, len(deck.slides), time.perf_counter() - t0, pending)


def _page(deck, sections):
    """The whole self-contained HTML document."""
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">\n'
        f"<title>{html.escape(deck.title)}</title>\n<style>\n{CSS}\n{pygments_css()}\n</style></head>\n"
        f'<body data-slides="{len(sections)}" data-deck="{html.escape(deck.name)}">\n'
        f'<main id="deck">\n' + "\n".join(sections) + "\n</main>\n"
        f"<script>\n{JS}\n</script>\n</body></html>\n"
    )


CSS = f"""
@page {{ size: {WIDTH}px {HEIGHT}px; margin: 0; }}
html, body {{ margin: 0; height: 100%; background: #1d2330; overflow: hidden; }}
body {{ font-family: "Noto Sans", "DejaVu Sans", "Noto Sans CJK SC", "WenQuanYi Zen Hei", sans-serif; color: #1b1f27; }}
#deck {{ position: absolute; left: 50%; top: 50%; width: {WIDTH}px; height: {HEIGHT}px;
        transform-origin: center center; transform: translate(-50%, -50%); }}
section.slide {{ display: none; position: absolute; inset: 0; box-sizing: border-box; width: {WIDTH}px;
                height: {HEIGHT}px; background: #fdfdfb; padding: 44px 64px 56px; overflow: hidden; }}
section.slide.current, section.slide.measure {{ display: block; }}
section.slide.measure {{ visibility: hidden; }}
.content {{ height: 100%; overflow: hidden; font-size: 26px; line-height: 1.38; }}
h1 {{ font-size: 44px; margin: 0 0 18px; color: #18406b; }}
h2 {{ font-size: 36px; margin: 0 0 18px; color: #18406b; border-bottom: 3px solid #e3a13b; padding-bottom: 6px; }}
h3 {{ font-size: 28px; margin: 10px 0 8px; color: #28507a; }}
p {{ margin: 8px 0; }}
ul, ol {{ margin: 6px 0; padding-left: 34px; }}
li {{ margin: 5px 0; }}
code {{ font-family: "DejaVu Sans Mono", "Noto Sans Mono", monospace; font-size: 0.86em; background: #eef1f5;
        padding: 1px 5px; border-radius: 4px; }}
pre, .hl pre {{ font-family: "DejaVu Sans Mono", "Noto Sans Mono", monospace; font-size: 19px; line-height: 1.35;
       background: #f3f5f8; border-left: 4px solid #18406b; padding: 10px 16px; margin: 10px 0; white-space: pre; }}
.hl {{ background: transparent; }}
pre code {{ background: none; padding: 0; font-size: inherit; }}
pre.wrap {{ white-space: pre-wrap; overflow-wrap: anywhere; font-size: 17px; }}
table {{ border-collapse: collapse; margin: 10px 0; font-size: 21px; }}
th, td {{ border-bottom: 1px solid #cfd6df; padding: 5px 14px; text-align: left; vertical-align: top; }}
th {{ background: #e8eef5; }}
td.num, th.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
table.terms {{ font-size: 18px; }} table.terms td {{ padding: 3px 12px; }} table.terms td:nth-child(2) {{ white-space: nowrap; }}
p.caption {{ font-size: 17px; color: #5a6270; margin: -4px 0 10px; }}
figure.dsfig {{ margin: 6px 0; text-align: center; }}
figure.dsfig img {{ max-width: 100%; max-height: 500px; }}
figcaption {{ font-size: 17px; color: #5a6270; }}
.pending {{ border: 3px dashed #c0392b; color: #7b241c; background: #fdf0ee; padding: 18px; font-size: 20px; }}
.cols {{ display: flex; gap: 36px; }} .cols > div {{ flex: 1; min-width: 0; }}
.small {{ font-size: 21px; }}
blockquote {{ margin: 10px 0; padding: 6px 18px; border-left: 5px solid #e3a13b; background: #fbf5ea; }}
section.title .content {{ display: flex; flex-direction: column; justify-content: center; }}
section.title h1 {{ font-size: 56px; }}
footer {{ position: absolute; left: 64px; right: 64px; bottom: 16px; display: flex; justify-content: space-between;
         font-size: 15px; color: #8a93a1; }}
@media print {{
  html, body {{ background: #fff; overflow: visible; height: auto; }}
  #deck {{ position: static; transform: none !important; width: auto; height: auto; }}
  section.slide {{ display: block; position: relative; break-after: page; page-break-after: always; }}
}}
"""

# The viewer: one slide at a time; arrows/space/PageUp/PageDown/Home/End or a click to move; #N opens
# slide N. It records what it rendered in <body data-*> so a headless browser test can read it back.
JS = f"""
(function () {{
  var deck = document.getElementById('deck');
  var slides = deck.querySelectorAll('section.slide');
  var n = slides.length, cur = -1;
  document.body.setAttribute('data-rendered-slides', String(n));
  function fit() {{
    var s = Math.min(window.innerWidth / {WIDTH}, window.innerHeight / {HEIGHT});
    deck.style.transform = 'translate(-50%, -50%) scale(' + s + ')';
  }}
  function show(i) {{
    i = Math.max(0, Math.min(n - 1, i));
    if (cur >= 0) slides[cur].classList.remove('current');
    cur = i;
    slides[cur].classList.add('current');
    document.body.setAttribute('data-current', String(cur + 1));
    if (location.hash !== '#' + (cur + 1)) {{
      try {{ history.replaceState(null, '', '#' + (cur + 1)); }} catch (e) {{ location.hash = '#' + (cur + 1); }}
    }}
  }}
  function fromHash() {{
    var m = /^#(\\d+)$/.exec(location.hash);
    show(m ? parseInt(m[1], 10) - 1 : 0);
  }}
  function overflowing() {{
    var bad = [];
    for (var i = 0; i < n; i++) {{
      var s = slides[i], c = s.querySelector('.content'), was = s.classList.contains('current');
      if (!was) s.classList.add('measure');
      if (c.scrollHeight > c.clientHeight + 1 || c.scrollWidth > c.clientWidth + 1) bad.push(i + 1);
      if (!was) s.classList.remove('measure');
    }}
    return bad;
  }}
  document.addEventListener('keydown', function (e) {{
    var k = e.key;
    if (k === 'ArrowRight' || k === 'ArrowDown' || k === 'PageDown' || k === ' ' || k === 'n') show(cur + 1);
    else if (k === 'ArrowLeft' || k === 'ArrowUp' || k === 'PageUp' || k === 'Backspace' || k === 'p') show(cur - 1);
    else if (k === 'Home') show(0);
    else if (k === 'End') show(n - 1);
    else return;
    e.preventDefault();
  }});
  deck.addEventListener('click', function (e) {{
    if (e.target.closest('a') || String(window.getSelection())) return;
    show(e.clientX < window.innerWidth / 3 ? cur - 1 : cur + 1);
  }});
  window.addEventListener('hashchange', fromHash);
  window.addEventListener('resize', fit);
  fit();
  fromHash();
  document.body.setAttribute('data-overflow', overflowing().join(','));
}})();
"""


# ----------------------------------------------------------------------------------------------------
# PDF (Chromium's print-to-PDF, offline)
# ----------------------------------------------------------------------------------------------------
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


def find_chromium():
    """Path of a Chromium binary (Debian's `chromium` first), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def export_pdf(html_path, chromium=None, timeout=120):
    """Print a built deck to PDF next to it (one slide per page) with headless Chromium."""
    chromium = chromium or find_chromium()
    if not chromium:
        raise SlideError("PDF export needs Chromium: apt-get install -y chromium")
    html_path = Path(html_path).resolve()
    pdf = html_path.with_suffix(".pdf")
    with tempfile.TemporaryDirectory(prefix="dslab-chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--no-pdf-header-footer",
               f"--print-to-pdf={pdf}", html_path.as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not pdf.exists():
        raise SlideError(f"Chromium could not print {html_path.name}: {proc.stderr.strip()[-500:]}")
    return pdf


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def cmd_build(args):
    """Build the decks; print one line per deck and a list of what is still pending."""
    paths = deck_paths(args.src, args.decks)
    if not paths:
        print(f"no decks found in {args.src} (expected NN_topic.md files)", file=sys.stderr)
        return 1
    t0, pending = time.perf_counter(), []
    _RESULTS.clear()
    for p in paths:
        try:
            rep = build_deck(p, args.out, strict=args.strict)
        except SlideError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        pending += [(rep.deck, n, why) for n, _, why in rep.pending]
        line = f"{rep.output.relative_to(ROOT) if rep.output.is_relative_to(ROOT) else rep.output}: {rep.slides} slides, {rep.seconds:.1f} s"
        if rep.pending:
            line += f", {len(rep.pending)} pending"
        print(line)
        if args.pdf:
            print(f"  {export_pdf(rep.output)}")
    for deck, n, why in pending:
        print(f"pending: {deck} slide {n}: {why}", file=sys.stderr)
    print(f"{len(paths)} decks in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_list(args):
    """Each deck with its slide count and directives; with `check`, what each directive still lacks."""
    bad = 0
    for p in deck_paths(args.src, args.decks):
        deck = load_deck(p)
        problems = {}
        if args.check:
            for n, target, why in check_deck(p):
                problems.setdefault((n, target), []).append(why)
        print(f"{p.name}: {len(deck.slides)} slides — {deck.title}")
        for i, text in enumerate(deck.slides, 1):
            for kind, _, target in directives(text):
                why = problems.get((i, target))
                status = ("  <- " + "; ".join(why)) if why else ("  ok" if args.check else "")
                print(f"  slide {i}: {kind} {target}{status}")
        bad += len(problems)
    return 1 if bad else 0


def _add_actions(sub):
    build = sub.add_parser("build", help="render the decks to self-contained HTML")
    lst = sub.add_parser("list", help="list decks, slide counts and figure directives")
    check = sub.add_parser("check", help="like list, and fail if a directive names a missing function or term")
    for p in (build, lst, check):
        p.add_argument("decks", nargs="*", help="deck names or prefixes (e.g. 04 or 04_zero); default: all")
        p.add_argument("--src", default=str(SLIDES_DIR), help="folder with the NN_topic.md sources")
    build.add_argument("--out", default=str(BUILD_DIR), help="output folder (default slides/build)")
    build.add_argument("--strict", action="store_true", help="fail if a directive names something missing")
    build.add_argument("--pdf", action="store_true", help="also print each deck to PDF with headless Chromium")
    build.set_defaults(func=cmd_build)
    lst.set_defaults(func=cmd_list, check=False)
    check.set_defaults(func=cmd_list, check=True)


def add_commands(subparsers):
    """`dslab slides build|list|check`."""
    p = subparsers.add_parser("slides", help="build the workshop decks (slides/*.md -> slides/build/*.html)")
    _add_actions(p.add_subparsers(dest="slides_command", metavar="ACTION"))
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def main(argv=None):
    """python -m dslab.slides build|list|check ..."""
    parser = argparse.ArgumentParser(prog="python -m dslab.slides", description="build the workshop decks")
    _add_actions(parser.add_subparsers(dest="slides_command", metavar="ACTION", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
