"""Checkers that run a learner's code on real ranks: N processes started by the deepspeed launcher, one process group.

Kernel side, `run(trial, answers, world_size, case)`: the answers (each a tuple of the learner's functions) travel as
source (dslab.exercises.shipping), one launch of `dslab/drivers/exercise_trial.py` runs `trial(*answer, case=case)`
on every rank for each answer in turn, and each rank's result comes back. What ran is remembered for the rest of the
process, so a test that checks a solution and several wrong answers pays for one launch per world size
(`prepare`), and checking the same code twice does not start ranks twice. Within `batched()`, runs are only noted,
and the block's end starts one launch per world size for all of them: a test session prepares every exercise's
answers that way (starting ranks, not running trials, is what costs on a small machine).

Rank side, `serve(spec_file)`: what the driver calls. An exception in the learner's code becomes the learner's
trimmed traceback (dslab.exercises.feedback), said from the rank it happened on; a `Mistake` raised by the trial, its
message.
"""
import contextlib
import importlib
import io
import json
import tempfile
import traceback
import warnings
from pathlib import Path

from dslab.exercises import CodeError, Mistake, feedback, shipping
from dslab.parallel import tensor_parallel

HANG_TIMEOUT_S = 45     # no rank printing or computing for this long: a collective that not every rank joined
TIMEOUT_S = 900         # one exercise's answers in a launch (ZeRO-3 with offload on 3 ranks of 2 cores included)
_DONE = {}              # (trial, world_size, packed answer) -> (case, [result of each rank]): what ran already
_BATCH = None           # inside batched(): world_size -> {key of an answer to run: (its case, its judge)}


def _key(trial, world_size, packed):
    return trial, world_size, json.dumps(packed, sort_keys=True)


def pack(answer):
    """The answer (a function or a tuple of them) packed for the ranks; a Mistake if it cannot travel."""
    functions = tuple(answer) if isinstance(answer, (tuple, list)) else (answer,)
    try:
        return shipping.pack(functions)
    except shipping.Unshippable as err:
        raise Mistake(f"your code cannot be sent to the ranks: {err}") from None


def cached_case(trial, answer, world_size):
    """The case this exact answer already ran with on world_size ranks (then `run` reuses that run), or None."""
    done = _DONE.get(_key(trial, world_size, pack(answer)))
    return done[0] if done else None


def run(trial, answers, world_size, case, judge=None):
    """[(case, [result of rank 0, 1, ...]) for each answer]: `trial` ("module:function") run on `world_size` launched
    ranks with each answer, in one launch for all the answers that have not run before (those run with `case`).

    judge: (diagnose, the world sizes its checker tries before this one), or None. An answer that diagnose refused on
    one of those is not run on this world size (its check stops at the refusal; its entry is None), and within
    batched() the same holds for the world sizes the batch runs first."""
    keys = [_key(trial, world_size, pack(answer)) for answer in answers]
    todo = list(dict.fromkeys(k for k in keys if k not in _DONE))
    if _BATCH is not None:     # noted; batched() runs it
        for key in todo:
            _BATCH.setdefault(world_size, {}).setdefault(key, (case, judge))
        return None
    todo = [key for key in todo if not _refused_before(key, judge)]
    if todo:
        _run_together(world_size, {key: case for key in todo})
    return [_DONE.get(k) for k in keys]


@contextlib.contextmanager
def batched():
    """Within the block `run` (and so `prepare`) only notes what to run; at its end, one launch per world size runs all
    of it, every trial in turn in the same ranks. A launch that fails as a whole is left out: each of its answers then
    runs in a launch of its own exercise when it is checked."""
    global _BATCH
    outer, _BATCH = _BATCH, {}
    try:
        yield
        pending, _BATCH = _BATCH, outer
        for world_size, notes in sorted(pending.items()):
            cases = {key: case for key, (case, judge) in notes.items() if not _refused_before(key, judge)}
            if not cases:
                continue
            try:
                _run_together(world_size, cases)
            except Mistake as failed:
                warnings.warn(f"the answers batched for {world_size} ranks did not run together ({failed}); "
                              "each exercise's run in a launch of its own when it is checked")
    finally:
        _BATCH = outer


def _refused_before(key, judge):
    """True when the answer of `key` already ran on a world size its checker tries first, and was refused there."""
    if judge is None:
        return False
    diagnose, earlier = judge
    for world_size in earlier:
        done = _DONE.get((key[0], world_size, key[2]))
        if done is None:
            continue
        try:
            diagnose(done[0], verdicts(done[1]))
        except Exception:   # a Mistake, the learner's own error, or a check that failed: the check stops there
            return True
    return False


def _run_together(world_size, cases):
    """One launch on world_size ranks for answers {key: case}, grouped into jobs (one per trial and case)."""
    jobs = {}
    for key, case in cases.items():
        jobs.setdefault((key[0], json.dumps(case, sort_keys=True)), []).append(key)
    specs = [{"trial": trial, "case": json.loads(case), "answers": [json.loads(k[2]) for k in keys]}
             for (trial, case), keys in jobs.items()]
    per_rank = _launch(specs, world_size)
    for j, keys in enumerate(jobs.values()):
        for i, key in enumerate(keys):
            _DONE[key] = (specs[j]["case"], [jobs_of_rank[j][i] for jobs_of_rank in per_rank])


def _launch(jobs, world_size):
    from dslab import launch
    from dslab.hangs import diagnoses

    with tempfile.TemporaryDirectory(prefix="dslab-check-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"jobs": jobs}), encoding="utf-8")
        try:
            with contextlib.redirect_stdout(io.StringIO()):   # the launch prints its command line: not the verdict
                result = launch.run("exercise_trial", world_size=world_size, run_dir=Path(tmp) / "runs", stream=False,
                                    timeout=TIMEOUT_S * len(jobs), hang_timeout=HANG_TIMEOUT_S, spec=str(spec))
        except launch.LaunchError as err:
            report = str(err)
            where = diagnoses.blocked(report)
            if where:
                said = "; ".join(f"rank {r} waits in {w['collective']}" for r, w in sorted(where.items()))
                raise Mistake(f"no rank made progress for {HANG_TIMEOUT_S} s on {world_size} ranks ({said}), so the "
                              "ranks were stopped: a collective that not every rank calls waits forever. Call every "
                              "collective, and everything that calls one (deepspeed.initialize, engine.step), on "
                              "every rank.") from None
            if waits := diagnoses.waiting(report):   # a hang outside any collective: where each rank was
                said = "; ".join(f"rank {r} {w}" for r, w in sorted(waits.items()))
                raise Mistake(f"no rank made progress for {HANG_TIMEOUT_S} s on {world_size} ranks ({said}), so the "
                              "ranks were stopped.") from None
            last = [line.strip() for line in report.splitlines() if line.strip()][-3:]
            raise Mistake(f"the ranks running your code failed on {world_size} ranks: " + " / ".join(last)) from None
    return [rank_result["jobs"] for rank_result in result.results]


def verdicts(results):
    """Raise what the ranks reported for one answer: the learner's traceback (CodeError), a Mistake, or a failure of
    the check itself; return the results when every rank ran the trial through."""
    for rank, result in enumerate(results):
        if "error" in result:
            raise CodeError(result["error"])
        if "mistake" in result:
            raise Mistake(result["mistake"])
        if "failure" in result:
            raise RuntimeError(f"the check failed on rank {rank}:\n{result['failure']}")
    return results


# ---------------------------------------------------------------------------------------------- on each rank

def _run_one(trial, packed, case, where):
    try:
        answers, files = shipping.unpack(packed)
    except Exception as exc:   # the learner's cell itself raised while being rebuilt here
        return {"error": feedback.explain(exc, where=where) or "".join(traceback.format_exception(exc))[-3000:]}
    try:
        return trial(*answers, case=case)
    except Mistake as mistake:
        return {"mistake": str(mistake)}
    except Exception as exc:
        report = feedback.explain(exc, learner_files=files, where=where)
        return {"error": report} if report else {"failure": "".join(traceback.format_exception(exc))[-4000:]}


def serve(spec_file):
    """On every rank: join the process group, run each job's trial on each of its answers;
    {"jobs": [[result of each answer] of each job]}."""
    import torch.distributed as torch_dist

    from dslab import this_rank

    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    rank, world_size = this_rank.init()
    results = []
    for job in spec["jobs"]:
        module, _, name = job["trial"].partition(":")
        trial = getattr(importlib.import_module(module), name)
        results.append([])
        for packed in job["answers"]:
            results[-1].append(_run_one(trial, packed, job["case"], f" on rank {rank} of {world_size}"))
            torch_dist.barrier()   # every rank is done with this answer before the next one starts
        _as_in_a_new_process()
    return {"jobs": results}


def _as_in_a_new_process():
    """Undo what an exercise's engines left in this process's module state, so the next one starts as in a new one."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as zero3_init

    # The parallel groups of a pipeline or AutoTP engine: a ZeRO engine would take them for its own.
    tensor_parallel.forget_groups()
    # A ZeRO-3 engine swaps torch.nn.functional.linear for its own and keeps it there ("This will persist unless
    # manually reset", partition_parameters.py). The flops profiler would then count each linear layer twice, as
    # F.linear and as the matmul inside DeepSpeed's (measured: 1,508,256 FLOPs for 775,584).
    original = getattr(zero3_init, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


# ---------------------------------------------------------------------------------------------- for checkers

WORLD_SIZES = (2, 3)    # a value that holds on 2 ranks only (a hard-coded "/ 2") fails on 3


def prepare(trial, answers, draw_case, world_sizes=WORLD_SIZES, diagnose=None):
    """Run every answer that is code and can travel, one launch per world size, so that checking each of them
    afterwards starts no rank (tests check a solution and its wrong answers this way). With `diagnose` (the check's),
    a batch leaves out the runs that check would never look at: those after a world size that refused the answer."""
    fit = []
    for answer in answers:
        try:
            pack(answer)
        except Mistake:
            continue
        fit.append(answer)
    for i, world_size in enumerate(world_sizes):
        judge = (diagnose, world_sizes[:i]) if diagnose is not None else None
        run(trial, fit, world_size, draw_case(world_size), judge)


def preparer(trial, draw_case, world_sizes=WORLD_SIZES, diagnose=None):
    """The `prepare=` of an exercise whose checker runs `trial` on ranks (dslab.exercises.exercise); pass the
    check's `diagnose` so that a batch runs only what the check will read."""
    return lambda answers: prepare(trial, [a for a in answers if callable(a)], draw_case, world_sizes, diagnose)


def check(trial, answer, draw_case, diagnose, world_sizes=WORLD_SIZES, before=None):
    """The usual checker: for each world size, a case drawn now (sizes, seeds) unless this answer already ran,
    `before(answer, case)` in this process (checks that need no ranks), the trial on the ranks, then
    `diagnose(case, results)`, which raises a Mistake naming what is wrong. True when every world size passes."""
    for world_size in world_sizes:
        case = cached_case(trial, answer, world_size) or draw_case(world_size)
        if before is not None:
            before(answer, case)
        [(case, results)] = run(trial, [answer], world_size, case)
        diagnose(case, verdicts(results))
    return True
