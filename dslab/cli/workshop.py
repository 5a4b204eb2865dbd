"""The instructor's commands: `dslab progress` (a learner's exercise table, or with --collect the view of many
learners) and `dslab workshop plan` (what N learners need from one server)."""
import io
import sys
from pathlib import Path

from dslab import workshop
from dslab.exercises import progress, registered
from dslab.messages import say


def add_commands(subparsers):
    """`dslab progress`, `dslab workshop plan`."""
    p = subparsers.add_parser("progress", help="which exercises you passed (from your progress file); with --collect, "
                                               "who passed what and the commonest mistakes across learners")
    p.add_argument("--file", default=None, help=f"the progress file to read (default ${progress.PROGRESS_ENV}, else "
                                                f"~/.dslab/{progress.FILE_NAME})")
    p.add_argument("--collect", nargs="+", metavar="DIR", default=None,
                   help="learners' home folders (or folders they copied their progress file into, or the files): "
                        "print every learner's standing and each exercise's passes and commonest mistake")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with --collect: also draw, per exercise, how many learners passed and how many not yet")
    p.set_defaults(func=_progress)
    w = subparsers.add_parser("workshop", help="plan a workshop on one shared server")
    sub = w.add_subparsers(dest="workshop_command", metavar="COMMAND", required=True)
    plan = sub.add_parser("plan", help="per chapter, the cores, memory and disk N learners need at once (from each "
                                       "chapter's measured run, dslab/chapter_needs.json)")
    plan.add_argument("--learners", type=int, required=True, help="how many learners share the server")
    plan.set_defaults(func=_plan)


def _plan(args):
    if args.learners < 1:
        print(f"error: --learners must be 1 or more, got {args.learners}", file=sys.stderr)
        return 2
    print(workshop.format_plan(args.learners))
    return 0


def _progress(args):
    exercise_ids = list(registered())
    if args.collect is None:
        if args.plot:
            print("error: " + say("progress.plot_needs_collect"), file=sys.stderr)
            return 2
        return _mine(Path(args.file) if args.file else progress.progress_file(), exercise_ids)
    try:
        files = progress.find_files(args.collect)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not files:
        print("error: " + say("progress.no_files", name=progress.FILE_NAME, folders=", ".join(args.collect)),
              file=sys.stderr)
        return 1
    entries = progress.read_many(files)
    learners, exercises = progress.class_rows(entries, exercise_ids)
    print(say("progress.collected", files=len(files), learners=len(learners)) + "\n")
    print(progress.format_table(say("progress.learners_head").split("|"), learners) + "\n")
    print(progress.format_table(say("progress.exercises_head").split("|"), exercises))
    if args.plot:
        from dslab import plots
        from dslab.files import atomic_write_bytes

        fig, _ = plots.class_progress(exercises)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=120)
        try:
            atomic_write_bytes(args.plot, png.getvalue())
        except OSError as err:   # a folder that does not exist or cannot be written: the tables are printed already
            print(f"error: --plot {args.plot}: {err.strerror or err}", file=sys.stderr)
            return 1
        print("\n" + say("progress.plot", path=args.plot))
    return 0


def _mine(path, exercise_ids):
    if not path.is_file():
        print(say("progress.none_yet", path=path))
        return 0
    rows = progress.learner_rows(progress.read(path), exercise_ids)
    passed = sum(status == "passed" for _, status, _, _ in rows)
    tried = sum(bool(status) for _, status, _, _ in rows)
    words = {"passed": say("progress.passed"), "not yet": say("progress.not_yet"), "": ""}
    shown = [(exercise_id, words[status], tries or "", mistake) for exercise_id, status, tries, mistake in rows]
    print(progress.format_table(say("progress.mine_head").split("|"), shown) + "\n")
    print(say("progress.mine", passed=passed, total=len(exercise_ids), open=tried - passed, path=path))
    return 0
