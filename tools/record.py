"""Run chapters top to bottom and store their outputs: what nbval (make test-notebooks) compares a new run against.

Course tooling, run from the repository root after changing a chapter's code:

    python -m tools.record 02             run notebooks/02_*.ipynb and store its outputs (names or prefixes)
    python -m tools.record 02 05 --to DIR  run them, but write the executed copies to DIR (the chapters are left
                                           alone): how the tolerances in the notebooks' metadata were measured,
                                           with `python tests/nbval_numbers.py STORED DIR/COPY` on each

A recorded notebook keeps, in its metadata, the facts of the machine that recorded it ("dslab": {"recorded_on":
dslab.env.accelerator_info() and dslab.launch.frameworks.venv_facts()}): cells whose output depends on one of them say
so, and are compared only on a machine where it is the same (tests/nbval_numbers.py). Then refresh the Chinese twins: python -m tools.zh_sync.
A cell that raises stops the recording with its traceback (nothing is written).
"""
import argparse
import json
import sys
from pathlib import Path

from dslab import course

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def chapters(names):
    """The English chapters named by number or prefix ("02", "05_lora"), in order; every chapter if none."""
    every = [NOTEBOOKS / f"{ch.notebook}.ipynb" for ch in course.CHAPTERS]  # the course map's, in its order
    if not names:
        return every
    found = [p for p in every if any(p.stem.startswith(n) for n in names)]
    missing = [n for n in names if not any(p.stem.startswith(n) for p in every)]
    if missing:
        raise SystemExit(f"no chapter starts with {', '.join(missing)} (chapters: {', '.join(p.stem for p in every)})")
    return found


def record(path, out_dir=None, timeout=900):
    """Execute one chapter with its folder as the working directory; write it back (or into out_dir)."""
    import nbformat
    from nbclient import NotebookClient

    from dslab.env import accelerator_info
    from dslab.launch.frameworks import venv_facts

    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    raw, run = json.loads(text), json.loads(nbformat.writes(nb))  # keep the file's layout; the run's outputs
    for cell, done in zip(raw["cells"], run["cells"]):
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = done["outputs"], done["execution_count"]
    raw["metadata"].setdefault("dslab", {})["recorded_on"] = {**accelerator_info(), **venv_facts()}
    target = (Path(out_dir) / path.name) if out_dir else path
    tmp = target.with_suffix(".ipynb.tmp")
    tmp.write_text(json.dumps(raw, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(target)  # atomic: a stopped recording leaves the stored chapter as it was
    return target


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.record", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="chapter numbers or name prefixes (default: every chapter)")
    parser.add_argument("--to", help="write executed copies here instead of storing the outputs")
    args = parser.parse_args(argv)
    if args.to:
        Path(args.to).mkdir(parents=True, exist_ok=True)
    for path in chapters(args.names):
        print(f"{path.name} ...", flush=True)
        print(f"  wrote {record(path, args.to)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
