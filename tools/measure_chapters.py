"""Measure what one learner's run of each chapter needs from a machine, and store it where `dslab workshop plan`
reads it (dslab/chapter_needs.json).

Course tooling, run from the repository root on a quiet machine (nothing else running), after a chapter changed:

    python -m tools.measure_chapters            every English chapter but those run in the frameworks' venvs (14)
    python -m tools.measure_chapters 05 07      only these; the others keep their stored figures

Each chapter runs top to bottom as tools.record runs it (into a scratch folder: the stored outputs are left alone),
while a sampler reads, every half second, every process this one started (the kernel, its live ranks, launched
ranks and their launchers):
- peak memory: the largest sum of their proportional set sizes (PSS: a page shared by N processes counts 1/N to
  each, so libraries mapped by every rank are not counted once per rank);
- disk: the bytes of every file under notebooks/runs/ the chapter wrote (what a learner keeps: checkpoints,
  adapters, merged models, logs; counted whole even where an earlier run left a file of that name), plus the largest
  growth of the disk's used bytes beyond that while it ran (temporary files, compiled kernels);
- CPU: core-seconds, user + system, of the kernel and every process it reaped (getrusage of the children);
- wall: seconds from the first cell to the last.
"""
import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from dslab import course
from dslab.workshop import NEEDS_FILE
from tools.record import ROOT, chapters, record

INTERVAL_S = 0.5


class Sampler(threading.Thread):
    """Peak PSS of this process's descendants and peak growth of the disk's used bytes, sampled until stopped."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stopped = threading.Event()
        self.peak_pss = 0
        self.disk_start = shutil.disk_usage(ROOT).used
        self.peak_disk = 0

    def run(self):
        import psutil

        me = psutil.Process()
        while not self.stopped.wait(INTERVAL_S):
            pss = 0
            for proc in me.children(recursive=True):
                try:
                    pss += proc.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue    # it ended between the listing and the reading
            self.peak_pss = max(self.peak_pss, pss)
            self.peak_disk = max(self.peak_disk, shutil.disk_usage(ROOT).used - self.disk_start)


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _runs_files(runs):
    """{path: (mtime, size)} of every file under the chapters' runs folder."""
    found = {}
    for dirpath, _, filenames in os.walk(runs):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            found[os.path.join(dirpath, name)] = (st.st_mtime_ns, st.st_size)
    return found


def measure(path):
    """{"peak_memory_mb", "disk_mb", "cpu_seconds", "wall_seconds"} of one run of the chapter at `path`."""
    runs = path.parent / "runs"
    before = _runs_files(runs)
    sampler = Sampler()
    cpu_start, wall_start = _children_cpu(), time.monotonic()
    sampler.start()
    try:
        with tempfile.TemporaryDirectory(prefix="dslab-measure-") as scratch:
            record(path, scratch)
    finally:
        sampler.stopped.set()
        sampler.join()
    after = _runs_files(runs)
    kept = sum(size for name, (mtime, size) in after.items() if before.get(name, (None,))[0] != mtime)
    net = sum(size for _, size in after.values()) - sum(size for _, size in before.values())
    disk = kept + max(sampler.peak_disk - net, 0)     # kept, and the temporary files beyond what the runs grew by
    mib = 2 ** 20
    return {"peak_memory_mb": round(sampler.peak_pss / mib), "disk_mb": round(disk / mib),
            "cpu_seconds": round(_children_cpu() - cpu_start), "wall_seconds": round(time.monotonic() - wall_start)}


def install_facts():
    """What is installed once for every learner (the venv) and what each learner's own copy of the course takes."""
    def size_mb(folder, skip=()):
        total = 0
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]
            total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in filenames)
        return round(total / 2 ** 20)

    skip = {str(ROOT / name) for name in (".venv", ".venv-swift", ".venv-llamafactory", ".git", "build")}
    skip |= {str(ROOT / "notebooks" / "runs")}
    return {"venv_mb": size_mb(ROOT / ".venv"), "course_copy_mb": size_mb(ROOT, skip)}


def main(argv=None):
    from dslab.machine import cpu_info, memory_info

    parser = argparse.ArgumentParser(prog="python -m tools.measure_chapters", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*",
                        help="chapter numbers or name prefixes (default: every chapter but those in the frameworks' "
                             "venvs)")
    args = parser.parse_args(argv)
    stored = json.loads(NEEDS_FILE.read_text(encoding="utf-8")) if NEEDS_FILE.exists() else {"chapters": {}}
    # those that need make swift llamafactory
    in_framework_venvs = {f"{ch.notebook}.ipynb" for ch in course.CHAPTERS if ch.framework_venvs}
    paths = [p for p in chapters(args.names) if args.names or p.name not in in_framework_venvs]
    for path in paths:
        print(f"{path.name} ...", flush=True)
        stored["chapters"][path.name[:2]] = figures = measure(path)
        print(f"  {figures}", flush=True)
    info = cpu_info()
    stored["measured_on"] = {"cpu": info["model"], "usable_cores": info["cores_usable"],
                             "memory_gib": memory_info()["total_gib"]}
    stored["install"] = install_facts()
    stored["chapters"] = dict(sorted(stored["chapters"].items()))
    tmp = NEEDS_FILE.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(stored, indent=1) + "\n", encoding="utf-8")
    tmp.replace(NEEDS_FILE)
    print(f"wrote {NEEDS_FILE.relative_to(ROOT)}")
    for guide in write_guides():
        print(f"wrote the plan into {guide.relative_to(ROOT)}")
    return 0


GUIDES = {"en": ROOT / "docs" / "instructor_guide.md", "zh": ROOT / "docs" / "instructor_guide.zh.md"}


def write_guides():
    """Put dslab.workshop.guide_table, in each guide's language, between the guide's plan markers."""
    from dslab import messages, workshop

    before = messages.language()
    try:
        for lang, guide in GUIDES.items():
            messages.set_language(lang)
            text = guide.read_text(encoding="utf-8")
            start, end = text.index(workshop.GUIDE_BEGIN) + len(workshop.GUIDE_BEGIN), text.index(workshop.GUIDE_END)
            guide.write_text(text[:start] + "\n" + workshop.guide_table() + "\n" + text[end:], encoding="utf-8")
            yield guide
    finally:
        messages.set_language(before)


if __name__ == "__main__":
    sys.exit(main())
