"""The batch of rank checks (dslab.exercises.on_ranks.batched) runs what the checks will read, and only that: an answer
refused on a world size its checker tries first is not run on the next one. Here the launch is replaced by one that
records what it was asked to run and has every rank report which answer it ran; tests/test_exercises.py runs the
same batch on real ranks."""
import pytest

from dslab.exercises import Mistake, on_ranks

TRIAL = "no.module:trial"


def right(x):
    return x


def wrong(x):
    return -x


@pytest.fixture
def launches(monkeypatch):
    """Each launch as (world size, sorted names of the answers it ran)."""
    seen = []

    def launch(jobs, world_size):
        names = [[packed["answers"][0] for packed in job["answers"]] for job in jobs]
        seen.append((world_size, sorted(n for job in names for n in job)))
        return [[[{"answer": name} for name in job] for job in names] for _ in range(world_size)]

    monkeypatch.setattr(on_ranks, "_launch", launch)
    monkeypatch.setattr(on_ranks, "_DONE", {})
    return seen


def draw_case(world_size):
    return {"world_size": world_size}


def diagnose(case, results):
    if results[0]["answer"] == "wrong":
        raise Mistake(f"wrong on {case['world_size']} ranks")


def test_an_answer_refused_on_the_first_world_size_is_not_run_on_the_next(launches):
    with on_ranks.batched():
        on_ranks.prepare(TRIAL, [right, wrong], draw_case, diagnose=diagnose)
    assert launches == [(2, ["right", "wrong"]), (3, ["right"])]
    # what the check then reads ran: the refusal on 2 ranks, and the right answer on both world sizes
    assert on_ranks.cached_case(TRIAL, wrong, 2) == {"world_size": 2}
    assert on_ranks.cached_case(TRIAL, right, 3) == {"world_size": 3}
    with pytest.raises(Mistake, match="wrong on 2 ranks"):
        on_ranks.check(TRIAL, wrong, draw_case, diagnose)
    assert on_ranks.check(TRIAL, right, draw_case, diagnose)
    assert len(launches) == 2   # checking started no rank


def test_without_diagnose_every_answer_runs_on_every_world_size(launches):
    with on_ranks.batched():
        on_ranks.prepare(TRIAL, [right, wrong], draw_case)
    assert launches == [(2, ["right", "wrong"]), (3, ["right", "wrong"])]


def test_only_the_world_sizes_the_checker_tries_first_count(launches):
    # a checker trying 4 ranks, then 3: the batch runs 3 first, and a refusal there must not keep 4 from running
    with on_ranks.batched():
        on_ranks.prepare(TRIAL, [wrong], draw_case, world_sizes=(4, 3), diagnose=diagnose)
    assert launches == [(3, ["wrong"]), (4, ["wrong"])]


def test_preparing_again_after_the_batch_starts_no_rank_for_what_the_check_will_not_read(launches):
    # the tests prepare each exercise once more after the batch, for what a failed batch left out
    with on_ranks.batched():
        on_ranks.prepare(TRIAL, [right, wrong], draw_case, diagnose=diagnose)
    on_ranks.prepare(TRIAL, [right, wrong], draw_case, diagnose=diagnose)
    assert launches == [(2, ["right", "wrong"]), (3, ["right"])]


def test_outside_a_batch_a_refusal_on_two_ranks_is_not_run_on_three(launches):
    on_ranks.prepare(TRIAL, [right, wrong], draw_case, diagnose=diagnose)
    assert launches == [(2, ["right", "wrong"]), (3, ["right"])]
