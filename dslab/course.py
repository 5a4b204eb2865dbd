"""The course map: each chapter, the features it needs and those some of its cells ask for, checked against `dslab env`."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Chapter:
    """One notebook: what it teaches, how many ranks it starts, and what it needs from the machine."""

    number: int
    notebook: str
    topic: str
    ranks: int                 # most processes the chapter runs at once
    needs: tuple = ()          # features (names from dslab.env.features) without which it cannot run
    guarded_cells: tuple = ()  # features some cells use if the machine has them; else they explain


CHAPTERS = (
    Chapter(0, "00_setup", "environment report, what runs where, a first 2-rank launch", 2),
    Chapter(1, "01_distributed_basics", "ranks, process groups, collectives, DDP vs deepspeed.initialize", 2,
            guarded_cells=("nccl",)),
    Chapter(2, "02_mixed_precision", "fp32 / fp16 / bf16, loss scaling, master weights", 2,
            needs=("bf16 training",), guarded_cells=("fp16 DeepSpeed optimizer",)),
    Chapter(3, "03_gradient_accumulation", "micro-batches, accumulation, the batch-size triple", 2),
    Chapter(4, "04_zero", "ZeRO 1/2/3 and CPU offload, memory per rank vs the paper", 2,
            needs=("bf16 training", "ZeRO-Offload (cpu_adam)")),
    Chapter(5, "05_lora_sft", "LoRA self-cognition fine-tuning under ZeRO-2", 2, needs=("bf16 training",)),
    Chapter(6, "06_merge_lora", "merging a LoRA adapter, also from ZeRO-3", 2),
    Chapter(7, "07_inference", "init_inference, AutoTP tensor parallelism, kernel injection", 2,
            needs=("AutoTP inference",), guarded_cells=("kernel injection",)),
    Chapter(8, "08_cli_and_multinode", "the pipeline from a shell, launchers, a 2-node job on one machine", 2),
    Chapter(9, "09_hf_trainer", "the Hugging Face Trainer on DeepSpeed, ZeRO-3 loading and saving, accelerate", 2),
    Chapter(10, "10_communication", "the bytes each rank sends per step: measured, predicted, the paper's ideal", 2,
            needs=("bf16 training",)),
    Chapter(11, "11_parallelism", "pipeline, tensor and sequence parallel training; TP x DP on 4 ranks", 4),
    Chapter(12, "12_debugging_hangs", "jobs that hang: process-group timeout, DETAIL, every rank's stack", 2),
    Chapter(13, "13_where_time_goes", "the flops profiler, MFU, Muon and bf16 master weights", 2,
            needs=("bf16 training",)),
    Chapter(14, "14_swift_and_llamafactory", "ms-swift and LLaMA-Factory: LoRA SFT, merge, 2 nodes, in venvs of their own",
            2, needs=("bf16 training",)),
)


def course_map(features):
    """One row per chapter: does it run here, and which of its GPU cells will be skipped.

    `features` is dslab.env.machine_facts()["features"] (a list of {"name", "available", "reason"}).
    """
    available = {f["name"]: f["available"] for f in features}
    unknown = {name for ch in CHAPTERS for name in ch.needs + ch.guarded_cells} - set(available)
    if unknown:
        raise KeyError(f"features not in the environment report: {sorted(unknown)}")
    rows = []
    for ch in CHAPTERS:
        missing = [name for name in ch.needs if not available[name]]
        skipped = [name for name in ch.guarded_cells if not available[name]]
        rows.append({"chapter": f"{ch.number:02d}", "notebook": ch.notebook, "topic": ch.topic, "ranks": ch.ranks,
                     "runs here": not missing, "missing": missing, "skipped cells": skipped})
    return rows


def format_map(rows):
    """The course map as a fixed-width text table."""
    lines = [f"{'ch':<3} {'notebook':<26} {'ranks':>5}  {'runs here':<10} cells skipped here (missing feature)"]
    for row in rows:
        runs = "yes" if row["runs here"] else "NO: needs " + ", ".join(row["missing"])
        lines.append(f"{row['chapter']:<3} {row['notebook']:<26} {row['ranks']:>5}  {runs:<10} "
                     f"{', '.join(row['skipped cells']) or '-'}")
    return "\n".join(lines)
