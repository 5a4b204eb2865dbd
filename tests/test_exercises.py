"""Every instructor solution passes its checker, known wrong answers fail, and every notebook exercise is covered."""
import json
import re
import runpy
from pathlib import Path

import pytest

from dslab import exercises

ROOT = Path(__file__).resolve().parent.parent
SOLUTION_FILES = sorted((ROOT / "notebooks" / "solutions").glob("*_solutions.py"))


def _solutions():
    """(exercise id, answer) for every entry of every notebooks/solutions/NN_solutions.py."""
    found = {}
    for path in SOLUTION_FILES:
        module = runpy.run_path(str(path))
        assert "SOLUTIONS" in module, f"{path.name} must define a SOLUTIONS dict"
        chapter = path.name[:2]
        for exercise_id, answer in module["SOLUTIONS"].items():
            assert exercise_id.startswith(chapter + "."), f"{path.name}: {exercise_id} is not a chapter {chapter} id"
            found[exercise_id] = answer
    return found


SOLUTIONS = _solutions()
IDS = sorted(SOLUTIONS)


def _notebook_exercise_ids():
    """Exercise ids the notebooks pass to check(...), by notebook."""
    ids = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        ids[nb.name] = set(re.findall(r"check\(\s*[\"'](\d\d\.\w+)[\"']", source))
    return ids


def test_each_chapter_has_one_solution_file_with_exactly_its_exercises():
    """notebooks/solutions/NN_solutions.py exists for every notebook NN and solves what chapter NN registers: no
    exercise left unsolved, no answer for an exercise that was renamed or removed."""
    notebooks = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [p.name[:2] for p in SOLUTION_FILES] == notebooks
    registered = exercises.registered()
    for chapter in notebooks:
        solved = {i for i in SOLUTIONS if i.startswith(chapter + ".")}
        known = {i for i in registered if i.startswith(chapter + ".")}
        assert solved == known, f"chapter {chapter}: unsolved {sorted(known - solved)}, stale {sorted(solved - known)}"


@pytest.mark.parametrize("exercise_id", IDS)
def test_solution_is_accepted(exercise_id, capsys):
    assert exercises.check(exercise_id, SOLUTIONS[exercise_id]) is True
    assert capsys.readouterr().out.strip() == "Correct!"


@pytest.mark.parametrize("exercise_id", IDS)
def test_wrong_answers_are_rejected(exercise_id, capsys):
    ex = exercises.get(exercise_id)
    assert ex.wrong, f"{exercise_id}: register at least one wrong answer (wrong=...) so the checker is tested"
    for answer in ex.wrong:
        assert exercises.check(exercise_id, answer) is False, f"{exercise_id} accepted the wrong answer {answer!r}"
        assert capsys.readouterr().out.startswith("Not quite: ")


@pytest.mark.parametrize("exercise_id", IDS)
def test_placeholder_and_garbage_are_not_correct(exercise_id, capsys):
    assert exercises.check(exercise_id, None) is False
    assert capsys.readouterr().out.startswith("No answer yet")
    assert exercises.check(exercise_id, object()) is False


def test_every_exercise_has_a_solution():
    missing = sorted(set(exercises.registered()) - set(SOLUTIONS))
    assert not missing, f"exercises without an entry in notebooks/solutions/NN_solutions.py: {missing}"


def test_every_notebook_check_is_registered_and_solved():
    for notebook, ids in _notebook_exercise_ids().items():
        for exercise_id in ids:
            assert exercise_id[:2] == notebook[:2], f"{notebook} checks {exercise_id} of another chapter"
            exercises.get(exercise_id)  # KeyError if the notebook names an unknown exercise
            assert exercise_id in SOLUTIONS, f"{notebook}: {exercise_id} has no solution"


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="01.ring_gb"):
        exercises.check("01.no_such_exercise", 1)


def test_same_compares_numbers_strings_and_sequences():
    assert exercises.same(24.49, 24.5, rel=1e-2) and not exercises.same(24.0, 24.5, rel=1e-2)
    assert exercises.same(" Gloo ", "gloo") and not exercises.same("nccl", "gloo")
    assert exercises.same((1, 2), [1, 2]) and not exercises.same([2, 1], [1, 2])
    assert exercises.same([3, 1], [1, 3], ordered=False)
    assert not exercises.same(True, 1) and not exercises.same("1", 1) and not exercises.same([1], 1)
    with pytest.raises(ValueError, match="chapter.name"):
        exercises.exercise("ring_gb", hint="")
