"""Three learners on one server, at the same time: each has a copy of the course and a home of their own, the venv is
installed once for all, and each runs chapter 00 (a first launch through the deepspeed launcher) and chapter 01 (live
ranks, collectives) under nbval while checking exercises of chapter 01 (one on launched ranks), all three at once.

Each must pass; nothing may be written outside a learner's own folders (their copy, their home, their temporary
folder); and their progress files collect into one view. `make test-workshop` runs it (.ci/run does, after make
test): three learners' chapters at once take several minutes on 2 cores.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslab.exercises import progress

ROOT = Path(__file__).resolve().parents[2]
LEARNERS = ("ana", "bo", "chen")
CHAPTERS = ("notebooks/00_setup.ipynb", "notebooks/01_distributed_basics.ipynb")
TIMEOUT_S = 1500
# What each learner checks while the chapters run: a named mistake, a right number, and a solution run on ranks.
CHECKS = """
import runpy
from dslab import exercises
solutions = runpy.run_path("notebooks/solutions/01_solutions.py")["SOLUTIONS"]
assert not exercises.check("01.ring_gb", 14.0)
assert exercises.check("01.ring_gb", solutions["01.ring_gb"])
assert exercises.check("01.average_gradients", solutions["01.average_gradients"])
"""


def _course_copy(dest):
    """The learner's own copy of the course: the tracked files, with the venv installed once for all (a link)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    (dest / ".venv").symlink_to(ROOT / ".venv")


def _entries(folder):
    return set(os.listdir(folder)) if folder.is_dir() else set()


def _changed_since(folder, start):
    """Files under the installed kit (not its venvs or git) written after `start`: the kit is installed once for
    every learner, so a chapter must never write into it."""
    changed = []
    for dirpath, dirnames, filenames in os.walk(folder):
        # Python's bytecode caches aside: where the kit is read-only, Python skips writing them without a word
        dirnames[:] = [d for d in dirnames if d != "__pycache__"
                       and not (Path(dirpath) == folder and (d.startswith(".venv") or d == ".git"))]
        changed += [os.path.join(dirpath, f) for f in filenames
                    if os.lstat(os.path.join(dirpath, f)).st_mtime > start]
    return sorted(changed)


@pytest.fixture(scope="module")
def learners(tmp_path_factory):
    from torch.utils.cpp_extension import get_default_build_root

    base = tmp_path_factory.mktemp("server")
    shared = {"tmp": Path("/tmp"), "home": Path.home(), "shm": Path("/dev/shm")}   # what every account shares
    before = {where: _entries(folder) for where, folder in shared.items()}
    start = time.time()
    # The kit's Python by its own path, as the hub's kernel runs /opt/dslab/.venv/bin/python: DeepSpeed's JIT ops are
    # built from its sources' paths, and a process that sees them through a learner's link (~/dslab/.venv) would
    # rebuild the shared ops from the new paths, while every other learner's ranks wait on torch's build lock.
    venv_bin = ROOT / ".venv" / "bin"
    runs = {}
    for name in LEARNERS:
        # as on a server: /home/NAME, the learner's copy of the course in it, a temporary folder of their own
        home, course, tmp = base / "home" / name, base / "home" / name / "dslab", base / "tmp" / name
        tmp.mkdir(parents=True)
        _course_copy(course)
        env = {key: value for key, value in os.environ.items() if not key.startswith(("DSLAB_", "PYTEST_"))}
        # the course's conftest would send the checks' verdicts to the copy's build/: the learner's own default instead
        env.update(HOME=str(home), TMPDIR=str(tmp), DSLAB_LANG="en",
                   DSLAB_PROGRESS=str(home / ".dslab" / "progress.jsonl"),
                   # the compiled ops, built once for the server's account (make setup); a learner's own account
                   # builds its own on first use
                   TORCH_EXTENSIONS_DIR=get_default_build_root(),
                   PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}")
        command = [str(venv_bin / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "--nbval", *CHAPTERS, "--nbval-current-env", "--nbval-sanitize-with", "tests/sanitize.cfg",
                   "--nbval-cell-timeout=1200"]
        procs = [subprocess.Popen(cmd, cwd=course, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd in (command, [str(venv_bin / "python"), "-c", CHECKS])]
        runs[name] = (home, tmp, procs)
    results = {}
    for name, (home, tmp, procs) in runs.items():
        outputs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
        results[name] = {"home": home, "tmp": tmp, "returncodes": [proc.returncode for proc in procs],
                         "output": "\n".join(outputs)}
    after = {where: _entries(folder) for where, folder in shared.items()}
    return {"base": base, "results": results, "new": {k: after[k] - before[k] for k in after},
            "kit_written": _changed_since(ROOT, start)}


def test_every_learner_passes_both_chapters_and_the_checks_at_the_same_time(learners):
    for name, result in learners["results"].items():
        assert result["returncodes"] == [0, 0], f"{name}:\n{result['output'][-4000:]}"


def test_nothing_is_written_outside_the_learners_own_folders(learners):
    # pytest's own temporary root (where these learners live) is the one new thing allowed in /tmp
    outside = {where: sorted(n for n in new if not n.startswith("pytest-of-"))
               for where, new in learners["new"].items()}
    assert outside == {"tmp": [], "home": [], "shm": []}, outside
    assert learners["kit_written"] == [], "written into the kit installed for everyone"
    for name, result in learners["results"].items():
        left = sorted(os.listdir(result["tmp"]))
        assert not [n for n in left if n.startswith("dslab-live-")], f"{name}: a live cluster's profile left: {left}"


def test_their_progress_files_collect_into_one_view(learners):
    homes = [str(result["home"]) for result in learners["results"].values()]
    for home in homes:
        recorded = [e.verdict for e in progress.read(Path(home) / ".dslab" / "progress.jsonl")]
        assert recorded == ["mistake", "passed", "passed"], (home, recorded)
    # the instructor points at the server's home folders; all three ran as one login here, so each is told apart by
    # the home folder its file lies in
    result = subprocess.run([sys.executable, "-m", "dslab.cli", "progress", "--collect",
                             str(learners["base"] / "home")], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "DSLAB_LANG": "en"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{len(LEARNERS)} progress file(s), {len(LEARNERS)} learner(s)" in result.stdout, result.stdout
    for name in LEARNERS:
        assert f"({name})" in result.stdout, result.stdout
