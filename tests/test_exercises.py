"""Every instructor solution passes its checker; every registered wrong answer is refused with the message that
names its mistake; a hard-coded answer fails every checker that runs the learner's code on inputs it draws; and a
learner's own exception is shown as their traceback, not as a wrong answer."""
import contextlib
import io
import json
import re
import runpy
from pathlib import Path

import pytest

from dslab import exercises
from dslab.exercises import feedback, shipping

import support

ROOT = Path(__file__).resolve().parent.parent
SOLUTION_FILES = sorted((ROOT / "notebooks" / "solutions").glob("*_solutions.py"))
SCALE = 3.0   # a module constant the shipped functions below read


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


# ---------------------------------------------------------------- answers written here, not taken from the kit

def _average_by_two(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2.0                  # the chapter's 2 ranks


def _average_with_a_typo(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_wrold_size()


def _loop_divided_by_four(model, micro_batches):
    for micro_batch in micro_batches:
        (model(**micro_batch).loss / 4).backward()


def _token_loss_of_one_window(model, micro_batch, window_targets):
    from dslab.training.accumulation import count_targets

    return model(**micro_batch).loss * count_targets(micro_batch) / 100


def _amp_step_clipping_to_1e4(model, optimizer, scaler, x, y, max_norm):
    return SOLUTIONS["02.amp_clip"](model, optimizer, scaler, x, y, 1e-4)   # the right step, max_norm written in


def _model(d_in, d_out):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(d_in, 5), torch.nn.Sigmoid(), torch.nn.Linear(5, d_out))


def _config_for_two_ranks(micro_batch_size, grad_accum_steps, world_size, lr):
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum_steps,
            "train_batch_size": micro_batch_size * grad_accum_steps * 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": lr}}}


def _offload_config_for_two_ranks(micro_batch_size, grad_accum_steps, world_size, lr):
    offload = {"device": "cpu"}
    return {**_config_for_two_ranks(micro_batch_size, grad_accum_steps, world_size, lr),
            "zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": offload}}


def _train(model, ds_config, micro_batches):
    import deepspeed
    import torch.nn.functional as F

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in micro_batches:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def _mask_of_one_chat(tokenizer, messages):
    ids = tokenizer.encode("<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\nI am Xiao Hai.<|im_end|>\n")
    return {"input_ids": ids, "labels": [-100] * 10 + ids[10:]}


def _merge_scaled_by_two(peft_model):
    import torch

    with torch.no_grad():   # W + 2 B A: the usual alpha / r, written in
        for module in peft_model.modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                module.base_layer.weight += 2.0 * module.lora_B["default"].weight @ module.lora_A["default"].weight
    return peft_model.unload()


HARD_CODED_CONFIG = {   # one process's train_batch_size written in: the Trainer computes 16 on the chapter's 2 ranks
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 8,
    "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}
PRINTS_THE_ANSWER = '''\
import deepspeed
import torch
import torch.distributed as dist

deepspeed.init_distributed(dist_backend="gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
samples = torch.arange(1.0, 6.0)
if rank == 0:
    print("mean 3.0000 over 5 samples", flush=True)
'''
# For each checker that runs the learner's code on inputs it draws: an answer that holds for the chapter's numbers
# only (2 ranks, 4 micro-batches, max_norm 1e-4, alpha / r = 2, the task's Trainer arguments, the script's samples).
HARD_CODED = {
    "01.average_gradients": _average_by_two,
    "02.amp_clip": _amp_step_clipping_to_1e4,
    "03.fix_loop": _loop_divided_by_four,
    "03.token_loss": _token_loss_of_one_window,
    "03.engine_loop": (_model, _config_for_two_ranks, _train),
    "04.offload_loop": (_model, _offload_config_for_two_ranks, _train),
    "05.mask_prompt": _mask_of_one_chat,
    "06.merge_call": _merge_scaled_by_two,
    "09.ds_config": HARD_CODED_CONFIG,
    "12.uneven_fix": PRINTS_THE_ANSWER,
}
# Answers checked on ranks that the tests below add, run in the same launches as each exercise's solution.
EXTRA = {"01.average_gradients": [_average_with_a_typo]}


def _prepare_answers(ex):
    """Run the solution and every known answer of an exercise that starts ranks (later checks reuse the runs)."""
    answers = [SOLUTIONS[ex.id], *(a for a, _ in ex.wrong), *EXTRA.get(ex.id, [])]
    if ex.id in HARD_CODED:
        answers.append(HARD_CODED[ex.id])
    ex.prepare(answers)


def prepare_all_on_ranks():
    """The exercises of this file that start ranks, prepared (within support.run_rank_exercises_together)."""
    for exercise_id in IDS:
        if exercises.get(exercise_id).prepare is not None:
            _prepare_answers(exercises.get(exercise_id))


def _prepared(exercise_id):
    """The exercise; one that starts ranks has every known answer run first, those of all such exercises together."""
    ex = exercises.get(exercise_id)
    if ex.prepare is not None:
        support.run_rank_exercises_together()
        _prepare_answers(ex)    # what the batch could not run (it failed as a whole) runs now, per exercise
    return ex


def _said(exercise_id, answer):
    """(check's verdict, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        verdict = exercises.check(exercise_id, answer)
    return verdict, out.getvalue()


def _notebook_exercise_ids():
    """Exercise ids the notebooks pass to check(...), by notebook."""
    ids = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        ids[nb.name] = set(re.findall(r"check\(\s*[\"'](\d\d\.\w+)[\"']", source))
    return ids


# ---------------------------------------------------------------------------------------------- every exercise

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
def test_solution_is_accepted(exercise_id):
    _prepared(exercise_id)
    verdict, said = _said(exercise_id, SOLUTIONS[exercise_id])
    assert verdict is True and said.strip() == "Correct!", said


@pytest.mark.parametrize("exercise_id", IDS)
def test_wrong_answers_are_refused_naming_their_mistake(exercise_id):
    ex = _prepared(exercise_id)
    assert ex.wrong, f"{exercise_id}: register at least one wrong answer (wrong=...) so the checker is tested"
    for answer, words in ex.wrong:
        verdict, said = _said(exercise_id, answer)
        assert verdict is False, f"{exercise_id} accepted the wrong answer {answer!r}"
        assert said.startswith("Not quite: "), said
        assert words in said, f"{exercise_id}: expected the mistake {words!r}, got:\n{said}"


@pytest.mark.parametrize("exercise_id", sorted(HARD_CODED))
def test_a_hard_coded_answer_fails(exercise_id):
    _prepared(exercise_id)
    verdict, said = _said(exercise_id, HARD_CODED[exercise_id])
    assert verdict is False and said.startswith("Not quite: "), said


@pytest.mark.parametrize("exercise_id", IDS)
def test_placeholder_and_garbage_are_not_correct(exercise_id):
    assert _said(exercise_id, None) == (False, "No answer yet: replace None with your answer, then run the cell again.\n")
    verdict, said = _said(exercise_id, object())
    assert verdict is False and said.startswith("Not quite: "), said


def test_every_exercise_has_a_solution():
    missing = sorted(set(exercises.registered()) - set(SOLUTIONS))
    assert not missing, f"exercises without an entry in notebooks/solutions/NN_solutions.py: {missing}"


def test_every_notebook_check_is_registered_and_solved():
    for notebook, ids in _notebook_exercise_ids().items():
        for exercise_id in ids:
            assert exercise_id[:2] == notebook[:2], f"{notebook} checks {exercise_id} of another chapter"
            exercises.get(exercise_id)  # KeyError if the notebook names an unknown exercise
            assert exercise_id in SOLUTIONS, f"{notebook}: {exercise_id} has no solution"


# ---------------------------------------------------------------------------------------------- particular rules

def test_hostfile_command_accepts_every_line_that_selects_the_gpus():
    """Not only the instructor's: a hostfile listing only the slots to use, --exclude, --include with every slot
    spelled out, and a CUDA_VISIBLE_DEVICES prefix the runner ignores all start the same 6 ranks."""
    from dslab.exercises import ch08

    right = ch08.OTHER_RIGHT_HOSTFILE_COMMANDS + ({"hostfile": "worker-1 slots=4\nworker-0 slots=2\n",
                                                   "command": "deepspeed --master_port=29600 -H hf train.py"},)
    for answer in right:
        assert _said("08.hostfile_command", answer) == (True, "Correct!\n"), answer


def test_a_registered_wrong_value_says_its_mistake_and_others_the_hint():
    assert _said("04.zero2_gb", 208) == (False, "Not quite: " + dict(exercises.get("04.zero2_gb").wrong)[208.0] + "\n")
    assert _said("04.zero2_gb", 123.0) == (False, "Not quite: " + exercises.get("04.zero2_gb").hint + "\n")


def test_wrong_answers_are_registered_as_pairs_with_their_words():
    for bad in ((1, 2), ((1, ""),), ([1, "words"],)):
        with pytest.raises(ValueError, match="pair"):
            exercises.expect("99.old_style", 3, hint="", wrong=bad)


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


# ---------------------------------------------------------------------------------------------- the learner's errors

def _loop_with_a_typo(model, micro_batches):
    for micro_batch in micro_batches:
        loss = model(**micro_batch).loss / len(micro_batchs)  # noqa: F821 (the learner's typo)
        loss.backward()


def test_a_learners_exception_is_shown_as_their_traceback():
    verdict, said = _said("03.fix_loop", _loop_with_a_typo)
    lines = said.splitlines()
    assert verdict is False and lines[0] == feedback.HEADER, said
    assert "tests/test_exercises.py, line" in said and "in _loop_with_a_typo" in said
    assert "loss = model(**micro_batch).loss / len(micro_batchs)" in said
    assert "NameError: name 'micro_batchs' is not defined" in said
    assert lines[-1] == "What it means: " + feedback.MEANINGS["NameError"]
    assert "dslab/" not in said and "site-packages" not in said and "Not quite" not in said


def test_a_learners_exception_on_a_rank_is_shown_as_their_traceback():
    _prepared("01.average_gradients")
    verdict, said = _said("01.average_gradients", _average_with_a_typo)
    assert verdict is False and said.startswith("Your code raised an error on rank 0 of 2"), said
    assert "tests/test_exercises.py, line" in said and "p.grad /= dist.get_wrold_size()" in said
    assert "AttributeError" in said and "What it means: " + feedback.MEANINGS["AttributeError"] in said
    assert "dslab/" not in said and "site-packages" not in said


# ---------------------------------------------------------------------------------------------- code sent to ranks

class _Doubler:
    def __init__(self, k):
        self.k = k

    def apply(self, x):
        return _helper(x) * self.k


def _helper(x):
    return x * SCALE


def _uses_everything(x):
    import math

    return math.floor(_Doubler(2).apply(x) + json.loads("1"))


def _fails(x):
    return _helper(x) / 0


def test_shipping_rebuilds_functions_with_what_they_use_at_their_own_lines():
    packed = json.loads(json.dumps(shipping.pack([_uses_everything, _fails])))   # what travels is JSON
    kinds = {c["name"]: c["kind"] for c in packed["chunks"]}
    assert kinds == {"_helper": "source", "SCALE": "value", "_Doubler": "source", "json": "import",
                     "_uses_everything": "source", "_fails": "source"}
    (uses, fails), files = shipping.unpack(packed)
    assert uses(1.5) == 10 and uses.__code__.co_firstlineno == _uses_everything.__code__.co_firstlineno
    with pytest.raises(ZeroDivisionError) as raised:
        fails(1.0)
    report = feedback.explain(raised.value, learner_files=files)
    assert "tests/test_exercises.py, line" in report and "in _fails" in report and "return _helper(x) / 0" in report
    with pytest.raises(shipping.Unshippable, match="lambda"):
        shipping.pack([lambda x: x])


def test_shipping_sends_a_partial_as_its_function_and_bound_values():
    import functools

    bound = functools.partial(_uses_everything_scaled, 3, offset=0.5)
    packed = json.loads(json.dumps(shipping.pack([bound])))
    assert "partial" in {c["kind"] for c in packed["chunks"]}
    (rebuilt,), _ = shipping.unpack(packed)
    assert isinstance(rebuilt, functools.partial) and rebuilt(2.0) == bound(2.0) == 6.5
    unsendable = functools.partial(_uses_everything_scaled, object())
    with pytest.raises(KeyError):           # left out, as any object that is neither source, literal nor importable
        shipping.unpack(json.loads(json.dumps(shipping.pack([unsendable]))))


def _uses_everything_scaled(factor, x, offset=0.0):
    return factor * x + offset
