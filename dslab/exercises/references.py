"""Whether a learner's function leans on a reference function: the checker's own, or the chapter's, that computes the
answer the learner is asked to write (03.fix_loop: dslab.training.accumulation.accumulate_backward, the loop chapter 03
prints; 05.mask_prompt: dslab.data.sft_example, the masking chapter 05 runs; 13.forward_flops:
dslab.flops.forward_flops; 14.trainer_steps: the checker's trainer_steps_reference and
dslab.training.sft_plan.trainer_steps). Such an answer is right on every case a checker can draw, since the checker
compares with that same function (or the chapter's function does the very work asked): only reading the code tells it
apart.

`leaned_on(fn, references)` follows what a function can reach without running it: the names its code (and the code
of the functions and lambdas defined inside it) reads from its globals, from builtins and from the modules it
imports (`import a.b`, `from a.b import c`, importlib.import_module("a.b") in its body), those modules' attributes
that it names, its closure, its default arguments, functools.partial and functools.wraps wrappers; and, through each
function or class it reaches that is not an installed library's (the learner's own helpers, dslab's), what that one
reaches. A copy of a reference's source is not told apart: it is the same code a learner may write.
"""
import functools
import inspect
import sys
import sysconfig
import types
from pathlib import Path

_LIBRARIES = tuple(sorted({str(Path(sysconfig.get_paths()[key]).resolve())
                           for key in ("stdlib", "platstdlib", "purelib", "platlib")}))
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _name(fn):
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', getattr(fn, '__name__', fn))}"


def _codes(code):
    """A code object and the code objects nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _followed(obj):
    """Whether to look inside `obj`: a function or class of the learner's or of dslab's, not an installed library's."""
    if str(getattr(obj, "__module__", None) or "").split(".")[0] == "dslab":
        return True
    code = getattr(obj, "__code__", None)
    if code is None and isinstance(obj, type):
        try:
            code_file = inspect.getsourcefile(obj)
        except (TypeError, OSError):
            return False
    elif code is not None:
        code_file = code.co_filename
    else:
        return False
    try:
        where = str(Path(code_file).resolve())
    except (OSError, ValueError, TypeError):
        return True
    return not where.startswith(_LIBRARIES)


def _reachable(fn):
    """What `fn` (a function, method, partial or class) can reach in one step: see the module docstring."""
    if isinstance(fn, functools.partial):
        return [fn.func, *fn.args, *fn.keywords.values()]
    if isinstance(fn, type):
        return [v.__func__ if isinstance(v, (staticmethod, classmethod)) else v for v in vars(fn).values()]
    found = []
    if getattr(fn, "__wrapped__", None) is not None:
        found.append(fn.__wrapped__)
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
        found.append(fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return found
    words, strings = set(), set()
    for part in _codes(code):
        words.update(part.co_names)
        strings.update(c for c in part.co_consts if isinstance(c, str))
    scope = getattr(fn, "__globals__", {})
    builtins = scope.get("__builtins__", {})
    builtins = builtins if isinstance(builtins, dict) else vars(builtins)
    modules = [sys.modules[w] for w in words | strings if w in sys.modules]
    for word in words:
        value = scope[word] if word in scope else builtins.get(word)
        if isinstance(value, types.ModuleType):
            modules.append(value)
        elif value is not None:
            found.append(value)
    looked = set()
    while modules:   # `from a import b` names module a and b; b may be a module too (a.b), whose names count
        module = modules.pop()
        if id(module) in looked:
            continue
        looked.add(id(module))
        for word in words | strings:
            value = getattr(module, word, None)
            if isinstance(value, types.ModuleType):
                modules.append(value)
            elif value is not None and not isinstance(value, _PLAIN):
                found.append(value)
    for cell in fn.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:   # a cell not filled yet
            pass
    found.extend(fn.__defaults__ or ())
    found.extend((fn.__kwdefaults__ or {}).values())
    return found


def leaned_on(fn, references, depth=8):
    """The dotted name of the first of `references` (functions) that `fn` is or reaches; None if none."""
    wanted = {id(r): r for r in references}
    seen, todo = set(), [(fn, 0)]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or isinstance(obj, _PLAIN):
            continue
        seen.add(id(obj))
        if id(obj) in wanted:
            return _name(wanted[id(obj)])
        if level >= depth:
            continue
        looks_inside = (isinstance(obj, (functools.partial, types.MethodType)) or inspect.isfunction(obj)
                        or isinstance(obj, type))
        if not looks_inside or (level > 0 and not isinstance(obj, functools.partial) and not _followed(obj)):
            continue
        todo.extend((nxt, level + 1) for nxt in _reachable(obj) if callable(nxt))
    return None
