"""Every coding exercise (one whose instructor solution in notebooks/solutions is a function, a tuple of functions or
a script) is red-teamed: across what the tests refuse and accept, it has at least three wrong answers, at least one
of them hard-coded or copying a reference, and at least two right answers other than the instructor's solution.

Counted from: the wrong answers each exercise registers (tests/test_exercises.py refuses each with its words), the
HARD_CODED answers of tests/test_exercises.py, and the REDTEAM declaration of each red-team module below:
    REDTEAM = {exercise_id: {"wrong": [(answer, words), ...], "right": [answer, ...], "hard_coded": [answer, ...]}}
(each module's tests run what it declares; a hard-coded answer is also one of the wrong answers somewhere). A module
that is missing fails the test of each exercise left short, naming it. Nothing is run here: it only counts."""
import functools
import importlib
import json
from pathlib import Path

import pytest

from dslab import exercises

import test_exercises

SOLUTIONS_DIR = (Path(__file__).resolve().parent.parent / "notebooks" / "solutions").resolve()
RED_TEAMS = ("test_exercise_judging", "test_redteam_ranks_a", "test_redteam_ranks_b", "test_redteam_ranks_c",
             "test_redteam_inprocess")
KINDS = ("wrong", "right", "hard_coded")
AT_LEAST = {"wrong": 3, "hard_coded": 1, "right": 2}


def _is_coding(solution):
    if isinstance(solution, str):
        return "\n" in solution.strip()                  # a script, not a one-word answer
    if isinstance(solution, tuple):
        return bool(solution) and all(callable(part) for part in solution)
    return callable(solution)


CODING = sorted(e for e, solution in test_exercises.SOLUTIONS.items() if _is_coding(solution))


@functools.lru_cache(maxsize=None)
def _red_teams():
    """{module name: its REDTEAM, or the reason there is none (a str)}."""
    found = {}
    for name in RED_TEAMS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            found[name] = f"tests/{name}.py is missing"
            continue
        found[name] = getattr(module, "REDTEAM", f"tests/{name}.py declares no REDTEAM")
    return found


def _key(answer):
    """Identity of an answer: the objects themselves for code (two red teams naming one function count it once),
    the value for data (a script, a config)."""
    if isinstance(answer, tuple) and answer and all(callable(part) for part in answer):
        return ("parts",) + tuple(_key(part) for part in answer)
    if callable(answer):
        return ("code", id(answer))
    return ("value", json.dumps(answer, sort_keys=True, default=repr))


def _from_solutions(part):
    """Whether a function (or a partial or method of one) is defined in notebooks/solutions/."""
    while isinstance(part, functools.partial):
        part = part.func
    code = getattr(getattr(part, "__func__", part), "__code__", None)
    return code is not None and Path(code.co_filename).resolve().parent == SOLUTIONS_DIR


def _is_the_solution(answer, solution):
    if _key(answer) == _key(solution):
        return True
    parts = answer if isinstance(answer, tuple) else (answer,)
    return all(callable(part) and _from_solutions(part) for part in parts)


def answers(exercise_id, red_teams):
    """{"wrong", "right", "hard_coded": {key: answer}} of an exercise, over every source; the right answers less the
    instructor's solution."""
    found = {kind: {} for kind in KINDS}
    for answer, _ in exercises.get(exercise_id).wrong:
        found["wrong"][_key(answer)] = answer
    if exercise_id in test_exercises.HARD_CODED:
        hard = test_exercises.HARD_CODED[exercise_id]
        found["wrong"][_key(hard)] = found["hard_coded"][_key(hard)] = hard
    for team in red_teams.values():
        if not isinstance(team, dict) or exercise_id not in team:
            continue
        declared = team[exercise_id]
        for answer, _ in declared.get("wrong", ()):
            found["wrong"][_key(answer)] = answer
        for kind in ("right", "hard_coded"):
            for answer in declared.get(kind, ()):
                found[kind][_key(answer)] = answer
    solution = test_exercises.SOLUTIONS[exercise_id]
    found["right"] = {k: a for k, a in found["right"].items() if not _is_the_solution(a, solution)}
    return found


def shortfall(exercise_id, red_teams):
    """What the exercise lacks, in words ([] when nothing)."""
    found = answers(exercise_id, red_teams)
    what = {"wrong": "wrong answers", "hard_coded": "hard-coded or reference-copying wrong answers",
            "right": "right answers other than the solution"}
    return [f"{what[kind]}: {len(found[kind])} (at least {least})" for kind, least in AT_LEAST.items()
            if len(found[kind]) < least]


def test_the_coding_exercises_are_those_the_solutions_write_code_for():
    assert {"02.amp_clip", "03.engine_loop", "12.uneven_fix", "14.trainer_steps"} <= set(CODING)
    assert not {"02.bf16_config", "09.ds_config", "08.hostfile_command", "00.world_size"} & set(CODING)
    assert set(CODING) <= set(exercises.registered())


@pytest.mark.parametrize("module", RED_TEAMS)
def test_each_red_team_declares_what_it_tests(module):
    """The module is there and declares REDTEAM: registered ids, each with wrong (answer, words) pairs, right
    answers and hard-coded ones, nothing else."""
    team = _red_teams()[module]
    assert not isinstance(team, str), team
    assert isinstance(team, dict) and team, f"{module}.REDTEAM: a dict by exercise id"
    for exercise_id, declared in team.items():
        exercises.get(exercise_id)   # KeyError naming the known ids for an unknown one
        assert isinstance(declared, dict) and set(declared) <= set(KINDS), \
            f"{module}.REDTEAM[{exercise_id!r}]: a dict of {KINDS}, got {declared!r}"
        for pair in declared.get("wrong", ()):
            assert isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], str) and pair[1].strip(), \
                f"{module}.REDTEAM[{exercise_id!r}]['wrong']: (answer, words of its mistake) pairs, got {pair!r}"
        for kind in ("right", "hard_coded"):
            assert isinstance(declared.get(kind, []), (list, tuple)), f"{module}.REDTEAM[{exercise_id!r}][{kind!r}]"


@pytest.mark.parametrize("exercise_id", CODING)
def test_each_coding_exercise_is_red_teamed(exercise_id):
    red_teams = _red_teams()
    missing = [why for why in red_teams.values() if isinstance(why, str)]
    short = shortfall(exercise_id, red_teams)
    assert not short, (f"{exercise_id} has " + "; ".join(short) + ": add them to a red-team module's REDTEAM"
                       + (f" ({'; '.join(missing)})" if missing else ""))


@pytest.mark.parametrize("exercise_id", CODING)
def test_hard_coded_answers_are_refused_and_right_ones_are_not(exercise_id):
    """A hard-coded answer is also a wrong answer (so a test refuses it); no answer is declared both wrong and right,
    nor is the solution declared wrong."""
    found = answers(exercise_id, _red_teams())
    untested = [found["hard_coded"][k] for k in set(found["hard_coded"]) - set(found["wrong"])]
    assert not untested, f"{exercise_id}: hard-coded answers that no red team refuses: {untested}"
    assert not set(found["right"]) & set(found["wrong"]), f"{exercise_id}: an answer declared both right and wrong"
    solution = test_exercises.SOLUTIONS[exercise_id]
    assert not any(_is_the_solution(a, solution) for a in found["wrong"].values()), \
        f"{exercise_id}: the instructor's solution is declared wrong"


def test_an_exercise_short_of_answers_is_named(monkeypatch):
    """The rule bites: an exercise with the least it needs passes; one right answer, the hard-coded one or a wrong
    one less, or the solution counted as a right answer, and it falls short, named."""
    mine = _red_teams()["test_redteam_inprocess"]["14.trainer_steps"]
    solution = test_exercises.SOLUTIONS["14.trainer_steps"]
    least = {"wrong": mine["wrong"][:1], "right": mine["right"][:2], "hard_coded": mine["hard_coded"][:1]}
    assert mine["hard_coded"][0] is mine["wrong"][0][0]

    def short(**changes):
        return shortfall("14.trainer_steps", {"a red team": {"14.trainer_steps": {**least, **changes}}})

    assert len(exercises.get("14.trainer_steps").wrong) >= 2 and "14.trainer_steps" not in test_exercises.HARD_CODED
    assert short() == []
    assert short(right=least["right"][:1]) == ["right answers other than the solution: 1 (at least 2)"]
    assert short(right=[solution, least["right"][0]]) == ["right answers other than the solution: 1 (at least 2)"]
    assert short(hard_coded=[]) == ["hard-coded or reference-copying wrong answers: 0 (at least 1)"]
    assert shortfall("14.trainer_steps", {}) == ["hard-coded or reference-copying wrong answers: 0 (at least 1)",
                                                 "right answers other than the solution: 0 (at least 2)"]
    monkeypatch.setattr(exercises.get("14.trainer_steps"), "wrong", exercises.get("14.trainer_steps").wrong[:1])
    assert short() == ["wrong answers: 2 (at least 3)"]
