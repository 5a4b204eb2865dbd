"""The learner's progress file (dslab/exercises/progress.py): every check records its verdict, `dslab progress`
prints the learner's table, and `--collect` gathers many learners' files into the instructor's view."""
import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import exercises
from dslab.exercises import progress

ROOT = Path(__file__).resolve().parents[1]
RING_GB = 24.5   # 01.ring_gb's answer: a ring all-reduce of 14 GB on 8 ranks sends 2(N-1)/N x 14 GB per rank


@pytest.fixture
def progress_path(tmp_path, monkeypatch):
    path = tmp_path / "home" / ".dslab" / progress.FILE_NAME
    monkeypatch.setenv(progress.PROGRESS_ENV, str(path))
    return path


def _verdicts(path):
    return [(e.exercise, e.verdict, e.detail) for e in progress.read(path)]


def test_each_check_records_its_verdict_with_the_named_mistake(progress_path, capsys):
    ring = exercises.get("01.ring_gb")
    wrong_value, words = ring.wrong[0]
    assert not exercises.check("01.ring_gb", wrong_value)               # a registered mistake
    assert not exercises.check("01.ring_gb", "not a number")            # wrong, not named: the hint
    assert not exercises.check("01.ring_gb", None)                      # no answer yet: nothing recorded
    assert exercises.check("01.ring_gb", RING_GB)
    recorded = _verdicts(progress_path)
    assert [v for _, v, _ in recorded] == ["mistake", "hint", "passed"]
    assert words in recorded[0][2] and recorded[1][2] == ring.hint.splitlines()[0][:progress.MISTAKE_CHARS]
    entry = json.loads(progress_path.read_text(encoding="utf-8").splitlines()[0])
    assert set(entry) == {"exercise", "verdict", "detail", "time", "learner"} and entry["learner"]


def test_a_learners_own_exception_is_recorded_as_an_error_with_its_type(progress_path, capsys):
    def broken_answer(*args, **kwargs):
        return undefined_name  # noqa: F821

    # 03.fix_loop's checker calls the learner's function in this process: its NameError is the learner's
    exercises.check("03.fix_loop", broken_answer)
    (exercise_id, verdict, detail), = _verdicts(progress_path)
    assert (exercise_id, verdict) == ("03.fix_loop", "error") and detail.startswith("NameError"), detail


def test_an_unwritable_progress_file_never_stops_the_check(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(progress.PROGRESS_ENV, str(blocker / "progress.jsonl"))   # its folder is a file
    assert exercises.check("01.ring_gb", RING_GB)
    exercises.check("01.ring_gb", RING_GB)
    out = capsys.readouterr().out
    assert out.count("Correct!") == 2 and out.count("progress not recorded") == 1, out
    assert progress.PROGRESS_ENV in out


def _append_many(path, worker):
    for i in range(200):
        progress.record(f"01.ex{worker}", "mistake", f"worker {worker} line {i} " + "x" * 120, path=path)


def test_lines_from_notebooks_checking_at_once_never_interleave(tmp_path):
    path = tmp_path / progress.FILE_NAME
    workers = [multiprocessing.get_context("spawn").Process(target=_append_many, args=(path, w)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 800 and all(json.loads(line)["verdict"] == "mistake" for line in lines)


def test_a_line_cut_short_is_skipped_and_the_rest_read(tmp_path):
    path = tmp_path / progress.FILE_NAME
    progress.record("01.ring_gb", "passed", path=path)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"exercise": "02.bf16_config", "verd')
    assert _verdicts(path) == [("01.ring_gb", "passed", "")]


def _learner_file(home, name, checks):
    path = home / name / ".dslab" / progress.FILE_NAME
    for exercise_id, verdict, detail in checks:
        progress.record(exercise_id, verdict, detail, path=path)
    # the recorded name is the login name of whoever ran the checks; a real learner's file carries their own
    lines = [json.loads(line) | {"learner": name} for line in path.read_text(encoding="utf-8").splitlines()]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def _dslab(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dslab.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_the_instructor_sees_who_passed_what_and_the_commonest_mistake(tmp_path):
    homes = tmp_path / "home"
    forgot = "forgot the factor 2 of a ring all-reduce"
    _learner_file(homes, "ana", [("01.ring_gb", "mistake", forgot), ("01.ring_gb", "passed", ""),
                                 ("02.bf16_config", "passed", "")])
    _learner_file(homes, "bo", [("01.ring_gb", "mistake", forgot), ("01.ring_gb", "mistake", forgot),
                                ("01.ring_gb", "hint", "the hint")])
    shared = tmp_path / "shared"
    shared.mkdir()
    _learner_file(tmp_path / "elsewhere", "chen", [("02.bf16_config", "mistake", "no bf16 section"),
                                                   ("01.ring_gb", "mistake", forgot)]).rename(shared / "chen.progress.jsonl")
    plot = tmp_path / "class.png"
    result = _dslab("progress", "--collect", str(homes), str(shared), "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "3 progress file(s), 3 learner(s)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert rows["ana"][1:3] == ["2", "0"]
    assert rows["bo"][1:4] == ["0", "1", "01.ring_gb"] and forgot in out
    assert rows["chen"][1:4] == ["0", "2", "01.ring_gb"]
    assert rows["01.ring_gb"][1:3] == ["1", "2"] and forgot in " ".join(rows["01.ring_gb"])
    assert rows["02.bf16_config"][1:3] == ["1", "1"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_learner_sees_every_exercise_in_course_order(progress_path):
    progress.record("02.bf16_config", "mistake", "no bf16 section", path=progress_path)
    progress.record("01.ring_gb", "passed", path=progress_path)
    result = _dslab("progress", env={progress.PROGRESS_ENV: str(progress_path)})
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\d\d\.\w+(\s|$)", line)]
    assert [row[0] for row in rows] == list(exercises.registered())
    assert rows[[row[0] for row in rows].index("01.ring_gb")][1:3] == ["passed", "1"]
    assert "no bf16 section" in result.stdout
    assert f"passed 1 of {len(exercises.registered())} exercises; 1 tried and not passed yet" in result.stdout


@pytest.mark.parametrize("args,words", [
    (["progress", "--collect", "/no/such/folder"], "no such folder"),
    (["progress", "--plot", "x.png"], "--collect"),
])
def test_bad_progress_commands_say_what_to_give(args, words):
    result = _dslab(*args)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def test_one_mistake_met_with_other_numbers_counts_once_per_learner():
    entries = [progress.Entry(learner, "03.engine_loop", "mistake", f"train_batch_size {n} but micro x accum x "
                              f"world = {2 * n}", "") for learner, n in (("ana", 6), ("bo", 12), ("bo", 9))]
    entries.append(progress.Entry("chen", "03.engine_loop", "mistake", "no bf16 section", ""))
    (exercise_id, wording, learners), (_, other, one) = progress.common_mistakes(entries)
    assert (exercise_id, learners, other, one) == ("03.engine_loop", 2, "no bf16 section", 1)
    assert wording == "train_batch_size 6 but micro x accum x world = 12"   # as the first learner met it


def test_one_login_in_several_homes_is_told_apart_by_the_home_folder(tmp_path):
    # JupyterHub's containers: every learner may log in as the same user (jovyan)
    paths = []
    for home in ("ana", "bo"):
        path = tmp_path / home / ".dslab" / progress.FILE_NAME
        progress.record("01.ring_gb", "passed", path=path)
        paths.append(path)
    assert {e.learner for e in progress.read_many(paths)} == {f"{progress.learner_name()} ({home})"
                                                              for home in ("ana", "bo")}


def test_a_plot_that_cannot_be_written_is_an_error_after_the_tables(tmp_path):
    _learner_file(tmp_path / "home", "ana", [("01.ring_gb", "passed", "")])
    result = _dslab("progress", "--collect", str(tmp_path / "home"), "--plot", "/proc/class.png")
    assert result.returncode == 1 and "--plot /proc/class.png" in result.stderr, result.stderr
    assert "1 progress file(s), 1 learner(s)" in result.stdout
