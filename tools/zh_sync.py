"""Keep the Chinese chapters (notebooks/zh/NN_topic.ipynb) in step with the English ones (notebooks/NN_topic.ipynb).

Course tooling, run from the repository root:

    python -m tools.zh_sync                  refresh every zh twin from its English chapter; create missing twins
                                             (and a missing slides/zh deck, copied from the English one to translate)
    python -m tools.zh_sync 05               only chapter 05 (names or prefixes, as for tools.slides)
    python -m tools.zh_sync --check          write nothing; exit 1 if any twin is out of step
    python -m tools.zh_sync --force          write even when English Markdown cells were added, removed or moved
    python -m tools.zh_sync --reviewed 05    after updating stale translations: record the English they now follow
    python -m tools.zh_sync export 05        the chapter's zh Markdown cells as one text file (with the English)
    python -m tools.zh_sync import FILE      put an edited export back into its notebook

Who owns what. The English notebook owns the code, the stored outputs and the cell order: a zh twin is rebuilt
from it cell by cell, so the two cannot drift (tests/test_zh_edition.py checks it). The zh twin owns only its
Markdown, which stays in the zh notebook itself (edit it in JupyterLab or through export/import). Each zh
Markdown cell has the id of the English cell it translates and, in its metadata, a short hash of the English
text it was translated from. A code cell may carry Chinese comments: it is kept as long as its code without
comments equals the English; otherwise the English cell replaces it and the sync says so. A `%%writefile` cell
must match line for line (a comment translated on its own line, none added or removed): the script it writes then
has the English line numbers, which its tracebacks, py-spy stacks and the stored outputs show.

What stops a sync, so that a translator knows which cell to update:
- an English Markdown cell with no zh twin (new in English): listed with its first line;
- a zh Markdown cell whose English cell is gone (removed in English);
- Markdown cells in another order than the English (moved in English).
`--force` writes anyway: a new cell gets the English text, to translate (the tests fail until it is Chinese);
a removed one is dropped. A cell whose English text changed since it was translated is reported as stale,
with the English text to compare; `--check` fails on it, `--reviewed` records the new English hash.
"""
import argparse
import copy
import hashlib
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EN_DIR = ROOT / "notebooks"
ZH_DIR = EN_DIR / "zh"
SLIDES_DIR = ROOT / "slides"  # the decks: slides/NN_topic.md and their Chinese twins in slides/zh/
META = "dslab_zh"  # zh Markdown cell metadata: {"en_sha": hash of the English text it translates}
CELL_MARK = re.compile(r"^<!-- zh_sync cell (?P<id>[\w-]+) -->\s*$")
ENGLISH_BLOCK = re.compile(r"^<!-- en\n.*?\n-->\n?", re.S)
PYTHON_CELL_MAGICS = ("%%px", "%%writefile", "%%time", "%%timeit", "%%capture")


class SyncError(RuntimeError):
    """A zh twin cannot be refreshed without a translator; the message names the cells."""


def english_notebooks(names=()):
    """notebooks/NN_topic.ipynb, sorted; only those whose stem starts with one of names, if given."""
    paths = sorted(EN_DIR.glob("[0-9][0-9]_*.ipynb"))
    return [p for p in paths if not names or any(p.stem.startswith(n) for n in names)]


def twin_path(english):
    """notebooks/zh/<same name> for an English chapter."""
    return ZH_DIR / Path(english).name


def start_deck(english):
    """Copy slides/<chapter>.md to slides/zh/ (to translate) if the English deck exists and its twin does not."""
    source = SLIDES_DIR / f"{Path(english).stem}.md"
    target = SLIDES_DIR / "zh" / source.name
    if not source.exists() or target.exists():
        return None
    from dslab.files import atomic_write_text

    return atomic_write_text(target, source.read_text(encoding="utf-8"))


def read(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write(path, nb):
    """Save as the course saves notebooks (indent 1, UTF-8 kept), atomically."""
    from dslab.files import atomic_write_text

    atomic_write_text(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def text(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def en_sha(source):
    """Short hash of an English Markdown cell's text (whitespace at the ends ignored)."""
    return hashlib.sha1(source.strip().encode("utf-8")).hexdigest()[:12]


def code_lines(source):
    """Every line of a code cell without its comment (a comment-only line becomes ""), trailing blank lines dropped.

    Python (also under %%px / %%writefile) loses its `#` comments via tokenize, so a '#' inside a string stays;
    shell (`!`) and magic (`%`) lines, and cells that do not tokenize, are kept as written.
    """
    lines = source.splitlines()
    head = []
    if lines and lines[0].startswith("%%"):
        if not lines[0].startswith(PYTHON_CELL_MAGICS):
            return _trimmed([ln.rstrip() for ln in lines])
        head, lines = [lines[0].rstrip()], lines[1:]
    # Line magics and shell escapes are not Python: blank them for tokenize, put them back unchanged.
    special = {i: ln.rstrip() for i, ln in enumerate(lines) if ln.lstrip().startswith(("!", "%"))}
    body = "\n".join("" if i in special else ln for i, ln in enumerate(lines)) + "\n"
    try:
        comments = [tok.start for tok in tokenize.generate_tokens(io.StringIO(body).readline)
                    if tok.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return _trimmed(head + [ln.rstrip() for ln in lines])
    cut = {row - 1: col for row, col in comments}
    return _trimmed(head + [special.get(i, ln[:cut[i]] if i in cut else ln).rstrip() for i, ln in enumerate(lines)])


def _trimmed(lines):
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def code_without_comments(source):
    """A code cell's lines without comments and blank lines: what must equal the English, line for line."""
    return [ln for ln in code_lines(source) if ln.strip()]


def same_code(zh_source, en_source):
    """Whether a zh code cell is the English one but for its comments: a %%writefile cell line for line (the file it
    writes keeps the English line numbers), any other cell once blank and comment-only lines are left out."""
    if en_source.startswith("%%writefile"):
        return code_lines(zh_source) == code_lines(en_source)
    return code_without_comments(zh_source) == code_without_comments(en_source)


# ----------------------------------------------------------------------------------------------------
# Rebuilding a twin
# ----------------------------------------------------------------------------------------------------
@dataclass
class Report:
    """What refreshing one twin found; `blocking` problems stop a write unless forced."""

    chapter: str
    gained: list = field(default_factory=list)  # (position, id, first line) English cells with no zh twin
    lost: list = field(default_factory=list)  # (id, first line) zh cells whose English cell is gone
    moved: list = field(default_factory=list)  # ids whose order differs from the English
    stale: list = field(default_factory=list)  # (position, id, English text) translated from older English
    code_reset: list = field(default_factory=list)  # (position, id) zh-commented code replaced by the English
    created: bool = False

    @property
    def blocking(self):
        return bool(self.gained or self.lost or self.moved)

    def lines(self):
        """Human-readable findings, one per line."""
        out = [f"{self.chapter}: new twin, with the English Markdown to translate"] if self.created else []
        out += [f"{self.chapter}: English Markdown cell {pos} (id {cid}) is new: translate it; it starts "
                f"{first!r}" for pos, cid, first in self.gained]
        out += [f"{self.chapter}: zh Markdown cell id {cid} has no English cell any more (removed or its id "
                f"changed); it starts {first!r}" for cid, first in self.lost]
        if self.moved:
            out.append(f"{self.chapter}: English Markdown cells moved: {', '.join(self.moved)}; check that the "
                       "translations still read in the new order")
        out += [f"{self.chapter}: cell {pos} (id {cid}): the English changed since it was translated; update the "
                f"zh text, then `python -m tools.zh_sync --reviewed {self.chapter[:2]}`. English now:\n"
                + "\n".join("    " + ln for ln in en.splitlines()) for pos, cid, en in self.stale]
        out += [f"{self.chapter}: code cell {pos} (id {cid}) changed in English: its Chinese comments were replaced"
                " by the English cell" for pos, cid in self.code_reset]
        return out


def first_line(source):
    return next((ln.strip() for ln in source.splitlines() if ln.strip()), "")[:70]


def rebuild(english_nb, zh_nb, chapter="", force=False, reviewed=False):
    """(new zh notebook, Report): the English cells in order, each Markdown one replaced by its translation."""
    rep = Report(chapter)
    zh_md, zh_code = {}, {}
    for cell in (zh_nb or {}).get("cells", []):
        (zh_md if cell["cell_type"] == "markdown" else zh_code)[cell.get("id")] = cell
    en_cells = english_nb["cells"]
    en_md_ids = [c["id"] for c in en_cells if c["cell_type"] == "markdown"]
    by_sha = {cell.get("metadata", {}).get(META, {}).get("en_sha"): cid for cid, cell in zh_md.items()
              if cid not in en_md_ids}  # translations of text whose English id changed (same text, new id)
    cells = []
    for pos, en in enumerate(en_cells):
        if "id" not in en:
            raise SyncError(f"{chapter}: English cell {pos} has no id (save it with nbformat >= 4.5)")
        if en["cell_type"] != "markdown":
            cell = copy.deepcopy(en)
            old = zh_code.get(en["id"])
            if old is not None and text(old) != text(en):
                if same_code(text(old), text(en)):
                    cell["source"] = old["source"]  # same code, Chinese comments kept
                else:
                    rep.code_reset.append((pos, en["id"]))
            cells.append(cell)
            continue
        sha = en_sha(text(en))
        zh = zh_md.get(en["id"])
        if zh is None and sha in by_sha:
            zh = zh_md.pop(by_sha.pop(sha))  # the same English text under a new id: keep its translation
        if zh is None:
            if zh_nb is not None:
                rep.gained.append((pos, en["id"], first_line(text(en))))
            cell = {"cell_type": "markdown", "id": en["id"], "metadata": {META: {"en_sha": sha}},
                    "source": en["source"]}
        else:
            cell = {"cell_type": "markdown", "id": en["id"], "metadata": copy.deepcopy(zh.get("metadata", {})),
                    "source": zh["source"]}
            if zh.get("attachments"):
                cell["attachments"] = zh["attachments"]
            recorded = cell["metadata"].setdefault(META, {}).get("en_sha")
            if reviewed or recorded is None:
                cell["metadata"][META]["en_sha"] = sha
            elif recorded != sha:
                rep.stale.append((pos, en["id"], text(en)))
        cells.append(cell)
    rep.lost = [(cid, first_line(text(c))) for cid, c in zh_md.items() if cid not in en_md_ids]
    zh_order = [c.get("id") for c in (zh_nb or {}).get("cells", []) if c["cell_type"] == "markdown"
                and c.get("id") in en_md_ids]
    kept_order = [cid for cid in en_md_ids if cid in zh_order]
    rep.moved = [a for a, b in zip(zh_order, kept_order) if a != b]
    rep.created = zh_nb is None
    nb = {"cells": cells, "metadata": copy.deepcopy(english_nb.get("metadata", {})),
          "nbformat": english_nb["nbformat"], "nbformat_minor": english_nb["nbformat_minor"]}
    return nb, rep


def sync(english, check=False, force=False, reviewed=False):
    """Refresh one zh twin from its English chapter; returns (Report, changed). Raises SyncError when blocked."""
    english = Path(english)
    twin = twin_path(english)
    zh_nb = read(twin) if twin.exists() else None
    nb, rep = rebuild(read(english), zh_nb, english.stem, force=force, reviewed=reviewed)
    changed = zh_nb != nb
    if rep.blocking and not force:
        stop = (f"{english.stem}: nothing written; translate/adjust the cells above in {twin.relative_to(ROOT)}, "
                "or rerun with --force")
        raise SyncError("\n".join([*rep.lines(), stop]))
    if changed and not check:
        write(twin, nb)
    return rep, changed


# ----------------------------------------------------------------------------------------------------
# Export / import: the Markdown of one chapter as a text file, for editing outside JupyterLab
# ----------------------------------------------------------------------------------------------------
def export(english, with_english=True):
    """The zh Markdown cells of a chapter, each after a `<!-- zh_sync cell ID -->` line (and its English)."""
    english = Path(english)
    twin = twin_path(english)
    if not twin.exists():
        raise SyncError(f"no {twin.relative_to(ROOT)} yet: run `python -m tools.zh_sync {english.stem[:2]}` first")
    en_text = {c["id"]: text(c) for c in read(english)["cells"] if c["cell_type"] == "markdown"}
    parts = [f"<!-- zh_sync notebook {english.name} -->\n"]
    for cell in read(twin)["cells"]:
        if cell["cell_type"] == "markdown":
            en = f"<!-- en\n{en_text.get(cell['id'], '')}\n-->\n" if with_english else ""
            parts.append(f"<!-- zh_sync cell {cell['id']} -->\n{en}{text(cell).rstrip()}\n")
    return "\n".join(parts)


def import_text(data):
    """Put an export (edited) back into its zh notebook; returns the notebook path. Ids must exist there."""
    lines = data.splitlines()
    m = re.match(r"^<!-- zh_sync notebook (\S+\.ipynb) -->\s*$", lines[0] if lines else "")
    if not m:
        raise SyncError("not a zh_sync export: the first line must be `<!-- zh_sync notebook NN_topic.ipynb -->`")
    twin = ZH_DIR / m.group(1)
    if not twin.exists():
        raise SyncError(f"{twin.relative_to(ROOT)} does not exist: run `python -m tools.zh_sync` first")
    cells, current = {}, None
    for ln in lines[1:]:
        mark = CELL_MARK.match(ln)
        if mark:
            current = mark.group("id")
            cells[current] = []
        elif current is not None:
            cells[current].append(ln)
    nb = read(twin)
    ids = {c.get("id") for c in nb["cells"] if c["cell_type"] == "markdown"}
    unknown = sorted(set(cells) - ids)
    if unknown:
        raise SyncError(f"{twin.name}: no Markdown cell with id {', '.join(unknown)}")
    for cell in nb["cells"]:
        if cell.get("id") in cells:
            body = ENGLISH_BLOCK.sub("", "\n".join(cells[cell["id"]]).strip("\n") + "\n", count=1).strip("\n")
            cell["source"] = body.splitlines(keepends=True)
    write(twin, nb)
    return twin


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def main(argv=None):
    """python -m tools.zh_sync [CHAPTER ...] [--check|--force|--reviewed] | export CHAPTER | import FILE"""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:
        paths = english_notebooks(argv[1:2])
        if len(argv) != 2 or len(paths) != 1:
            print("usage: python -m tools.zh_sync export CHAPTER   (one chapter, e.g. 05)", file=sys.stderr)
            return 2
        sys.stdout.write(export(paths[0]))
        return 0
    if argv[:1] == ["import"]:
        if len(argv) != 2:
            print("usage: python -m tools.zh_sync import FILE", file=sys.stderr)
            return 2
        try:
            print(f"updated {import_text(Path(argv[1]).read_text(encoding='utf-8')).relative_to(ROOT)}")
        except SyncError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    parser = argparse.ArgumentParser(prog="python -m tools.zh_sync", description=__doc__.split("\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter names or prefixes (e.g. 05); default: all")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="write nothing; exit 1 if a twin is out of step")
    mode.add_argument("--force", action="store_true", help="write even if English Markdown cells were added, "
                      "removed or moved (new ones get the English text to translate)")
    mode.add_argument("--reviewed", action="store_true", help="record the current English text of every "
                      "translated cell as the one its translation follows")
    args = parser.parse_args(argv)
    paths = english_notebooks(args.chapters)
    if not paths:
        print(f"no English chapter matches {args.chapters} in {EN_DIR.relative_to(ROOT)}", file=sys.stderr)
        return 1
    bad = 0
    for english in paths:
        try:
            rep, changed = sync(english, check=args.check, force=args.force, reviewed=args.reviewed)
        except SyncError as exc:
            print(f"error: {exc}", file=sys.stderr)
            bad += 1
            continue
        if args.check and rep.created:
            print(f"{english.stem}: no zh twin: run `python -m tools.zh_sync {english.stem[:2]}`, then translate its "
                  "Markdown cells", file=sys.stderr)
            bad += 1
            continue
        for line in rep.lines():
            print(line, file=sys.stderr)
        if args.check and (changed or rep.stale):
            bad += 1
            if changed:
                print(f"{english.stem}: the zh twin differs from what the English chapter gives: run "
                      f"`python -m tools.zh_sync {english.stem[:2]}`", file=sys.stderr)
        deck = SLIDES_DIR / "zh" / f"{english.stem}.md"
        if (SLIDES_DIR / deck.name).exists() and not deck.exists():
            if args.check:
                print(f"{english.stem}: no slides/zh/{deck.name}: run `python -m tools.zh_sync {english.stem[:2]}`",
                      file=sys.stderr)
                bad += 1
            else:
                start_deck(english)
                print(f"{english.stem}: new slides/zh/{deck.name}, copied from the English deck: translate it",
                      file=sys.stderr)
        state = "in step" if not changed else ("would change" if args.check else "refreshed")
        print(f"{twin_path(english).relative_to(ROOT)}: {state}" + (f", {len(rep.stale)} stale" if rep.stale else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
