"""dslab/course.py's CHAPTERS is the one chapter list: every file it names exists, no chapter file exists that it does
not name, and the prose that repeats it says what it says: each notebook's title, both READMEs' chapter tables, both
instructor guides' timing tables and their day totals, each deck's minutes. docs/architecture.md, "How to add a
chapter", is the checklist this file enforces; a failure names the file and the chapter to fix."""
import json
import re
from pathlib import Path

import pytest

from dslab import course

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = course.CHAPTERS
IDS = [ch.notebook for ch in CHAPTERS]
TEACH = {ch.nn: ch.teach_minutes for ch in CHAPTERS}
GUIDES = {"docs/instructor_guide.md": "## Timing per chapter", "docs/instructor_guide.zh.md": "## 每章时长"}
READMES = {"README.md": "", "README.zh.md": "zh/"}  # the folder each README's table names a notebook in
IMPORT = re.compile(r"^\s*from (dslab[\w.]*) import ([\w ,]+)", re.M)
# the guides' totals line: "09-14 add about 4 h 20 min"; a plan: "**Half day, CPU-only (4 h).** 00 → 01 → 03"
DAY_TOTAL = re.compile(r"(\d\d)-(\d\d)\D*?(\d+) (?:h|小时)(?: (\d+) (?:min|分钟))?")
PLAN = re.compile(r"^\*\*[^*]*?(\d+(?:\.\d+)?) (?:h|小时)[^*]*\*\*\s*(\d\d(?: → \d\d)+)", re.M)


def text(path):
    return (ROOT / path).read_text(encoding="utf-8")


def module_file(name):
    """The file of a dotted dslab module (name.py, or a package's __init__.py), or None."""
    base = ROOT.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def cells(notebook):
    return json.loads(text(notebook))["cells"]


def imported_modules(notebook):
    """The dslab modules a notebook's code cells import: `from dslab.x import y` counts dslab.x.y where that is a
    module (y is a module), else dslab.x (y is a function or class of it)."""
    found = set()
    for cell in cells(notebook):
        for package, names in IMPORT.findall("".join(cell["source"]) if cell["cell_type"] == "code" else ""):
            for name in names.split(","):
                module = f"{package}.{name.split(' as ')[0].strip()}"
                found.add(module if module_file(module) else package)
    return found


def table_problems(path, rows, want):
    """What a prose table [(NN, value)] gets wrong against the manifest's [(NN, value)], each naming the file and the
    chapter: a chapter without its row, a row for no chapter, a chapter twice, another value, rows out of order."""
    found, nns, wanted = dict(rows), [nn for nn, _ in rows], dict(want)
    problems = [f"{path}: chapter {nn}: " + (f"says {found[nn]}, dslab/course.py {value}" if nn in found else "no row")
                for nn, value in want if found.get(nn) != value]
    problems += [f"{path}: chapter {nn}: a row for a chapter dslab/course.py does not have" for nn in found
                 if nn not in wanted]
    problems += [f"{path}: chapter {nn}: {nns.count(nn)} rows" for nn in sorted(set(nns)) if nns.count(nn) > 1]
    if not problems and nns != [nn for nn, _ in want]:
        problems.append(f"{path}: rows out of the course order: {nns}")
    return problems


# ---------------------------------------------------------------------------------------------- the files

@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_every_file_the_manifest_names_exists(chapter):
    paths = [*chapter.notebooks, *chapter.decks, chapter.solutions]
    missing = [p for p in paths if not (ROOT / p).exists()]
    missing += [m for m in chapter.exercise_modules + chapter.modules if not module_file(m)]
    assert not missing, f"chapter {chapter.nn}: dslab/course.py names what does not exist: {missing}"
    # dslab.exercises.discover imports chNN only; the chapter's other exercise modules register when chNN imports them
    own = text(f"dslab/exercises/ch{chapter.nn}.py")
    unimported = [m for m in chapter.more_exercises if not re.search(rf"\bimport\b[^)]*\b{m.split('.')[-1]}\b", own)]
    assert not unimported, f"dslab/exercises/ch{chapter.nn}.py: chapter {chapter.nn}: does not import {unimported}"


def test_no_chapter_file_is_left_out_of_the_manifest():
    """Each notebook, zh twin, deck, solutions file and exercise module belongs to a chapter of CHAPTERS."""
    listed = {p for ch in CHAPTERS for p in (*ch.notebooks, *ch.decks, ch.solutions)}
    listed |= {f"{m.replace('.', '/')}.py" for ch in CHAPTERS for m in ch.exercise_modules}
    patterns = ("notebooks/*.ipynb", "notebooks/zh/*.ipynb", "slides/*.md", "slides/zh/*.md",
                "notebooks/solutions/*.py", "dslab/exercises/ch*.py")
    on_disk = {p.relative_to(ROOT).as_posix() for pattern in patterns for p in ROOT.glob(pattern)}
    orphans = sorted(on_disk - listed - {"slides/README.md"})
    assert not orphans, f"no chapter of dslab/course.py lists these (add the chapter there, or remove them): {orphans}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_each_notebook_is_titled_as_the_manifest_says(chapter):
    for notebook, title in zip(chapter.notebooks, (chapter.title, chapter.title_zh)):
        heading = re.search(r"^# (.+)$", "".join(cells(notebook)[0]["source"]), re.M)
        assert heading and heading.group(1) == f"{chapter.nn} · {title}", \
            f"{notebook}: chapter {chapter.nn}: its first heading is {heading and heading.group(1)!r}, " \
            f"dslab/course.py's title {title!r}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_the_modules_listed_are_those_the_notebook_imports(chapter):
    notebook = chapter.notebooks[0]   # the zh twin's code is the same (tests/test_zh_edition.py)
    imported, listed = imported_modules(notebook), set(chapter.modules)
    assert imported == listed, f"{notebook}: chapter {chapter.nn}: dslab/course.py's modules leave out " \
                               f"{sorted(imported - listed)} and list {sorted(listed - imported)} it does not import"


# ---------------------------------------------------------------------------------------------- the prose

@pytest.mark.parametrize("readme", READMES)
def test_the_readme_has_one_row_per_chapter_in_order(readme):
    rows = re.findall(r"^\| (\d\d) \| `([^`]+\.ipynb)` \|", text(readme), re.M)
    want = [(ch.nn, f"{READMES[readme]}{ch.notebook}.ipynb") for ch in CHAPTERS]
    problems = table_problems(readme, rows, want)
    assert not problems, "\n".join(problems)


def timing_section(guide):
    """The guide's "timing per chapter" section: its table and its totals."""
    return text(guide).split(GUIDES[guide], 1)[1].split("\n## ", 1)[0]


def minutes(cell):
    m = re.fullmatch(r"(\d+) (?:min|分钟)", cell)
    return int(m.group(1)) if m else cell


@pytest.mark.parametrize("guide", GUIDES)
def test_the_guides_timing_table_has_the_manifests_minutes(guide):
    rows = []
    for line in timing_section(guide).splitlines():
        columns = [c.strip() for c in line.strip().strip("|").split("|")]   # #, chapter, teach, notebook, exercises
        if len(columns) > 4 and re.fullmatch(r"\d\d", columns[0]):
            rows.append((columns[0], f"teach {minutes(columns[2])}, exercises {minutes(columns[4])}"))
    want = [(ch.nn, f"teach {ch.teach_minutes}, exercises {ch.exercise_minutes}") for ch in CHAPTERS]
    problems = table_problems(guide, rows, want)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("guide", GUIDES)
def test_the_guides_day_totals_add_up_and_cover_every_chapter(guide):
    line = next((row for row in timing_section(guide).splitlines() if row.startswith(("Totals:", "合计："))), "")
    days = DAY_TOTAL.findall(line)
    assert days, f"{guide}: no totals line ('Totals: chapters 00-08 are about 6 h ...') under {GUIDES[guide]!r}"
    covered = []
    for first, last, hours, mins in days:
        nns = [ch.nn for ch in CHAPTERS if int(first) <= ch.number <= int(last)]
        covered += nns
        total = sum(TEACH[nn] for nn in nns)
        assert total == int(hours) * 60 + int(mins or 0), f"{guide}: chapters {first}-{last} teach {total} min by " \
                                                          f"dslab/course.py; its totals say {hours} h {mins or 0} min"
    assert covered == list(TEACH), f"{guide}: the day totals cover chapters {covered}, not every chapter once"
    for hours, path in PLAN.findall(text(guide)):
        total = sum(TEACH[nn] for nn in path.split(" → "))
        assert total == float(hours) * 60, f"{guide}: the plan {path} teaches {total} min by dslab/course.py, " \
                                           f"not {hours} h"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_each_deck_states_the_chapters_minutes_and_names_its_notebook(chapter):
    for deck, notebook in zip(chapter.decks, chapter.notebooks):
        title_slide = text(deck).split("\n---\n", 1)[0]
        m = re.search(r"about (\d+) minutes|约 (\d+) 分钟", title_slide)
        assert m and int(m.group(1) or m.group(2)) == chapter.teach_minutes, \
            f"{deck}: chapter {chapter.nn}: the title slide says {m and m.group(0)!r}; dslab/course.py (the guides' " \
            f"teach column) says {chapter.teach_minutes} minutes"
        assert f"`{notebook}`" in title_slide, f"{deck}: chapter {chapter.nn}: the title slide does not name {notebook}"
