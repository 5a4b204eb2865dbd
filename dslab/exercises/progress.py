"""The learner's progress: every exercise check records its verdict in the learner's own progress file, `dslab
progress` prints the learner's table, and `dslab progress --collect DIR...` gathers several learners' files into the
instructor's view (who passed what, which mistakes are most common).

Nothing is sent anywhere. The file is the learner's: ~/.dslab/progress.jsonl (or $DSLAB_PROGRESS), one JSON line
per check, appended with a single write so that two notebooks checking at once never interleave their lines. An
instructor reads it where it lies (the learners' home folders on a shared server) or where learners chose to copy it.
"""
import getpass
import json
import os
import re
import socket
import time
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from dslab.messages import say

PROGRESS_ENV = "DSLAB_PROGRESS"
FILE_NAME = "progress.jsonl"
# What a check can end with. "mistake": a checker named what is wrong; "hint": a wrong answer the checker does not
# name (the hint was shown); "error": the learner's own code raised (its exception type is kept).
VERDICTS = ("passed", "mistake", "hint", "error")
MISTAKE_CHARS = 160   # a mistake's first line, cut here: enough to tell two mistakes apart in a table


def progress_file():
    """The learner's progress file: $DSLAB_PROGRESS if set, else ~/.dslab/progress.jsonl."""
    chosen = os.environ.get(PROGRESS_ENV, "").strip()
    return Path(chosen).expanduser() if chosen else Path.home() / ".dslab" / FILE_NAME


def learner_name():
    """Who is checking: JupyterHub's user name where a hub started this server (in its containers every learner's login
    may be the same, e.g. jovyan), else the login name, else the host's name."""
    hub_user = os.environ.get("JUPYTERHUB_USER", "").strip()
    if hub_user:
        return hub_user
    try:
        return getpass.getuser()
    except (KeyError, OSError):    # no passwd entry (some containers)
        return socket.gethostname()


def record(exercise_id, verdict, detail="", path=None):
    """Append one check's verdict to the progress file. A file that cannot be written never stops the check: the
    learner is told once where and why, and goes on."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict {verdict!r} is not one of {', '.join(VERDICTS)}")
    first_line = (str(detail).strip().splitlines() or [""])[0][:MISTAKE_CHARS]
    entry = {"exercise": exercise_id, "verdict": verdict, "detail": first_line,
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "learner": learner_name()}
    target = Path(path) if path else progress_file()
    line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: the line lands whole at the end, even with another notebook of the same learner writing too.
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as err:
        _warn_once(say("progress.not_recorded", path=target, why=err.strerror or err, env=PROGRESS_ENV))


_warned = set()


def _warn_once(text):
    if text not in _warned:
        _warned.add(text)
        print(text)


@dataclass
class Entry:
    learner: str
    exercise: str
    verdict: str
    detail: str
    time: str


def read(path):
    """The entries of one progress file, oldest first. Lines that are not a whole entry (a file cut short by a full
    disk) are skipped."""
    entries = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            raw = json.loads(line)
            entries.append(Entry(str(raw["learner"]), str(raw["exercise"]), str(raw["verdict"]),
                                 str(raw.get("detail", "")), str(raw.get("time", ""))))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return entries


def read_many(paths):
    """The entries of several learners' files. A name recorded in more than one file (the same login in several
    containers) is told apart by where each file lies: "name (folder)", the folder being the home folder that holds
    .dslab/progress.jsonl, or the file's own name."""
    per_file = {Path(path): read(path) for path in paths}
    files_of = defaultdict(set)
    for path, entries in per_file.items():
        for e in entries:
            files_of[e.learner].add(path)
    everything = []
    for path, entries in per_file.items():
        place = path.parent.parent.name if path.parent.name == ".dslab" else path.name.removesuffix(FILE_NAME).strip("._-")
        for e in entries:
            if len(files_of[e.learner]) > 1:
                e = Entry(f"{e.learner} ({place or path})", e.exercise, e.verdict, e.detail, e.time)
            everything.append(e)
    return everything


def find_files(folders):
    """Progress files in `folders`: a file given by name, or in each folder its .dslab/progress.jsonl, any
    *progress.jsonl, and those of the folders directly under it (learners' home folders under /home)."""
    found = []
    for folder in map(Path, folders):
        if folder.is_file():
            found.append(folder)
            continue
        if not folder.is_dir():
            raise FileNotFoundError(say("progress.no_folder", folder=folder, name=FILE_NAME))
        for place in (folder, *sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))):
            found.extend(sorted(place.glob(f"*{FILE_NAME}")))
            if (place / ".dslab" / FILE_NAME).is_file():
                found.append(place / ".dslab" / FILE_NAME)
    return list(dict.fromkeys(p.resolve() for p in found))


@dataclass
class Standing:
    """One learner's standing on one exercise."""
    tries: int = 0
    passed: bool = False
    mistake: str = ""       # the last named mistake (or error), if any
    order: int = 0          # when it was last tried: the entry's place among all entries


def standings(entries):
    """{learner: {exercise: Standing}} from entries in time order: passed once is passed."""
    table = defaultdict(lambda: defaultdict(Standing))
    for order, e in enumerate(entries):
        s = table[e.learner][e.exercise]
        s.tries += 1
        s.order = order
        s.passed = s.passed or e.verdict == "passed"
        if e.verdict in ("mistake", "error"):
            s.mistake = e.detail
    return table


def common_mistakes(entries, top=10):
    """The named mistakes most learners met: ((exercise, mistake, number of learners), ...), most first. A checker
    draws each case anew, so one mistake's message differs in its numbers from learner to learner: mistakes are
    counted with their numbers left out, and shown as one learner worded it."""
    learners, wording = defaultdict(set), {}
    for e in entries:
        if e.verdict in ("mistake", "error") and e.detail:
            key = (e.exercise, NUMBER.sub("#", e.detail))
            learners[key].add(e.learner)
            wording.setdefault(key, e.detail)
    ranked = sorted(learners, key=lambda key: -len(learners[key]))
    return [(key[0], wording[key], len(learners[key])) for key in ranked[:top]]


NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


# ------------------------------------------------------------------------------------------- the tables

def learner_rows(entries, exercise_ids):
    """One learner's table, in course order: (exercise, status, tries, last named mistake). status: "passed",
    "not yet" (tried, never passed) or "" (not tried). Exercises the file names that this kit does not (an older or
    newer kit) come last."""
    table = standings(entries)
    mine = next(iter(table.values()), {})
    order = list(exercise_ids) + sorted(set(mine) - set(exercise_ids))
    rows = []
    for exercise_id in order:
        s = mine.get(exercise_id)
        if s is None:
            rows.append((exercise_id, "", 0, ""))
        else:
            rows.append((exercise_id, "passed" if s.passed else "not yet", s.tries, "" if s.passed else s.mistake))
    return rows


def class_rows(entries, exercise_ids):
    """The instructor's two tables.

    learners: (learner, passed, tried and not passed, stuck on, its last mistake), one row per learner; "stuck on" is
    the exercise not passed with the most tries (of those, the one tried last).
    exercises: (exercise, learners passed, learners tried and not passed, the mistake most of them met), in course
    order, only exercises someone tried."""
    table = standings(entries)
    learners = []
    for learner, mine in sorted(table.items()):
        open_ = {ex: s for ex, s in mine.items() if not s.passed}
        stuck = max(open_, key=lambda ex: (open_[ex].tries, open_[ex].order)) if open_ else ""
        learners.append((learner, sum(s.passed for s in mine.values()), len(open_), stuck,
                         open_[stuck].mistake if stuck else ""))
    per_exercise = defaultdict(lambda: [0, 0])
    for mine in table.values():
        for ex, s in mine.items():
            per_exercise[ex][0 if s.passed else 1] += 1
    commonest = {}
    for ex, detail, _ in common_mistakes(entries, top=None):
        commonest.setdefault(ex, detail)
    order = [ex for ex in exercise_ids if ex in per_exercise] + sorted(set(per_exercise) - set(exercise_ids))
    exercises = [(ex, per_exercise[ex][0], per_exercise[ex][1], commonest.get(ex, "")) for ex in order]
    return learners, exercises


def format_table(header, rows, width=MISTAKE_CHARS):
    """Rows as aligned text columns (the last one as long as it is, cut at `width` characters). Columns are aligned by
    the width a terminal gives each character: a Chinese character takes two columns."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(_columns(r[i]) for r in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(c + " " * (w - _columns(c)) for c, w in zip(r, widths)) + "  " + r[-1][:width] for r in cells]
    lines.insert(1, "-" * min(_columns(lines[0].rstrip()), 100))
    return "\n".join(line.rstrip() for line in lines)


def _columns(text):
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
