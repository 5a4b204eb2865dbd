"""Exercise checkers: `check("01.ring_bytes", answer)` prints Correct! or what is wrong, and returns True/False.

Every exercise has an id "NN.name" (NN = chapter) and lives in its chapter's module, dslab/exercises/chNN.py,
registered there with `@exercise(...)` (any rule; a checker that runs the learner's code raises `Mistake` naming
what is wrong) or `expect(...)` (the answer must equal a value). Each exercise lists the `wrong` answers learners
give, as pairs (answer, words the message must contain): for `expect`, those words are the message a learner who
gives that answer reads ("Not quite: " + words); for `exercise`, a fragment of the Mistake its checker raises.
tests/test_exercises.py checks that every wrong answer gets its message and that the instructor solutions in
notebooks/solutions/NN_solutions.py are accepted.

What the learner reads: "Correct!"; "Not quite: <the mistake>" (a Mistake, or a registered wrong value);
"Not quite: <hint>" for any other wrong answer; and when their own code raises, their code's traceback, trimmed to
the lines they wrote, with what that error means (dslab/exercises/feedback.py): an error, not a wrong answer.
Checkers that run the learner's code on rank processes use dslab/exercises/on_ranks.py; checkers that judge a
ds_config read it as DeepSpeed does (resolved_config, config_problems, resolved_optimizer, below).
"""
import importlib
import math
import re
from dataclasses import dataclass, field

from dslab import compat, course
from dslab.exercises import feedback, progress

_REGISTRY = {}


@dataclass
class Exercise:
    """One exercise: its checker, the hint shown on a wrong answer, known wrong answers and their messages."""

    id: str
    checker: object          # callable(answer) -> bool, or raises Mistake naming what is wrong
    hint: str
    wrong: tuple = field(default_factory=tuple)   # ((answer, words its message contains), ...)
    prepare: object = None   # callable(answers): run many answers at once, so their checks share rank processes


class Mistake(Exception):
    """Raised by a checker that ran the learner's code: the answer is wrong, and the message names the mistake."""


class CodeError(Exception):
    """The learner's code raised on a rank; the message is the report to show (their traceback, trimmed)."""


def _wrong_pairs(exercise_id, wrong):
    pairs = tuple(wrong)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], str) and pair[1].strip()):
            raise ValueError(f"{exercise_id}: each wrong answer is a pair (answer, words its message contains), "
                             f"got {pair!r}")
    return pairs


def require_valid_config(cfg, world_size, device="cpu", note=""):
    """Mistake unless the learner's ds_config is a dict that dslab.config.check finds nothing wrong with (what
    `dslab config check` would print: up to three problems); `note` is said after "finds"."""
    from dslab.config.check import check_config

    if not isinstance(cfg, dict):
        raise Mistake(f"a ds_config is a dict (the JSON object DeepSpeed reads), got {type(cfg).__name__}")
    problems = check_config(cfg, world_size=world_size, device=device)
    if problems:  # what DeepSpeed would refuse, or silently ignore
        raise Mistake(f"dslab.config.check.check_config finds{note}:\n  " + "\n  ".join(str(p) for p in problems[:3]))


# ----------------------------------------------------------------------------------------------------
# A learner's ds_config as DeepSpeed reads it (the checkers of 02.bf16_config, 09.ds_config, 11.tp_dp_config)
# ----------------------------------------------------------------------------------------------------
# deepspeed 0.19.8, runtime/config.py, DeepSpeedConfig.__init__: the world size is dist.get_world_size() when no mpu
# is given (1 when no process group is up), divided by "sequence_parallel_size" where the config has it; then the
# batch sizes: the missing batch key derived by integer division, and train_batch_size == micro x accumulation x
# world size asserted, each > 0. runtime/engine.py, the engine's basic optimizer (dslab.compat.engine_basic_optimizer
# runs it) and `get_optimizer_configuration`: "Adam" and "AdamW" pop adam_w_mode (default true,
# ADAM_W_MODE_DEFAULT) and build AdamW when the type is AdamW or adam_w_mode is true; torch_adam gives torch.optim's
# AdamW / Adam, an optimizer offload DeepSpeedCPUAdam, else FusedAdam; any other type is getattr(torch.optim, type).
def resolved_config(cfg, world_size):
    """DeepSpeed's own DeepSpeedConfig of `cfg` on `world_size` ranks: the batch sizes it derives, bf16, the ZeRO
    stage, the AutoTP size, the optimizer section, as deepspeed.initialize reads them with no mpu (every rank counts,
    as in data-parallel and AutoTP training). Mistake quoting DeepSpeed if it refuses the config."""
    import copy
    import logging

    from deepspeed.runtime.config import DeepSpeedConfigError

    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)   # it logs the world size and deprecations; a Mistake says what matters
    try:
        return compat.config_on_ranks(copy.deepcopy(cfg), world_size)
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError,
            DeepSpeedConfigError) as err:
        words = " ".join(line.strip() for line in str(err).splitlines()[:3]) or type(err).__name__
        raise Mistake(f"DeepSpeed refuses this config on {world_size} ranks ({type(err).__name__} from its "
                      f"DeepSpeedConfig): {words}") from None
    finally:
        logger.setLevel(level)


def config_problems(cfg, world_size, device="cpu", allow_auto=False):
    """dslab.config.check's problems with `cfg` (what DeepSpeed refuses, or ignores without a word), less the older
    spellings DeepSpeed still reads as the new ones: the "bfloat16" section (runtime/precision_config.py,
    get_bfloat16_config), "zero_optimization": true (runtime/zero/config.py, read_zero_config_deprecated: stage 1) and
    deprecated keys. Whether such a config asks for the task's run is judged from what DeepSpeed resolves."""
    from dslab.config.check import check_config
    from dslab.messages import say

    read_anyway = {say("check.bfloat16_name"), say("check.zero_bool"), say("check.deprecated")}
    return [p for p in check_config(cfg, world_size=world_size, device=device, allow_auto=allow_auto)
            if p.problem not in read_anyway]


def resolved_optimizer(ds_config):
    """(kind, lr, built) of the optimizer the engine builds from a resolved config's "optimizer" section, or None
    without one. kind: "AdamW" or "Adam" for DeepSpeed's Adam family (adam_w_mode defaults to true: "Adam" is AdamW
    unless it is false), else the type as written; lr: the section's "lr", else the default of the class the engine
    builds; built: that class's name (AdamW/Adam with torch_adam, DeepSpeedCPUAdam with an optimizer offload, else
    FusedAdam; torch.optim's class for other types)."""
    import inspect

    import torch
    from deepspeed.runtime.config import ADAM_OPTIMIZER, ADAM_W_MODE, ADAM_W_MODE_DEFAULT, ADAMW_OPTIMIZER

    name = ds_config.optimizer_name
    if name is None:
        return None
    params = dict(ds_config.optimizer_params or {})
    if name in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER):
        adam_w_mode = name == ADAMW_OPTIMIZER or params.get(ADAM_W_MODE, ADAM_W_MODE_DEFAULT)
        kind = "AdamW" if adam_w_mode else "Adam"
        offload = ds_config.zero_config.offload_optimizer
        if params.get("torch_adam", False):
            cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        elif offload is not None and getattr(offload.device, "value", offload.device) in ("cpu", "nvme"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam as cls
        else:
            from deepspeed.ops.adam import FusedAdam as cls
    else:
        kind, cls = name, getattr(torch.optim, str(name), None)
    default = inspect.signature(cls.__init__).parameters.get("lr") if cls is not None else None
    lr = params.get("lr", None if default is None or default.default is inspect.Parameter.empty else default.default)
    return kind, lr, getattr(cls, "__name__", str(name))


def classic_adam_mistake(built):
    """The mistake of a config whose Adam has "adam_w_mode": false (resolved_optimizer's kind "Adam")."""
    return Mistake(f'with "adam_w_mode": false DeepSpeed builds classic Adam ({built}: weight decay added to the '
                   'gradient, L2), not AdamW: leave adam_w_mode out (DeepSpeed\'s "Adam" is AdamW by default) or '
                   'write "type": "AdamW"')


def exercise(exercise_id, hint, wrong=(), prepare=None):
    """Decorator: register `fn(answer) -> bool` as the checker of `exercise_id`.

    wrong: ((answer, words), ...): answers learners give and words of the Mistake the checker names each with.
    prepare: for checkers that start ranks, a callable(answers) that runs them all in one go (tests use it)."""
    if not re.fullmatch(r"\d\d\.\w+", exercise_id):
        raise ValueError(f"exercise id {exercise_id!r} should look like '01.ring_bytes' (chapter.name)")
    pairs = _wrong_pairs(exercise_id, wrong)

    def register(fn):
        _REGISTRY[exercise_id] = Exercise(exercise_id, fn, hint, pairs, prepare)
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


def name_known_mistake(answer, pairs, rel=1e-3, ordered=True):
    """Raise Mistake(words) if `answer` equals the value of one of the (value, words) pairs (see `same`)."""
    for value, mistake in pairs:
        if same(answer, value, rel, ordered):
            raise Mistake(mistake)


def expect(exercise_id, expected, hint, wrong=(), rel=1e-3, ordered=True):
    """Register an exercise whose answer must equal `expected` (see `same` for what "equal" means).

    wrong: ((value, mistake), ...): a learner who answers `value` reads "Not quite: " + mistake, the mistake that
    gives that value (forgot the 1/N, bytes instead of GB, per rank instead of in total, ...); other wrong answers
    read the hint."""
    pairs = _wrong_pairs(exercise_id, wrong)

    def checker(answer):
        if same(answer, expected, rel, ordered):
            return True
        name_known_mistake(answer, pairs, rel, ordered)
        return False

    exercise(exercise_id, hint, pairs)(checker)


def discover():
    """Import every chapter's exercise module (dslab/exercises/chNN.py, from the course map), which registers its
    checkers (and imports the chapter's other exercise modules)."""
    for chapter in course.CHAPTERS:
        importlib.import_module(chapter.exercise_modules[0])


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
    """Print whether `answer` solves the exercise (with a hint if not) and return True/False. The verdict is also
    recorded in the learner's progress file (dslab/exercises/progress.py), which `dslab progress` reads."""
    ex = get(exercise_id)
    if answer is None or answer is ...:
        print("No answer yet: replace None with your answer, then run the cell again.")
        return False
    try:
        ok = bool(ex.checker(answer))
    except Mistake as mistake:  # the checker names what is wrong and why
        print(f"Not quite: {mistake}")
        progress.record(exercise_id, "mistake", str(mistake))
        return False
    except CodeError as error:  # the learner's code raised on a rank: its report was written there
        print(error)
        progress.record(exercise_id, "error", feedback.exception_line(str(error)))
        return False
    except Exception as exc:
        report = feedback.explain(exc)
        if report is None:      # nothing of the learner's in the traceback: a malformed answer, a wrong answer
            ok = False
        else:                   # the learner's own code raised: show where, and what it means
            print(report)
            progress.record(exercise_id, "error", feedback.exception_line(report))
            return False
    print("Correct!" if ok else f"Not quite: {ex.hint}")
    progress.record(exercise_id, "passed" if ok else "hint", "" if ok else ex.hint)
    return ok
