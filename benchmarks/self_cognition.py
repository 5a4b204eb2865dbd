"""Self-cognition tuning, scored as a user would: `dslab sft`, `dslab merge`, then `dslab eval` on held-out questions.

For each evaluation identity of data/eval_identities.jsonl (none of them in any training data) and each ZeRO stage,
this runs the real commands on 2 ranks and prints, per language, how many held-out questions were answered with the
whole name or author asked for (a completion with U+FFFD counts as wrong), plus the general questions kept and the
base model's scores for the same identity.

    python benchmarks/self_cognition.py [--zero 2 3] [--identities 0 1 2] [--work /tmp/selfcog] [--sft-args ...]
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def dslab(*args):
    """Run a `dslab` command (no shell), fail loudly with its output."""
    cmd = [sys.executable, "-m", "dslab.cli", *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def as_args(value):
    return list(value) if isinstance(value, tuple) else [value]


def score(model_dir, ident):
    from dslab.models import evaluate
    """`dslab eval --json` of a model for an identity: {"identity", "general", per-language hits, broken}."""
    res = json.loads(dslab("eval", "--model", model_dir, "--model-name", *as_args(ident["name"]),
                           "--model-author", *as_args(ident["author"]), "--json"))
    per_lang = evaluate.by_language(res["identity_rows"])
    broken = sum("\ufffd" in r["completion"] for r in res["identity_rows"] + res["general_rows"])
    return {"identity": res["identity"], "general": res["general"], "per_lang": per_lang, "broken": broken,
            "rows": res["identity_rows"]}


def main():
    from dslab import data
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero", type=int, nargs="+", default=[2, 3])
    p.add_argument("--identities", type=int, nargs="+", help="indices into data/eval_identities.jsonl (default: all)")
    p.add_argument("--work", default="/tmp/dslab-selfcog")
    p.add_argument("--base", help="the base model to tune (default: data/dslab-tiny)")
    p.add_argument("--sft-args", nargs=argparse.REMAINDER, default=[], help="extra `dslab sft` options")
    args = p.parse_args()
    idents = data.eval_identities()
    chosen = {i: idents[i] for i in (args.identities or range(len(idents)))}
    work = Path(args.work)
    base_arg = ["--model", args.base] if args.base else []
    lines = ["| identity | setup | identity en | identity zh | general | U+FFFD | sft s |", "|---|---|---|---|---|---|---|"]
    for i, ident in chosen.items():
        label = f"{ident['name']} / {ident['author']} ({ident.get('script', '')})"
        base = score(args.base or str(ROOT / "data" / "dslab-tiny"), ident)
        lines.append(f"| {label} | base model | {fmt(base, 'en')} | {fmt(base, 'zh')} | {base['general']:.0%} | "
                     f"{base['broken']} | |")
        for stage in args.zero:
            run = work / f"id{i}-zero{stage}"
            start = time.perf_counter()
            dslab("sft", "--zero", stage, "--world-size", 2, "--output", run / "adapter", *base_arg,
                  "--model-name", *as_args(ident["name"]), "--model-author", *as_args(ident["author"]), *args.sft_args)
            seconds = time.perf_counter() - start
            dslab("merge", "--adapter", run / "adapter", "--output", run / "merged")
            s = score(str(run / "merged"), ident)
            (run / "eval.json").write_text(json.dumps(s, ensure_ascii=False, indent=1))
            lines.append(f"| {label} | LoRA ZeRO-{stage}, merged | {fmt(s, 'en')} | {fmt(s, 'zh')} | {s['general']:.0%} | "
                         f"{s['broken']} | {seconds:.0f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


def fmt(s, lang):
    hits, total = s["per_lang"].get(lang, (0, 0))
    return f"{hits}/{total}"


if __name__ == "__main__":
    main()
