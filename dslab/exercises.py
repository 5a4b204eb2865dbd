"""Exercise checkers: `check("01.ring_bytes", answer)` prints Correct! or a hint and returns True/False.

Every exercise has an id "NN.name" (NN = chapter). A chapter registers its checkers with `expect(...)`
(the answer must equal a value) or the `@exercise(...)` decorator (any rule), either here or in the
dslab module that teaches the topic: `check` finds them there by itself. Each exercise also lists a few
`wrong` answers that a learner might give; tests/test_exercises.py makes sure they are rejected and that
the instructor solutions in notebooks/solutions/NN_solutions.py are accepted.
"""
import importlib
import math
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path

_REGISTRY = {}


@dataclass
class Exercise:
    """One exercise: its checker, the hint shown on a wrong answer, and known wrong answers (for tests)."""

    id: str
    checker: object          # callable(answer) -> bool
    hint: str
    wrong: tuple = field(default_factory=tuple)


class Mistake(Exception):
    """Raised by a checker that ran the learner's code: the answer is wrong, and the message names the mistake."""


def exercise(exercise_id, hint, wrong=()):
    """Decorator: register `fn(answer) -> bool` as the checker of `exercise_id`."""
    if not re.fullmatch(r"\d\d\.\w+", exercise_id):
        raise ValueError(f"exercise id {exercise_id!r} should look like '01.ring_bytes' (chapter.name)")

    def register(fn):
        _REGISTRY[exercise_id] = Exercise(exercise_id, fn, hint, tuple(wrong))
        return fn

    return register


def same(answer, expected, rel=1e-3, ordered=True):
    """True if answer equals expected: numbers within `rel`, strings ignoring case and spaces, sequences item by item."""
    if hasattr(answer, "tolist"):                       # torch tensors, numpy arrays
        answer = answer.tolist()
    if isinstance(expected, str):
        return isinstance(answer, str) and answer.strip().lower() == expected.strip().lower()
    if isinstance(expected, (list, tuple, set)):
        if not isinstance(answer, (list, tuple, set)) or len(answer) != len(expected):
            return False
        a, e = (list(answer), list(expected)) if ordered else (sorted(answer), sorted(expected))
        return all(same(x, y, rel) for x, y in zip(a, e))
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return False
    return math.isclose(answer, expected, rel_tol=rel, abs_tol=1e-9)


def expect(exercise_id, expected, hint, wrong=(), rel=1e-3, ordered=True):
    """Register an exercise whose answer must equal `expected` (see `same` for what "equal" means)."""
    exercise(exercise_id, hint, wrong)(lambda answer: same(answer, expected, rel, ordered))


def discover():
    """Import the dslab modules that register exercises, so every chapter's checkers are known."""
    package = Path(__file__).parent
    for info in pkgutil.iter_modules([str(package)]):
        source = package / f"{info.name}.py"
        if info.name != "exercises" and source.exists() and "exercises" in source.read_text(encoding="utf-8"):
            importlib.import_module(f"dslab.{info.name}")


def registered():
    """All known exercises by id (after discovering every chapter's)."""
    discover()
    return dict(sorted(_REGISTRY.items()))


def get(exercise_id):
    """The Exercise registered as `exercise_id`; a KeyError naming the known ids if there is none."""
    if exercise_id not in _REGISTRY:
        discover()
    if exercise_id not in _REGISTRY:
        raise KeyError(f"no exercise {exercise_id!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[exercise_id]


def check(exercise_id, answer):
    """Print whether `answer` solves the exercise (with a hint if not) and return True/False."""
    ex = get(exercise_id)
    if answer is None or answer is ...:
        print("No answer yet: replace None with your answer, then run the cell again.")
        return False
    try:
        ok = bool(ex.checker(answer))
    except Mistake as mistake:  # a code exercise: the checker says what is wrong and why
        print(f"Not quite: {mistake}")
        return False
    except Exception:  # a malformed answer is a wrong answer, not a crash
        ok = False
    print("Correct!" if ok else f"Not quite: {ex.hint}")
    return ok


# ---- Chapter 00: setup -------------------------------------------------------------------------
# A hostfile with 3 machines, slots=2 each; `deepspeed --hostfile hostfile train.py` run once, on one machine.
expect("00.world_size", 6, wrong=(1, 2, 3, 4),
       hint="the launcher is run once, but it starts one process per slot on every machine of the hostfile, "
            "and every process is one rank: machines x slots per machine.")
expect("00.global_rank", 5, wrong=(1, 2, 4, 6),
       hint="ranks are numbered machine by machine, in hostfile order: node_rank x slots_per_machine + local_rank.")

# ---- Chapter 01: distributed basics ------------------------------------------------------------
# 4 ranks, rank r holds torch.arange(8) + r; rank 2 after reduce_scatter(SUM) keeps chunk 2 of the sum.
expect("01.reduce_scatter", [22.0, 26.0], wrong=([4.0, 5.0], [16.0, 20.0], [6.0, 10.0]),
       hint="reduce_scatter computes the same element-wise sum as all_reduce, then cuts it into world_size "
            "equal chunks; rank r keeps chunk r (counting from 0).")
# 7e9 bf16 gradients (2 bytes each) all-reduced by a ring over 8 ranks: 2 (N-1)/N x 14 GB.
expect("01.ring_gb", 24.5, rel=1e-2, wrong=(14.0, 28.0, 12.25, 3.5),
       hint="message = parameters x 2 bytes (bf16); a ring all-reduce sends 2(N-1)/N times the message "
            "from every rank (dslab.comm.ring_allreduce_bytes). Answer in GB (1e9 bytes).")
# 8 ranks, tensor-parallel groups [0,1],[2,3],[4,5],[6,7]; data-parallel groups take one rank from each.
expect("01.dp_group", [1, 3, 5, 7], ordered=False, wrong=([2, 3], [0, 2, 4, 6], [3]),
       hint="find rank 3's position inside its tensor-parallel group, then take the rank at that position "
            "from every tensor-parallel group (rank 3 included).")
