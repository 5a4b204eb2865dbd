"""The course benchmark: one table of what the course costs and delivers on this machine (`make bench`).

Rows: wall time of each notebook and of the whole course; DeepSpeed ZeRO-0 step time against a plain PyTorch
loop on the same model and batches, and every ZeRO stage / offload against ZeRO-0; measured / theory model-state
memory per stage; the seconds chapter 04's ZeRO explorer takes to re-measure after a change; SFT identity
accuracy and time; generation tokens/s for Hugging Face vs DeepSpeed tp=1 / tp=2; training MFU of the kit's step
(benchmarks/mfu.py).
Goals it reports against: the whole course under 10 minutes on 2 CPU cores; ZeRO-0 at most 1.3x plain PyTorch; a
change in the ZeRO explorer re-measured within 10 s.

    python benchmarks/course_bench.py [--parts notebooks,steps,memory,widget,sft,infer,mfu]
                                      [--output benchmarks/latest.md]

Committed notebooks are executed in memory (nbclient) and never written back. Runs go to a temporary folder.
"""
import argparse
import contextlib
import io
import os
import platform
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PARTS = ("notebooks", "steps", "memory", "widget", "sft", "infer", "mfu")
COURSE_GOAL_S = 600       # the whole course, every notebook executed, on 2 CPU cores
ZERO0_GOAL = 1.3          # DeepSpeed ZeRO-0 step time / plain PyTorch step time
WIDGET_GOAL_S = 10       # chapter 04's ZeRO explorer: a stage or offload change shows new measured bars
INFER_PROMPTS = ["The weather today is", "DeepSpeed splits the model", "我们今天去", "Once upon a time"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)  # progress on stderr; the table alone on stdout


def machine():
    """A description of the machine and the software the numbers came from."""
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for name in ("torch", "deepspeed", "transformers", "peft"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    from dslab.machine import usable_cores  # affinity or the cgroup's CPU quota, the fewer

    return {"cpu": cpu, "cores": usable_cores(), "python": platform.python_version(),
            "system": f"{platform.system()} {platform.release()}", **versions}


def row(group, what, value, goal="", note=""):
    return {"group": group, "what": what, "value": value, "goal": goal, "note": note}


# ------------------------------------------------------------------------------------------------- notebooks
def bench_notebooks(pattern="[0-9][0-9]_*.ipynb", timeout=900):
    """Execute each notebook (in memory, in notebooks/ as nbval does) and time it; then the sum, the course."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    rows, total, failed = [], 0.0, []
    for path in sorted(NOTEBOOKS.glob(pattern)):
        nb = nbformat.read(path, as_version=4)
        kernel = nb.metadata.get("kernelspec", {}).get("name", "python3")
        client = NotebookClient(nb, timeout=timeout, kernel_name=kernel,
                                resources={"metadata": {"path": str(NOTEBOOKS)}})
        log(f"notebook {path.name} ...")
        start = time.perf_counter()
        note = ""
        try:
            client.execute()
        except CellExecutionError as exc:  # the error's name and message, without the traceback's colours
            note = "FAILED: " + re.sub(r"\x1b\[[0-9;]*m", "", f"{exc.ename}: {exc.evalue}").strip()[:120]
            failed.append(path.name)
        seconds = time.perf_counter() - start
        total += seconds
        rows.append(row("notebooks", path.stem, f"{seconds:.0f} s", "", note))
    verdict = "" if not rows else ("met" if total <= COURSE_GOAL_S and not failed else "NOT met")
    rows.append(row("notebooks", f"whole course ({len(rows)} notebooks)", f"{total:.0f} s ({total / 60:.1f} min)",
                    f"< {COURSE_GOAL_S // 60} min on 2 cores: {verdict}",
                    f"failed: {', '.join(failed)}" if failed else ""))
    return rows


# ------------------------------------------------------------------------------------------------- step time
def bench_steps(run_dir):
    """ZeRO-0 vs a plain PyTorch DDP loop (fp32 and bf16), and each stage / offload vs ZeRO-0 (bf16), 2 ranks."""
    from dslab import launch

    result = launch.run(str(ROOT / "benchmarks" / "step_time.py"), world_size=2, stream=False, run_dir=run_dir)
    med = result.rank0["median"]
    r0 = result.rank0
    shape = f"Ψ = {r0['params'] / 1e6:.1f}M, {r0['micro_batch_size']}x{r0['seq_len']} tokens per rank, 2 ranks"
    rows = []
    for precision in ("fp32", "bf16"):
        ratio = med[f"ZeRO-0 {precision}"] / med[f"plain {precision}"]
        verdict = "met" if ratio <= ZERO0_GOAL else "NOT met"
        plain_how = "DDP + AdamW" + (" + autocast" if precision == "bf16" else "")
        rows.append(row("step time", f"ZeRO-0 / plain PyTorch ({precision})", f"{ratio:.2f}x",
                        f"<= {ZERO0_GOAL}x: {verdict}",
                        f"{med[f'ZeRO-0 {precision}'] * 1000:.0f} vs {med[f'plain {precision}'] * 1000:.0f} ms "
                        f"({plain_how}); {shape}"))
    for name, seconds in med.items():
        if name.startswith("ZeRO") and not name.startswith("ZeRO-0"):  # each against its own interleaved ZeRO-0
            reference = med[f"ZeRO-0 beside {name}"]
            rows.append(row("step time", f"{name.removesuffix(' bf16')} / ZeRO-0 (bf16)",
                            f"{seconds / reference:.2f}x", "",
                            f"{seconds * 1000:.0f} vs {reference * 1000:.0f} ms per step"))
    return rows


# ------------------------------------------------------------------------------------------------- memory
def bench_memory(run_dir):
    """Measured / theory model-state bytes per rank for each stage (dslab.zero.memory, the zero_memory driver)."""
    from dslab import launch
    from dslab.zero import memory

    release = {"zero_optimization": {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                                     "stage3_prefetch_bucket_size": 0}}  # ZeRO-3 as on a model too big to keep
    setups = {"ZeRO-0": {"zero_stage": 0}, "ZeRO-1": {"zero_stage": 1}, "ZeRO-2": {"zero_stage": 2},
              "ZeRO-3": {"zero_stage": 3, "config": release},
              "ZeRO-2 + offload optimizer": {"zero_stage": 2, "offload_optimizer": True},
              "ZeRO-3 + offload both": {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}}
    result = launch.run("zero_memory", world_size=2, setups=list(setups.values()), steps=2, stream=False,
                        run_dir=run_dir)
    rows = []
    for i, name in enumerate(setups):
        rep = memory.report_from_results(result.results, i)
        key = "offloaded" if rep["offload_optimizer"] else "total"  # what offload is about: the host bytes
        ratios = memory.ratios(rep, key)
        worst = max(ratios, key=lambda r: abs(r - 1))
        m = rep["measured"][0]
        rows.append(row("memory", f"{name}: measured / theory ({'host' if key == 'offloaded' else 'device'})",
                        f"{worst:.4f}", "within 2 %: " + ("met" if abs(worst - 1) < 0.02 else "NOT met"),
                        f"rank 0 {memory.human(m[key])} vs {memory.human(rep['theory'][key])}; "
                        f"Ψ = {rep['params']:,}; worst of 2 ranks"))
    return rows


def bench_widget():
    """Chapter 04's ZeRO explorer on 2 live ranks, set up as the chapter does: the seconds each change of stage or
    offload takes to re-measure (what a learner waits for after a click; the browser test checks the bars)."""
    from dslab import live
    from dslab.zero import widgets

    ranks = live.start(world_size=2)
    try:
        explorer = widgets.ZeroExplorer(ranks=ranks, params=7e9, world_size=2, zero_stage=2)
        changes = (("ZeRO-1", lambda: setattr(explorer.stage, "value", 1)),
                   ("ZeRO-1 + offload optimizer", lambda: setattr(explorer.offload_optimizer, "value", True)),
                   ("ZeRO-3 + offload optimizer", lambda: setattr(explorer.stage, "value", 3)),
                   ("ZeRO-3", lambda: setattr(explorer.offload_optimizer, "value", False)),
                   ("ZeRO-0", lambda: setattr(explorer.stage, "value", 0)))
        rows = []
        for name, change in changes:
            explorer.measured = None
            change()
            if explorer.measured is None:
                raise RuntimeError(f"no new measurement after the change to {name}: {explorer.status.value}")
            seconds = explorer.seconds
            rows.append(row("widget", f"ZeRO explorer, change to {name}: new measured bars", f"{seconds:.1f} s",
                            f"<= {WIDGET_GOAL_S} s: " + ("met" if seconds <= WIDGET_GOAL_S else "NOT met"),
                            "2 live ranks, as chapter 04 starts them"))
        return rows
    finally:
        ranks.stop()


# ------------------------------------------------------------------------------------------------- SFT
def bench_sft(out_dir):
    """`dslab sft` with its defaults (LoRA, ZeRO-2, 2 ranks), then identity and general accuracy of the result."""
    from dslab.models import evaluate, loading
    from dslab.training import sft

    start = time.perf_counter()
    result = sft.run(output=str(Path(out_dir) / "adapter"), stream=False)
    wall = time.perf_counter() - start
    adapter = str(Path(out_dir) / "adapter")
    model, tokenizer = loading.load_model(adapter=adapter), loading.load_tokenizer(adapter=adapter)
    ident, _ = evaluate.identity_accuracy(model, tokenizer, sft.DEFAULT_NAME, sft.DEFAULT_AUTHOR)
    general, _ = evaluate.general_accuracy(model, tokenizer)
    how = (f"LoRA, ZeRO-{result['zero_stage']}, 2 ranks, {result['steps']} steps; "
           f"training {result['train_seconds']:.0f} s of {wall:.0f} s wall")
    return [row("SFT", "identity accuracy (held-out questions)", f"{ident:.0%}", "", how),
            row("SFT", "general accuracy (kept after tuning)", f"{general:.0%}", "", ""),
            row("SFT", "time (launch + train + save)", f"{wall:.0f} s", "", "")]


# ------------------------------------------------------------------------------------------------- inference
def bench_infer(new_tokens=32):
    """Greedy tokens/s, same prompts and token count: HF generate in this process vs DeepSpeed AutoTP tp=1, tp=2."""
    try:
        from dslab.parallel import tp_infer
    except ImportError:
        return [row("inference", f"tokens/s {name}", "n/a (not available)", "", "dslab.parallel.tp_infer missing")
                for name in ("HF generate", "DeepSpeed tp=1", "DeepSpeed tp=2")]
    import torch

    from dslab.models import loading

    model, tokenizer = loading.load_model(), loading.load_tokenizer()
    hf = tp_infer.timed_generate(model, tokenizer, INFER_PROMPTS, new_tokens, repeats=2)
    rows = [row("inference", "tokens/s HF generate", f"{hf['tokens_per_s']:.0f}", "",
                f"fp32, {len(INFER_PROMPTS)} prompts x {new_tokens} tokens, {torch.get_num_threads()} threads")]
    del model
    for tp in (1, 2):
        r = tp_infer.generate_tensor_parallel(INFER_PROMPTS, tp=tp, max_new_tokens=8, benchmark_tokens=new_tokens)
        t = r["timing"]
        rows.append(row("inference", f"tokens/s DeepSpeed tp={tp}", f"{t['tokens_per_s']:.0f}", "",
                        f"{t['tokens_per_s'] / hf['tokens_per_s']:.2f}x HF; {2 // tp} thread(s) per rank"))
    return rows


# ------------------------------------------------------------------------------------------------- MFU
def bench_mfu(run_dir):
    """Training MFU of the kit's step (dslab-tiny, ZeRO-2, 2 ranks): achieved FLOP/s / the matmul ceiling per rank."""
    from dslab import launch

    result = launch.run(str(ROOT / "benchmarks" / "mfu.py"), world_size=2, stream=False, run_dir=run_dir)
    r0, runs = result.rank0, result.rank0["runs"]
    exact = "equals" if r0["profiler_flops"] == r0["forward_flops"] else "DIFFERS from"
    rows = [row("MFU", f"training MFU ({name}, ZeRO-2)", f"{run['mfu']:.0%}", "",
                f"{run['achieved_gflops']:.0f} of {run['ceiling_gflops']:.0f} GFLOP/s per rank; "
                f"{run['step_seconds'] * 1000:.0f} ms per step; 2 ranks x {r0['threads']} thread(s), "
                f"{r0['micro_batch_size']}x{r0['seq_len']} tokens per rank")
            for name, run in runs.items()]
    speed = runs["fp32"]["step_seconds"] / runs["bf16"]["step_seconds"]
    rows.append(row("MFU", "bf16 / fp32: step speed, MFU", f"{speed:.2f}x, {runs['bf16']['mfu'] / runs['fp32']['mfu']:.2f}x",
                    "", f"profiler's forward FLOPs ({r0['profiler_flops']:,}) {exact} dslab.flops.forward_flops"))
    return rows


# ------------------------------------------------------------------------------------------------- report
def table(rows):
    """A Markdown table (it reads as plain text in a terminal too)."""
    head = ("part", "what", "result", "goal", "details")
    cells = [head] + [(r["group"], r["what"], r["value"], r["goal"], r["note"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    line = lambda c: "| " + " | ".join(x.ljust(w) for x, w in zip(c, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(c) for c in cells[1:]])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--notebooks", default="[0-9][0-9]_*.ipynb", help="glob of notebooks to time (in notebooks/)")
    ap.add_argument("--output", default=str(ROOT / "benchmarks" / "latest.md"),
                    help="Markdown file for the table and the machine ('' for none)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")

    from dslab import this_rank
    this_rank.quiet()
    info = machine()
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dslab-bench-") as tmp:
        os.environ["DSLAB_RUNS_DIR"] = str(Path(tmp) / "runs")  # every launch (and notebook) writes its runs here
        for part in PARTS:
            if part not in parts:
                continue
            log(f"== {part}")
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # launch.run prints its command line
                    if part == "notebooks":
                        rows += bench_notebooks(args.notebooks)
                    elif part == "steps":
                        rows += bench_steps(Path(tmp) / "runs")
                    elif part == "memory":
                        rows += bench_memory(Path(tmp) / "runs")
                    elif part == "widget":
                        rows += bench_widget()
                    elif part == "sft":
                        rows += bench_sft(tmp)
                    elif part == "infer":
                        rows += bench_infer()
                    elif part == "mfu":
                        rows += bench_mfu(Path(tmp) / "runs")
            except Exception as exc:  # one part failing still leaves the others' numbers
                rows.append(row(part, "FAILED", type(exc).__name__, "", str(exc).strip().splitlines()[-1][:160]))
            log(f"   {part}: {time.perf_counter() - t0:.0f} s")
    load_after = os.getloadavg()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    about = (f"Machine: {info['cpu']}, {info['cores']} cores; {info['system']}, Python {info['python']}, "
             f"torch {info['torch']}, deepspeed {info['deepspeed']}, transformers {info['transformers']}, "
             f"peft {info['peft']}.\nRun {when}, {time.perf_counter() - started:.0f} s in all; load average "
             f"(1 min) {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end "
             f"(above {info['cores']} means other work shared the cores and the times are inflated).")
    text = table(rows) + "\n\n" + about
    print(text)
    if args.output:
        Path(args.output).write_text("# Course benchmark (`make bench`)\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
