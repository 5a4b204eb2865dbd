"""`dslab workshop plan`: each chapter's measured needs for one learner, scaled to N learners on one server, and the
instructor guides' tables written from the same figures."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import course, messages, workshop

ROOT = Path(__file__).resolve().parents[1]
# tools.measure_chapters measures every chapter but those that run in the frameworks' venvs
MEASURED = [ch.nn for ch in course.CHAPTERS if not ch.framework_venvs]
NEEDS = {"measured_on": {"cpu": "a test CPU", "usable_cores": 2, "memory_gib": 8.0},
         "install": {"venv_mb": 2048, "course_copy_mb": 100},
         "chapters": {"01": {"peak_memory_mb": 1536, "disk_mb": 10, "cpu_seconds": 120, "wall_seconds": 100},
                      "05": {"peak_memory_mb": 3072, "disk_mb": 502, "cpu_seconds": 300, "wall_seconds": 200}}}


def test_n_learners_need_n_times_one_learners_memory_disk_and_cores_at_the_measured_pace():
    rows, totals = workshop.plan(30, NEEDS)
    first, fifth = rows
    assert (first.chapter, first.minutes, first.cores, first.memory_gib, first.disk_gib) == ("01", 1.7, 36.0, 45.0, 0.3)
    assert (fifth.cores, fifth.memory_gib, fifth.disk_gib) == (45.0, 90.0, 14.7)
    # the heaviest chapter sizes the server; the disk: the venv once, then every learner's copy and every output kept
    assert totals == {"cores": 45.0, "memory_gib": 90.0, "venv_gib": 2.0,
                      "disk_gib": round((2048 + 30 * (100 + 10 + 502)) / 1024, 1)}


@pytest.mark.parametrize("learners", [0, -3, 2.5, "30"])
def test_a_learner_count_that_is_not_a_positive_whole_number_is_refused(learners):
    with pytest.raises(ValueError, match="learners must be a whole number >= 1"):
        workshop.plan(learners, NEEDS)


def test_every_chapter_outside_the_frameworks_venvs_has_measured_needs():
    needs = workshop.measured()
    assert list(needs["chapters"]) == MEASURED, "rerun python -m tools.measure_chapters for the chapters it lacks"
    for chapter, one in needs["chapters"].items():
        assert set(one) == {"peak_memory_mb", "disk_mb", "cpu_seconds", "wall_seconds"}, chapter
        assert one["wall_seconds"] > 0 and one["peak_memory_mb"] > 0 and one["cpu_seconds"] > 0, chapter


@pytest.mark.parametrize("lang,guide", [("en", "docs/instructor_guide.md"), ("zh", "docs/instructor_guide.zh.md")])
def test_the_guides_show_the_plan_for_10_30_and_60_learners_from_the_measured_figures(monkeypatch, lang, guide):
    monkeypatch.setenv(messages.LANG_ENV, lang)
    text = (ROOT / guide).read_text(encoding="utf-8")
    shown = text[text.index(workshop.GUIDE_BEGIN) + len(workshop.GUIDE_BEGIN):text.index(workshop.GUIDE_END)]
    assert shown.strip() == workshop.guide_table().strip(), "rerun python -m tools.measure_chapters (or its write_guides)"
    assert all(f"{n} " in shown for n in workshop.GUIDE_COUNTS)


def _dslab(*args):
    return subprocess.run([sys.executable, "-m", "dslab.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "DSLAB_LANG": "en"}, timeout=120)


def test_the_plan_command_prints_every_chapter_and_what_the_server_needs():
    result = _dslab("workshop", "plan", "--learners", "30")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == workshop.format_plan(30).strip()
    rows, totals = workshop.plan(30)
    assert f"server: {totals['cores']} cores and {totals['memory_gib']} GiB" in result.stdout
    shown = [line.split()[0] for line in result.stdout.splitlines()[2:-1]]
    assert shown == [row.chapter for row in rows] == MEASURED


@pytest.mark.parametrize("args,words", [(["workshop", "plan", "--learners", "0"], "--learners must be 1 or more"),
                                        (["workshop", "plan"], "--learners"),
                                        (["workshop"], "COMMAND")])
def test_bad_plan_commands_say_what_to_give(args, words):
    result = _dslab(*args)
    assert result.returncode == 2 and words in result.stderr, result.stderr
