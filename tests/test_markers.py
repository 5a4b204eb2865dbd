"""The slow / multirank lists in conftest.py name tests that exist: a renamed test must not slip into the
quick loop (`pytest -m "not slow"`) unnoticed."""
import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFTEST = _root_conftest()


@pytest.mark.parametrize("entry", CONFTEST.MULTIRANK + CONFTEST.SLOW)
def test_marker_entry_names_an_existing_test(entry):
    file, _, name = entry.partition("::")
    name = name.split("[")[0]  # a parametrized case: its function must exist
    path = ROOT / file
    assert path.exists(), f"conftest.py lists {entry}, but there is no {file}"
    if name:
        defined = {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name in defined, f"conftest.py lists {entry}: {file} has no {name} (renamed?)"


def test_matching_covers_parametrized_cases_and_folders_only():
    match = CONFTEST._matches
    assert match("tests/test_a.py::test_x[2-fp16]", ("tests/test_a.py::test_x",))
    assert match("tests/test_a.py::test_x", ("tests/test_a.py",)) and match("tests/b/t.py::t", ("tests/b/",))
    assert not match("tests/test_a.py::test_xy", ("tests/test_a.py::test_x",))
    assert not match("tests/test_ab.py::test_x", ("tests/test_a.py",))
