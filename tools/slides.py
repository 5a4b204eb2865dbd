"""Build the workshop decks: slides/NN_topic.md (Markdown, `---` between slides) -> self-contained HTML.

Course tooling, not part of the learner's package: it lives in tools/ and runs from the repository root.

    make slides                                        (= python -m tools.slides build)
    python -m tools.slides build [DECK ...] [--strict] [--pdf] [--src DIR] [--out DIR]
    python -m tools.slides check [DECK ...]             every directive names a function / term that exists
    python -m tools.slides list  [DECK ...]             decks, slide counts and directives
    python tools/slides.py build                        the same, without -m

Without --src, build, check and list take both editions: slides/NN_topic.md (built into slides/build/) and the
Chinese decks slides/zh/NN_topic.md (into slides/build/zh/), which have the same directives, so the same figures.

A slide pulls live content from the kit with a directive on a line of its own:

    ![figure: caption](dslab.plots:zero_partition_map(world_size=4))        the Figure, as a PNG
    ![table: caption](dslab.zero.memory:ladder(params=7.5e9, world_size=64) | setup, total:GB)
    ![table: caption](dslab.env:machine_facts()["features"] | name, available)      part of the data
    ![figure](dslab.plots:loss_scale_trace(dslab.precision.loss_scaling.trace_grad_scaler()))  data -> plot
    ![code: caption](dslab.launch.multinode:EXAMPLE_HOSTFILE)                      a string, as code
    ![terms](glossary: ZeRO; sharding)                                     rows of docs/glossary.md

The target is a small expression: calls of the module's functions (or of dotted dslab.* functions)
with literal arguments or other such calls, and literal `["key"]` subscripts; the names after `|` pick
(and convert: `total:GB`) the table's columns. A plot function returns (Figure, data); a table shows a
list of dicts, a dict of lists or a dict. So the decks show what the notebooks compute, regenerated on
every build. Each deck becomes one HTML file with its CSS, script and figures inline: it opens offline.
slides/README.md describes the format for deck authors.

Three files: tools/slides_source.py reads decks and directives and evaluates them (no HTML),
tools/slides_html.py renders results, pages and PDFs, and this file builds decks and is the command line.

Why not a slide tool? Considered, with what each lacks here:
- reveal.js (the JavaScript framework behind most HTML decks): renders Markdown, but knows nothing of
  dslab: the figures and tables would have to be produced by a separate script anyway, and reveal.js itself
  would be vendored (~1 MB) or fetched from a CDN when a deck is opened, which the offline rule forbids.
- Marp (marp-cli): Markdown to HTML/PDF, but it is a Node.js tool (npm at install time) and prints PDFs with
  a Chromium that puppeteer downloads; this course installs nothing outside pip and Debian's apt.
- Jupyter's `nbconvert --to slides`: already installed, but the decks would have to be notebooks executed by
  a kernel, and its HTML loads reveal.js from unpkg.com unless a local copy is configured.
- Quarto / pandoc: not pip packages; the same "who computes the figures" gap as reveal.js.
None of them may download anything while the tests run, and none evaluates a line like
`![table](dslab.zero.memory:ladder(...) | setup, total:GB)` against the kit's own code, which is what keeps the decks
from drifting away from the notebooks. So this small builder stays, standing on well-kept libraries for the
generic parts: mistune (Markdown), Pygments (code colouring), matplotlib (figures), Debian's chromium (PDF).
"""
import argparse
import ast
import contextlib
import html
import io
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/slides.py`: make the `tools` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.slides_html import (code_html, export_pdf, figure_html, markdown_renderer, page_html,  # noqa: E402
                                split_result, table_html, terms_html)
from tools.slides_source import (DIRECTIVE, FENCE, ROOT, SLIDES_DIR, ZH_SLIDES_DIR, Missing, SlideError,  # noqa: E402
                                 check_deck, deck_paths, directives, evaluate, forget_results, load_deck,
                                 load_glossary, parse_target)

BUILD_DIR = SLIDES_DIR / "build"
EDITIONS = ((SLIDES_DIR, BUILD_DIR), (ZH_SLIDES_DIR, BUILD_DIR / "zh"))  # (sources, output) built by default


@dataclass
class BuildReport:
    """What building one deck produced, and which directives could not be filled."""

    deck: str
    output: Path
    slides: int
    seconds: float
    pending: list = field(default_factory=list)  # (slide number, directive text, reason)


# ----------------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------------
def run_directive(kind, caption, target, glossary, lang="en"):
    """The HTML a directive stands for; Missing if what it names is not there yet."""
    if kind == "terms":
        return terms_html(target, glossary, lang)
    module, node, columns = parse_target(target)
    chatter = io.StringIO()  # what the functions print (library logs, warnings): shown only on failure
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            result = evaluate(node, module)
    except SlideError as exc:
        said = chatter.getvalue().strip()[-1500:]
        raise SlideError(f"{exc}" + (f"\n  it printed:\n{said}" if said else "")) from exc.__cause__
    fig, data = split_result(result)
    name = f"{module}:{ast.unparse(node)}"
    if kind == "figure":
        if fig is None or not hasattr(fig, "canvas"):
            raise SlideError(f"{name} returned no matplotlib Figure; use ![table](...) for data")
        return figure_html(fig, caption)
    if fig is not None:
        import matplotlib.pyplot as plt

        plt.close(fig)
    if kind == "code":
        return code_html(data, caption, name)
    return table_html(data, caption, columns)


def render_slide(text, md, glossary, pending, number, lang="en"):
    """One slide's HTML; directives that name something missing become a visible 'pending' box."""
    blocks, lines, fence = {}, [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
        d = DIRECTIVE.match(line.strip()) if fence is None else None
        if not d:
            lines.append(line)
            continue
        key = f"DSLABDIRECTIVE{len(blocks)}X"
        kind, caption, target = d.group("kind"), (d.group("caption") or "").strip(), d.group("target").strip()
        try:
            blocks[key] = run_directive(kind, caption, target, glossary, lang)
        except Missing as exc:
            pending.append((number, line.strip(), str(exc)))
            blocks[key] = (f'<div class="pending"><strong>{kind} pending</strong>: {html.escape(str(exc))}'
                           f"<br><code>{html.escape(line.strip())}</code></div>")
        lines.extend(["", key, ""])  # its own paragraph, replaced after Markdown rendering
    out = md("\n".join(lines))
    for key, block in blocks.items():
        out = out.replace(f"<p>{key}</p>", block).replace(key, block)
    return out


def build_deck(path, out_dir=BUILD_DIR, strict=False):
    """Render one deck to out_dir/<stem>.html; returns a BuildReport. strict: missing content is an error."""
    import matplotlib

    matplotlib.use("Agg")
    t0 = time.perf_counter()
    deck = load_deck(path)
    md, glossary, pending, sections = markdown_renderer(), load_glossary(), [], []
    for i, text in enumerate(deck.slides, 1):
        try:
            body = render_slide(text, md, glossary, pending, i, deck.lang)
        except SlideError as exc:
            raise SlideError(f"{deck.path.name}, slide {i}: {exc}") from exc
        cls = "slide title" if i == 1 else "slide"
        sections.append(
            f'<section class="{cls}" id="slide-{i}" data-index="{i}"><div class="content">{body}</div>'
            f'<footer><span>{html.escape(deck.title)}</span><span class="num">{i} / {len(deck.slides)}</span></footer></section>'
        )
    if strict and pending:
        raise SlideError(f"{deck.path.name}: " + "; ".join(f"slide {n}: {why}" for n, _, why in pending))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{deck.name}.html"
    out.write_text(page_html(deck, sections), encoding="utf-8")
    return BuildReport(deck.name, out, len(deck.slides), time.perf_counter() - t0, pending)


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------
def deck_jobs(args):
    """[(deck source, output folder)]: the decks in --src, or by default both editions (slides/ and slides/zh/)."""
    if args.src is not None:
        return [(p, Path(getattr(args, "out", None) or BUILD_DIR)) for p in deck_paths(args.src, args.decks)]
    out = Path(getattr(args, "out", None) or BUILD_DIR)
    return [(p, out if src == SLIDES_DIR else out / "zh") for src, _ in EDITIONS for p in deck_paths(src, args.decks)]


def deck_label(path):
    """zh/04_zero.md for a Chinese deck, 04_zero.md otherwise."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}" if path.parent.name == "zh" else path.name


def cmd_build(args):
    """Build the decks; print one line per deck and a list of what is still pending."""
    jobs = deck_jobs(args)
    if not jobs:
        print(f"no decks found in {args.src or SLIDES_DIR} (expected NN_topic.md files)", file=sys.stderr)
        return 1
    t0, pending = time.perf_counter(), []
    forget_results()
    for p, out in jobs:
        try:
            rep = build_deck(p, out, strict=args.strict)
        except SlideError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        pending += [(deck_label(p), n, why) for n, _, why in rep.pending]
        line = f"{rep.output.relative_to(ROOT) if rep.output.is_relative_to(ROOT) else rep.output}: {rep.slides} slides, {rep.seconds:.1f} s"
        if rep.pending:
            line += f", {len(rep.pending)} pending"
        print(line)
        if args.pdf:
            print(f"  {export_pdf(rep.output)}")
    for deck, n, why in pending:
        print(f"pending: {deck} slide {n}: {why}", file=sys.stderr)
    print(f"{len(jobs)} decks in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_list(args):
    """Each deck with its slide count and directives; with `check`, what each directive still lacks."""
    bad = 0
    for p, _ in deck_jobs(args):
        deck = load_deck(p)
        problems = {}
        if args.check:
            for n, target, why in check_deck(p):
                problems.setdefault((n, target), []).append(why)
        print(f"{deck_label(p)}: {len(deck.slides)} slides — {deck.title}")
        for i, text in enumerate(deck.slides, 1):
            for kind, _, target in directives(text):
                why = problems.get((i, target))
                status = ("  <- " + "; ".join(why)) if why else ("  ok" if args.check else "")
                print(f"  slide {i}: {kind} {target}{status}")
        bad += len(problems)
    return 1 if bad else 0


def build_parser():
    """The command line: build, list and check, each on all decks or on the ones named."""
    parser = argparse.ArgumentParser(prog="python -m tools.slides", description="build the workshop decks")
    sub = parser.add_subparsers(dest="slides_command", metavar="ACTION", required=True)
    build = sub.add_parser("build", help="render the decks to self-contained HTML")
    lst = sub.add_parser("list", help="list decks, slide counts and figure directives")
    check = sub.add_parser("check", help="like list, and fail if a directive names a missing function or term")
    for p in (build, lst, check):
        p.add_argument("decks", nargs="*", help="deck names or prefixes (e.g. 04 or 04_zero); default: all")
        p.add_argument("--src", help="folder with the NN_topic.md sources (default: slides and slides/zh)")
    build.add_argument("--out", help="output folder (default slides/build; the zh decks go to its zh/ folder)")
    build.add_argument("--strict", action="store_true", help="fail if a directive names something missing")
    build.add_argument("--pdf", action="store_true", help="also print each deck to PDF with headless Chromium")
    build.set_defaults(func=cmd_build)
    lst.set_defaults(func=cmd_list, check=False)
    check.set_defaults(func=cmd_list, check=True)
    return parser


def main(argv=None):
    """python -m tools.slides build|list|check ..."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
