"""docs/architecture.md names only modules and functions that exist, and dslab's imports go one way: no cycle,
nothing imports the command line, a recipe or a driver. Everything is read with ast: nothing of dslab is imported."""
import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dslab"
DOC = ROOT / "docs" / "architecture.md"


def package_modules(package=PACKAGE):
    """{'dslab.x.y': path} for every module of the package; a subpackage is its __init__.py."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _known_prefix(name, known):
    """The longest prefix of a dotted name that is a module: dslab.launch.free_port -> dslab.launch."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def imports_of(name, path, known):
    """The dslab modules that module `name` imports, at the top or inside functions (a lazy import still ties
    the two modules together). `from pkg import submodule` is an edge to the submodule, not to pkg."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [_known_prefix(alias.name, known) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _known_prefix(base, known)
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t and t != name)
    return found


def import_graph(package=PACKAGE):
    known = package_modules(package)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph):
    """Every import cycle (each as a list of modules, the first repeated at the end), found by depth-first search."""
    found, state = [], {}  # state: 1 = on the current path, 2 = finished

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


GRAPH = import_graph()


def test_the_import_graph_sees_the_package():
    assert {"dslab.cli", "dslab.models.loading", "dslab.launch", "dslab.live"} <= set(GRAPH)
    assert "dslab.models.loading" in GRAPH["dslab.live"] | GRAPH["dslab.training.sft"] | GRAPH["dslab.zero.runner"] | GRAPH["dslab.models.lora"]


def test_dslab_imports_have_no_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles (lazy imports count too):\n" + "\n".join(" -> ".join(c) for c in found)


def test_nothing_imports_the_command_line_a_recipe_or_a_driver():
    wrong = [f"{name} imports {target}" for name, targets in GRAPH.items() for target in sorted(targets)
             if (target.startswith("dslab.cli") and not name.startswith("dslab.cli"))
             or target.startswith(("dslab.recipes", "dslab.drivers"))]
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------- layers

# The package's parts, bottom to top: a part imports only parts of a lower layer (and itself). A part is a subpackage
# (dslab/comm/, ...) or a top-level module (dslab/this_rank.py). docs/architecture.md shows the same table.
LAYERS = [
    {"messages", "compat", "machine"},
    {"files", "data", "plots", "course", "noise", "workshop", "hangs"},
    {"launch", "config"},
    {"this_rank"},
    {"env", "models"},
    {"zero", "precision"},
    {"comm", "flops"},
    {"parallel", "training"},
    {"tiny", "live"},
    {"exercises"},
    {"cli", "recipes", "drivers"},
]


def part_of(module):
    """dslab.comm.step_bytes -> comm, dslab.this_rank -> dist; the package itself (dslab/__init__.py) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_of(part):
    return next((i for i, layer in enumerate(LAYERS) if part in layer), None)


def upward_imports(graph):
    """Imports from a part to a part of the same or a higher layer, as 'a imports b (layer i -> j)'."""
    found = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = part_of(name), part_of(target)
            if a is None or b is None or a == b:
                continue
            if layer_of(a) <= layer_of(b):
                found.append(f"{name} imports {target} (layer {layer_of(a)} {a} -> layer {layer_of(b)} {b})")
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(name) for name in GRAPH} - {None}
    unplaced = sorted(p for p in parts if layer_of(p) is None)
    assert not unplaced, f"put these in LAYERS (and in docs/architecture.md's table): {unplaced}"
    assert all(len(layer) == len(set(layer)) for layer in LAYERS)
    assert sum(map(len, LAYERS)) == len(set().union(*LAYERS)), "a part is in two layers"


def test_imports_go_down_the_layers():
    wrong = upward_imports(GRAPH)
    assert not wrong, "a lower layer imports a higher one (move the code, or the part):\n" + "\n".join(wrong)


def test_the_layer_check_catches_a_lower_layer_importing_a_higher_one(tmp_path):
    pkg = tmp_path / "dslab"
    (pkg / "models").mkdir(parents=True)
    (pkg / "training").mkdir()
    for init in (pkg, pkg / "models", pkg / "training"):
        (init / "__init__.py").write_text("")
    (pkg / "training" / "sft.py").write_text("from dslab.models import loading\n")      # down: allowed
    (pkg / "models" / "loading.py").write_text("def f():\n    from dslab.training import sft\n")  # up, lazily
    assert upward_imports(import_graph(pkg)) == [
        "dslab.models.loading imports dslab.training.sft (layer 4 models -> layer 7 training)"]
    (pkg / "models" / "loading.py").write_text("import os\n")
    assert upward_imports(import_graph(pkg)) == []


def test_the_page_shows_the_layers():
    """docs/architecture.md's layer table lists the same parts, layer by layer, as LAYERS."""
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", DOC.read_text(encoding="utf-8"), re.M)
    on_page = {int(i): set(re.findall(r"`dslab(?:/|\.)(\w+)", cell)) for i, cell in rows}
    assert on_page == dict(enumerate(LAYERS)), on_page


def test_the_cycle_finder_finds_cycles_and_relative_imports(tmp_path):
    pkg = tmp_path / "dslab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from dslab import b\n")
    (pkg / "b.py").write_text("def f():\n    from dslab.sub.c import g\n")  # a lazy import counts
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("from ..a import x\nimport os\n")
    graph = import_graph(pkg)
    assert graph["dslab.sub"] == {"dslab.sub.c"} and graph["dslab.sub.c"] == {"dslab.a"}
    assert cycles(graph) == [["dslab.a", "dslab.b", "dslab.sub.c", "dslab.a"]]
    (pkg / "sub" / "c.py").write_text("import os\n")
    assert cycles(import_graph(pkg)) == []


# --------------------------------------------------------------------------- the page names what exists

def _top_level_names(path):
    """Names a module defines or imports at its top level (what `module.name` can reach without running it)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _code_spans():
    return re.findall(r"`([^`]+)`", DOC.read_text(encoding="utf-8"))


def test_every_path_on_the_page_exists():
    paths = {p for span in _code_spans() for p in re.findall(r"\b(?:dslab|tools|docs|tests)/[\w/.*-]*", span)}
    assert {"dslab/cli/__init__.py", "tools/slides.py"} <= paths
    missing = [p for p in sorted(paths) if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_and_function_on_the_page_exists():
    """`dslab.x.f`, and `x.f` where dslab.x is a module (`launch.run`, `live.start`), name something real."""
    known = package_modules()
    names = set()
    for span in _code_spans():
        names.update(re.findall(r"\bdslab(?:\.\w+)+", span))
        names.update(f"dslab.{m}" for m in re.findall(r"(?<![\w./])([a-z_]+\.[A-Za-z_]\w*)", span)
                     if f"dslab.{m.split('.')[0]}" in known)
    assert len(names) > 10
    missing = []
    for name in sorted(names):
        module = _known_prefix(name, known)
        rest = name[len(module) + 1:].split(".") if name != module else []
        if not module or module == "dslab" and rest:
            missing.append(f"{name}: no such module")
        elif rest and rest[0] not in _top_level_names(known[module]):
            missing.append(f"{name}: {module} has no {rest[0]}")
    assert not missing, "docs/architecture.md names what does not exist:\n" + "\n".join(missing)


def named_on_the_page(path, spans):
    """Whether a module file is named in one of the page's code spans: by its path (`dslab/hangs/watcher.py`), by a
    glob that matches it (`dslab/recipes/*.py`), or by its dotted name, alone or with an attribute
    (`dslab.zero.engine_memory.measure_engine`). A package's __init__.py also counts as named by its folder
    (`dslab/launch/`)."""
    rel = path.relative_to(ROOT).as_posix()
    module = rel[:-len(".py")].replace("/", ".")
    if path.name == "__init__.py":
        module = module[:-len(".__init__")]
    for span in spans:
        for named in re.findall(r"\bdslab/[\w/.*-]*", span):
            if named == rel or ("*" in named and fnmatch.fnmatchcase(rel, named)) \
                    or (path.name == "__init__.py" and named.rstrip("/") == rel.rpartition("/")[0]):
                return True
        if any(d == module or d.startswith(module + ".") for d in re.findall(r"\bdslab(?:\.\w+)+", span)):
            return True
    return False


def test_every_module_of_the_package_is_on_the_page():
    """A new module gets its line here (what it is for), so the page stays the map of the whole package."""
    spans = _code_spans()
    files = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix() != "__init__.py")
    assert len(files) > 50
    missing = [p.relative_to(ROOT).as_posix() for p in files if not named_on_the_page(p, spans)]
    assert not missing, f"docs/architecture.md does not name these modules; say what each is for: {missing}"


def test_a_module_counts_as_named_by_its_path_a_glob_or_its_dotted_name():
    hang, recipe = PACKAGE / "hangs" / "watcher.py", PACKAGE / "recipes" / "sft.py"
    package = PACKAGE / "launch" / "__init__.py"
    assert named_on_the_page(hang, ["dslab/hangs/watcher.py"]) and named_on_the_page(hang, ["dslab.hangs.watcher.x"])
    assert named_on_the_page(recipe, ["dslab/recipes/*.py"]) and named_on_the_page(package, ["dslab/launch/"])
    assert not named_on_the_page(hang, ["dslab/hangs/", "dslab.hangs.diagnoses", "dslab/hangs/watchers.py"])
    assert not named_on_the_page(PACKAGE / "hpz.py", ["dslab.hpzz", "hpz.gathers_by_pass"])


@pytest.mark.parametrize("entry", ["dslab.config.build.make_config", "dslab.zero.engine_memory.measure_engine",
                                   "dslab.zero.memory.theory", "dslab.zero.runner.run_engine", "dslab.live.start"])
def test_the_page_answers_where_a_zero_stage_lives(entry):
    """The questions the page exists for are still answered on it."""
    text = DOC.read_text(encoding="utf-8")
    module, _, func = entry.rpartition(".")
    assert entry in text or f"{module.split('.')[-1]}.{func}" in text


def _module_names_bound_in(tree, known):
    """Local names a module binds to dslab modules: `from dslab import launch` -> {"launch": "dslab.launch"}."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    bound[alias.asname] = alias.name
    return bound


def private_uses(name, path, known):
    """`module._name` or `from module import _name` in module `name`, where module is another dslab module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bound = _module_names_bound_in(tree, known)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in known and node.module != name:
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
              and bound[node.value.id] != name and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    known = package_modules()
    offenders = {name: uses for name, path in known.items() if (uses := private_uses(name, path, known))}
    assert not offenders, f"make these public (with a docstring) or move them: {offenders}"


def test_the_private_name_finder_finds_both_forms(tmp_path):
    pkg = tmp_path / "dslab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _helper():\n    pass\n")
    (pkg / "b.py").write_text("from dslab import a\nfrom dslab.a import _helper\na._helper()\na.__name__\n")
    known = package_modules(pkg)
    assert private_uses("dslab.b", pkg / "b.py", known) == ["from dslab.a import _helper", "a._helper"]


def test_argparse_lives_in_the_command_line_the_recipes_and_the_drivers_only():
    # The command line parses dslab's commands; each recipe or driver parses its own arguments, as DeepSpeed's
    # examples do.
    users = [name for name, path in package_modules().items()
             if re.search(r"^\s*(import argparse|from argparse import)", path.read_text(encoding="utf-8"), re.M)]
    elsewhere = [name for name in users if not re.match(r"dslab\.(cli|recipes|drivers)(\.|$)", name)]
    assert not elsewhere, f"argparse outside dslab/cli/, dslab/recipes/ and dslab/drivers/: {elsewhere}"
    assert {"dslab.cli", "dslab.recipes.sft", "dslab.drivers.zero_memory"} <= set(users), users


def test_every_module_reads_in_one_sitting():
    long = {name: n for name, path in package_modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 500}
    assert not long, f"split these by concept: {long}"
