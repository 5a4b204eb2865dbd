"""What a workshop needs from one shared server: each chapter's measured needs for one learner (dslab/chapter_needs.json,
written by `python -m tools.measure_chapters`), scaled to N learners running the same chapter at once.

For one learner and one chapter, as measured: peak memory (PSS of the kernel, its ranks and launchers), the disk it
fills (runs/, checkpoints, compiled kernels), its CPU core-seconds and its wall time on the measuring machine. N
learners at once need N times the memory and disk, and N x core-seconds / wall-seconds cores to keep the measured
pace: with fewer cores every learner's chapter runs proportionally slower (CPU-bound work shares the cores), which is
fine for a demo and painful for a 10-minute exercise. A learner who keeps every chapter's outputs needs the sum of
the chapters' disk.
"""
import json
from dataclasses import dataclass
from pathlib import Path

NEEDS_FILE = Path(__file__).with_name("chapter_needs.json")
MIB_PER_GIB = 1024


def measured():
    """The stored measurements: {"measured_on": {...}, "install": {...}, "chapters": {"NN": {...}}}."""
    return json.loads(NEEDS_FILE.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class ChapterPlan:
    """One chapter's needs for `learners` learners running it at the same time."""

    chapter: str
    minutes: float          # one learner's wall time as measured
    cores: float            # cores busy, on average, for all learners at the measured pace
    memory_gib: float       # peak memory, all learners
    disk_gib: float         # disk filled, all learners


def plan(learners, needs=None):
    """(one ChapterPlan per measured chapter, totals) for `learners` learners at once. totals: the most cores and memory
    any chapter needs, the disk of every chapter's outputs kept by every learner, the venv installed once and every
    learner's copy of the course."""
    if not isinstance(learners, int) or learners < 1:
        raise ValueError(f"learners must be a whole number >= 1, got {learners!r}")
    needs = needs or measured()
    rows = []
    for chapter, one in needs["chapters"].items():
        rows.append(ChapterPlan(chapter, round(one["wall_seconds"] / 60, 1),
                                round(learners * one["cpu_seconds"] / one["wall_seconds"], 1),
                                round(learners * one["peak_memory_mb"] / MIB_PER_GIB, 1),
                                round(learners * one["disk_mb"] / MIB_PER_GIB, 1)))
    install = needs["install"]
    totals = {
        "cores": max(r.cores for r in rows),
        "memory_gib": max(r.memory_gib for r in rows),
        "disk_gib": round((install["venv_mb"] + learners * (install["course_copy_mb"]
                                                           + sum(c["disk_mb"] for c in needs["chapters"].values())))
                          / MIB_PER_GIB, 1),
        "venv_gib": round(install["venv_mb"] / MIB_PER_GIB, 1),
    }
    return rows, totals


def format_plan(learners, needs=None):
    """The plan as text: a row per chapter, then what the server needs in all."""
    needs = needs or measured()
    rows, totals = plan(learners, needs)
    on = needs["measured_on"]
    lines = [f"{learners} learner(s) running the same chapter at once; one learner's run measured on {on['cpu']} "
             f"({on['usable_cores']} usable cores, {on['memory_gib']} GiB)",
             f"{'chapter':<8}{'minutes':>8}{'cores':>8}{'memory GiB':>12}{'disk GiB':>10}"]
    for r in rows:
        lines.append(f"{r.chapter:<8}{r.minutes:>8}{r.cores:>8}{r.memory_gib:>12}{r.disk_gib:>10}")
    lines.append(f"server: {totals['cores']} cores and {totals['memory_gib']} GiB of memory for the heaviest chapter; "
                 f"{totals['disk_gib']} GiB of disk (the venv, {totals['venv_gib']} GiB, installed once; each "
                 "learner's copy of the course and every chapter's outputs)")
    return "\n".join(lines)


GUIDE_COUNTS = (10, 30, 60)
GUIDE_BEGIN = "<!-- workshop plan: written by python -m tools.measure_chapters from dslab/chapter_needs.json -->"
GUIDE_END = "<!-- end of workshop plan -->"


def guide_table(counts=GUIDE_COUNTS, needs=None):
    """The plan for each learner count in `counts`, as the markdown table the instructor guides show (headers in the
    current language; dslab.messages)."""
    from dslab.messages import say

    needs = needs or measured()
    plans = [plan(n, needs) for n in counts]
    head = [say("workshop.chapter"), say("workshop.minutes")]
    head += [say("workshop.for_n", n=n) for n in counts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, chapter in enumerate(needs["chapters"]):
        cells = [chapter, str(plans[0][0][i].minutes)]
        cells += [f"{rows[i].cores} / {rows[i].memory_gib} / {rows[i].disk_gib}" for rows, _ in plans]
        lines.append("| " + " | ".join(cells) + " |")
    cells = [say("workshop.server"), ""]
    cells += [f"{t['cores']} / {t['memory_gib']} / {t['disk_gib']}" for _, t in plans]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
