"""Deck sources for tools/slides.py: slides/NN_topic.md split into slides, the `![kind: caption](target)`
directives found on them, their target expressions checked and evaluated, and docs/glossary.md read.

Nothing here renders HTML (tools/slides_html.py does) and nothing here imports matplotlib: `check` runs only
this module, so it is quick.
"""
import ast
import copy
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLIDES_DIR = ROOT / "slides"
ZH_SLIDES_DIR = SLIDES_DIR / "zh"  # the Chinese edition's decks: same names, same directives, Chinese text
GLOSSARY = ROOT / "docs" / "glossary.md"

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

    @property
    def lang(self):
        """'zh' for a deck in slides/zh (any folder named zh), else 'en'."""
        return "zh" if self.path.parent.name == "zh" else "en"


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
    e.g. dslab.precision.loss_scaling.trace_grad_scaler()), pass literals or such calls as arguments, and index the
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


_RESULTS = {}  # (id(function), call text) -> (function, result), for one build (see forget_results)


def forget_results():
    """Start a build afresh: the next evaluate() of each call runs its function again."""
    _RESULTS.clear()


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
            "en": plain(row["english"]),
            "zh": plain(row["中文"]),
            "meaning": row.get("meaning", ""),
            "meaning_zh": row.get("说明", ""),
            "avoid": [a.strip() for a in re.split(r"[;；、]", plain(avoid)) if a.strip() and a.strip() != "—"],
        })
    return rows


def plain(cell):
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


def glossary_terms(target, rows):
    """The rows a `![terms](glossary: ZeRO; sharding)` directive names, in its order; Missing for an unknown term."""
    spec = target.split(":", 1)[1] if ":" in target else target
    return [glossary_lookup(name.strip(), rows) for name in re.split(r"[;,]", spec) if name.strip()]


# ----------------------------------------------------------------------------------------------------
# Checking without running anything (`python -m tools.slides check`)
# ----------------------------------------------------------------------------------------------------
def check_directive(kind, target, glossary):
    """Problems with one directive found without running anything: syntax, names, glossary terms."""
    try:
        if kind == "terms":
            glossary_terms(target, glossary)
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


def check_deck(path, glossary=None):
    """[(slide number, directive target, problem)] for a deck, without running its figure code."""
    deck = load_deck(path)
    glossary = load_glossary() if glossary is None else glossary
    return [(i, target, problem) for i, text in enumerate(deck.slides, 1)
            for kind, _, target in directives(text) for problem in check_directive(kind, target, glossary)]
