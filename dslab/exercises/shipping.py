"""A learner's functions, sent to rank processes that run them: as their source, with what they use.

A function defined in a notebook cell lives in the kernel only; a rank started by the launcher cannot import it. So
`pack(objects)` writes down, as JSON, what rebuilds them: the source of each function or class the learner wrote
(read where Python keeps it: the cell, or the file), at its own line numbers, so that a traceback on a rank points at
the learner's line; an `import` for each module they name; the value of each plain constant; a reference for
anything importable (dslab's own functions, an installed library's); a `functools.partial` as its function and its
bound values. `unpack(packed)` on a rank rebuilds them in one fresh namespace, as a notebook's globals are one
namespace. Names that cannot be sent (an open file, a live engine)
are left out: using one on a rank is a NameError that the learner's traceback shows.
"""
import ast
import builtins
import functools
import importlib
import inspect
import linecache
import sys
import textwrap
import types

from dslab.exercises import feedback

_LITERALS = (int, float, complex, str, bytes, bool, type(None))


class Unshippable(ValueError):
    """The object cannot be sent to the ranks (the message says why and what to do)."""


def _is_literal(value, depth=0):
    if isinstance(value, _LITERALS):
        return True
    if depth > 6:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_is_literal(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_is_literal(k, depth + 1) and _is_literal(v, depth + 1) for k, v in value.items())
    return False


def _importable(obj):
    """(module, qualname) if the ranks can import `obj` by name, else None."""
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module_name or "<" in qualname or module_name == "__main__":
        return None
    module = sys.modules.get(module_name)
    if module is None:
        return None
    file = getattr(module, "__file__", None)
    if file and not feedback.is_library_file(file):   # a learner's own file (a solutions file, a test): by source
        return None
    target = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return (module_name, qualname) if target is obj else None


def _class_source(cls):
    """(filename, first line, lines) of a class: found in the file of one of its methods (notebook classes have no
    file of their own that inspect can read)."""
    for member in vars(cls).values():
        member = getattr(member, "__func__", member)
        code = getattr(member, "__code__", None)
        if code is None:
            continue
        lines = linecache.getlines(code.co_filename)
        if not lines:
            continue
        for node in ast.walk(ast.parse("".join(lines))):
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__ \
                    and node.lineno <= code.co_firstlineno <= node.end_lineno:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                return code.co_filename, first, lines[first - 1:node.end_lineno]
    try:
        lines, first = inspect.getsourcelines(cls)
        return inspect.getsourcefile(cls), first, lines
    except (OSError, TypeError):
        raise Unshippable(f"the source of class {cls.__name__} cannot be found: define it in a cell or a file") \
            from None


def _source(obj):
    """(filename, first line, source text) of a function or class the learner wrote."""
    if isinstance(obj, type):
        filename, first, lines = _class_source(obj)
    else:
        code = obj.__code__
        if code.co_name == "<lambda>":
            raise Unshippable("a lambda cannot be sent to the ranks by its source: write it with def")
        if code.co_freevars:
            raise Unshippable(f"{obj.__name__} uses variables of the function it is defined in "
                              f"({', '.join(code.co_freevars)}): define it at the top level of your cell")
        filename = code.co_filename
        try:
            lines, first = inspect.getsourcelines(obj)
        except (OSError, TypeError):
            raise Unshippable(f"the source of {obj.__name__} cannot be found: define it in a cell or a file") from None
    return filename, first, textwrap.dedent("".join(lines))


def _globals_of(obj):
    if isinstance(obj, type):
        for member in vars(obj).values():
            member = getattr(member, "__func__", member)
            if hasattr(member, "__globals__"):
                return member.__globals__
        return vars(sys.modules.get(obj.__module__, builtins))
    return obj.__globals__


def _code_names(code):
    """The global (and attribute) names a code object and the code nested in it use: not its locals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _names_used(obj, text):
    """The names the object's code reads from its module's globals (candidates for what must travel with it)."""
    if not isinstance(obj, type):
        return _code_names(obj.__code__)
    names = set()
    for member in vars(obj).values():
        member = getattr(member, "__func__", member)
        if hasattr(member, "__code__"):
            names |= _code_names(member.__code__)
    node = ast.parse(text).body[0]
    outside_methods = [*node.bases, *node.keywords, *node.decorator_list,
                       *(s for s in node.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    for part in outside_methods:
        names |= {n.id for n in ast.walk(part) if isinstance(n, ast.Name)}
    return names


def pack(objects):
    """JSON-ready instructions that rebuild `objects` (the learner's functions and classes) on a rank; see unpack."""
    chunks, done = [], set()

    def visit(name, obj, namespace_of_user):
        key = (name, id(obj))
        if key in done:
            return
        done.add(key)
        if isinstance(obj, types.ModuleType):
            chunks.append({"kind": "import", "name": name, "module": obj.__name__})
            return
        if isinstance(obj, (types.FunctionType, type)):
            where = _importable(obj)
            if where:
                chunks.append({"kind": "ref", "name": name, "module": where[0], "qualname": where[1]})
                return
            filename, first, text = _source(obj)
            used = _globals_of(obj)
            for other in sorted(_names_used(obj, text) - set(dir(builtins))):
                if other in used and other != obj.__name__:
                    visit(other, used[other], used)
            chunks.append({"kind": "source", "name": name, "defines": obj.__name__, "file": feedback.label(filename),
                           "line": first, "text": text})
            return
        if _is_literal(obj):
            chunks.append({"kind": "value", "name": name, "repr": repr(obj)})
            return
        if isinstance(obj, functools.partial) and _is_literal(obj.args) and _is_literal(obj.keywords):
            # A function with some arguments bound: the function travels as any other, the arguments as values.
            func_name = f"{name}.func"
            visit(func_name, obj.func, namespace_of_user)
            chunks.append({"kind": "partial", "name": name, "func": func_name, "args": repr(obj.args),
                           "keywords": repr(obj.keywords)})
            return
        where = _importable(obj) if callable(obj) else None
        if where:
            chunks.append({"kind": "ref", "name": name, "module": where[0], "qualname": where[1]})
            return
        # Anything else (an object, a tensor, a model) is left out: a rank unpickling what it is sent would run any
        # code a pickle holds (tests/test_security.py). Using it on a rank is a NameError the learner's traceback shows.

    names = []
    for obj in objects:
        if not callable(obj):
            raise Unshippable(f"expected a function, got {type(obj).__name__}")
        name = getattr(obj, "__name__", None) or f"answer_{len(names)}"
        visit(name, obj, None)
        names.append(name)
    return {"chunks": chunks, "answers": names}


def unpack(packed):
    """On a rank: rebuild what `pack` wrote down; returns (the answers, in order, the file labels of their code)."""
    namespace = {"__name__": "__learner__", "__builtins__": builtins}
    files = {}                      # label -> the lines known of that cell or file, blank where none was sent
    for chunk in packed["chunks"]:
        kind, name = chunk["kind"], chunk["name"]
        if kind == "import":
            namespace[name] = importlib.import_module(chunk["module"])
        elif kind == "ref":
            target = importlib.import_module(chunk["module"])
            for part in chunk["qualname"].split("."):
                target = getattr(target, part)
            namespace[name] = target
        elif kind == "value":
            namespace[name] = ast.literal_eval(chunk["repr"])
        elif kind == "partial":
            namespace[name] = functools.partial(namespace[chunk["func"]], *ast.literal_eval(chunk["args"]),
                                                **ast.literal_eval(chunk["keywords"]))
        elif kind == "source":
            # Blank lines first, so the code keeps its line numbers; linecache lets a traceback show its text.
            text = "\n" * (chunk["line"] - 1) + chunk["text"]
            lines = files.setdefault(chunk["file"], [])
            own = text.splitlines(True)
            lines.extend(["\n"] * (len(own) - len(lines)))
            lines[chunk["line"] - 1:len(own)] = own[chunk["line"] - 1:]
            linecache.cache[chunk["file"]] = (sum(map(len, lines)), None, lines, chunk["file"])
            exec(compile(text, chunk["file"], "exec"), namespace)
            if chunk["defines"] != name:
                namespace[name] = namespace[chunk["defines"]]
    return [namespace[name] for name in packed["answers"]], set(files)
