"""The course map: the one list of chapters. Each chapter's files (notebook and zh twin, decks, solutions, exercise
modules), titles, minutes and the modules it teaches from; what the machine must offer, checked against `dslab env`.

Code that needs the chapters reads CHAPTERS; tests/test_course_manifest.py checks the prose that repeats them (the
READMEs' chapter tables, the instructor guides' timing tables and totals, each deck's minutes) and that no notebook,
deck or exercise module exists outside this list. docs/architecture.md, "How to add a chapter", is the checklist.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Chapter:
    """One notebook: what it teaches, how many ranks it starts, what it needs from the machine, and its files."""

    number: int
    notebook: str              # the stem every file of the chapter is named after: notebooks/<stem>.ipynb, slides/...
    topic: str
    ranks: int                 # most processes the chapter runs at once
    needs: tuple = ()          # features (names from dslab.env.features) without which it cannot run
    guarded_cells: tuple = ()  # features some cells use if the machine has them; else they explain
    title: str = ""            # the notebook's first heading after "NN · ", and its zh twin's
    title_zh: str = ""
    teach_minutes: int = 0     # the instructor guides' timing table: deck, notebook and exercises together
    exercise_minutes: int = 0  # the part of the teaching time given to the exercises
    modules: tuple = ()        # the dslab modules its code cells import, sorted
    more_exercises: tuple = ()  # exercise modules of their own that dslab/exercises/chNN.py imports (coding exercises)
    # runs ms-swift and LLaMA-Factory in venvs of their own (make swift llamafactory), so tools.measure_chapters
    # leaves it out and its tolerances were not measured on the kit's kernel paths
    framework_venvs: bool = False

    @property
    def nn(self):
        """'05': the number as file names, tables and exercise ids write it."""
        return f"{self.number:02d}"

    @property
    def notebooks(self):
        """The notebook and its Chinese twin, relative to the repository root."""
        return f"notebooks/{self.notebook}.ipynb", f"notebooks/zh/{self.notebook}.ipynb"

    @property
    def decks(self):
        """The English deck and its Chinese twin."""
        return f"slides/{self.notebook}.md", f"slides/zh/{self.notebook}.md"

    @property
    def solutions(self):
        """The file of worked answers to its exercises."""
        return f"notebooks/solutions/{self.nn}_solutions.py"

    @property
    def exercise_modules(self):
        """dslab.exercises.chNN (which registers the chapter's checkers), then the modules it imports for them."""
        return (f"dslab.exercises.ch{self.nn}",) + self.more_exercises


CHAPTERS = (
    Chapter(0, "00_setup", "environment report, what runs where, a first 2-rank launch", 2,
            title="Setup: what runs where", title_zh="环境准备：哪些功能在哪里运行",
            teach_minutes=20, exercise_minutes=5,
            modules=("dslab.course", "dslab.env", "dslab.exercises", "dslab.launch", "dslab.machine",
                     "dslab.this_rank")),
    Chapter(1, "01_distributed_basics", "ranks, process groups, collectives, DDP vs deepspeed.initialize", 2,
            guarded_cells=("nccl",),
            title="Distributed basics", title_zh="分布式基础",
            teach_minutes=45, exercise_minutes=10,
            modules=("dslab.comm.wire", "dslab.exercises", "dslab.launch", "dslab.live", "dslab.noise")),
    Chapter(2, "02_mixed_precision", "fp32 / fp16 / bf16, loss scaling, master weights", 2,
            needs=("bf16 training",), guarded_cells=("fp16 DeepSpeed optimizer",),
            title="Mixed precision: fp16, bf16 and loss scaling", title_zh="混合精度：fp16、bf16 与损失缩放",
            teach_minutes=45, exercise_minutes=10,
            modules=("dslab.config.build", "dslab.config.check", "dslab.env", "dslab.exercises", "dslab.live",
                     "dslab.models.loading", "dslab.plots", "dslab.precision.formats", "dslab.precision.loss_scaling",
                     "dslab.this_rank", "dslab.training.accumulation", "dslab.zero.memory"),
            more_exercises=("dslab.exercises.ch02_amp_clip",)),
    Chapter(3, "03_gradient_accumulation", "micro-batches, accumulation, the batch-size triple", 2,
            title="Gradient accumulation", title_zh="梯度累积",
            teach_minutes=35, exercise_minutes=10,
            modules=("dslab.config.build", "dslab.config.check", "dslab.exercises", "dslab.live", "dslab.noise",
                     "dslab.plots", "dslab.precision.formats", "dslab.this_rank", "dslab.training.accumulation")),
    Chapter(4, "04_zero", "ZeRO 1/2/3 and CPU offload, memory per rank vs the paper", 2,
            needs=("bf16 training", "ZeRO-Offload (cpu_adam)"),
            title="ZeRO: who holds which bytes", title_zh="ZeRO：哪些字节由谁持有",
            teach_minutes=60, exercise_minutes=15,
            modules=("dslab.config.build", "dslab.config.check", "dslab.exercises", "dslab.live", "dslab.machine",
                     "dslab.models.loading", "dslab.plots", "dslab.this_rank", "dslab.zero.engine_memory",
                     "dslab.zero.memory", "dslab.zero.runner", "dslab.zero.widgets")),
    Chapter(5, "05_lora_sft", "LoRA self-cognition fine-tuning under ZeRO-2", 2, needs=("bf16 training",),
            title="LoRA supervised fine-tuning: teach the model who it is", title_zh="LoRA 有监督微调：教模型认识自己",
            teach_minutes=50, exercise_minutes=10,
            modules=("dslab.config.build", "dslab.config.check", "dslab.data", "dslab.exercises", "dslab.launch",
                     "dslab.models.evaluate", "dslab.models.infer", "dslab.models.loading", "dslab.models.lora",
                     "dslab.plots", "dslab.this_rank", "dslab.training.sft", "dslab.training.sft_measure",
                     "dslab.zero.memory")),
    Chapter(6, "06_merge_lora", "merging a LoRA adapter, also from ZeRO-3", 2,
            title="Merging a LoRA adapter (also one trained under ZeRO-3)",
            title_zh="合并 LoRA 适配器（包括在 ZeRO-3 下训练的适配器）",
            teach_minutes=30, exercise_minutes=10,
            modules=("dslab.exercises", "dslab.models.evaluate", "dslab.models.infer", "dslab.models.loading",
                     "dslab.models.lora", "dslab.noise", "dslab.this_rank", "dslab.training.sft")),
    Chapter(7, "07_inference", "init_inference, AutoTP tensor parallelism, kernel injection", 2,
            needs=("AutoTP inference",), guarded_cells=("kernel injection",),
            title="DeepSpeed inference: tensor parallelism with AutoTP", title_zh="DeepSpeed 推理：用 AutoTP 做张量并行",
            teach_minutes=35, exercise_minutes=10,
            modules=("dslab.exercises", "dslab.launch", "dslab.live", "dslab.machine", "dslab.models.infer",
                     "dslab.models.loading", "dslab.parallel.tp_infer", "dslab.this_rank")),
    Chapter(8, "08_cli_and_multinode", "the pipeline from a shell, launchers, a 2-node job on one machine", 2,
            title="The command line, launchers and multi-node jobs", title_zh="命令行、启动器与多节点作业",
            teach_minutes=40, exercise_minutes=10,
            modules=("dslab.config.build", "dslab.exercises", "dslab.launch", "dslab.launch.multinode",
                     "dslab.this_rank", "dslab.training.sft")),
    Chapter(9, "09_hf_trainer", "the Hugging Face Trainer on DeepSpeed, ZeRO-3 loading and saving, accelerate", 2,
            title="From the course to the frameworks people train with", title_zh="从课程走向实际训练所用的框架",
            teach_minutes=45, exercise_minutes=10,
            modules=("dslab.config.build", "dslab.config.check", "dslab.data", "dslab.exercises", "dslab.launch",
                     "dslab.machine", "dslab.models.evaluate", "dslab.models.loading", "dslab.models.lora",
                     "dslab.this_rank", "dslab.training.hf_bridge", "dslab.training.sft")),
    Chapter(10, "10_communication", "the bytes each rank sends per step: measured, predicted, the paper's ideal", 2,
            needs=("bf16 training",),
            title="Communication, to the byte", title_zh="通信：精确到字节的测量",
            teach_minutes=40, exercise_minutes=20,
            modules=("dslab.comm.bytes_table", "dslab.comm.gloo_bytes", "dslab.comm.step_bytes", "dslab.comm.wire",
                     "dslab.comm.zero3_fetch", "dslab.config.build", "dslab.config.check", "dslab.exercises",
                     "dslab.live", "dslab.models.loading", "dslab.plots", "dslab.this_rank", "dslab.zero.memory",
                     "dslab.zero.runner")),
    Chapter(11, "11_parallelism", "pipeline, tensor and sequence parallel training; TP x DP on 4 ranks", 4,
            title="Beyond data parallel: pipeline and tensor parallel training",
            title_zh="超越数据并行：流水线并行与张量并行训练",
            teach_minutes=50, exercise_minutes=35,
            modules=("dslab.config.check", "dslab.exercises", "dslab.live", "dslab.models.loading",
                     "dslab.parallel.hpz", "dslab.parallel.pipeline", "dslab.parallel.tensor_parallel",
                     "dslab.this_rank"),
            more_exercises=("dslab.exercises.ch11_pipeline", "dslab.exercises.ch11_tensor_data",
                            "dslab.exercises.ch11_ulysses")),
    Chapter(12, "12_debugging_hangs", "jobs that hang: process-group timeout, DETAIL, every rank's stack", 2,
            title="Debugging lab: jobs that hang", title_zh="调试实验：卡住的作业",
            teach_minutes=40, exercise_minutes=25,
            modules=("dslab.exercises", "dslab.exercises.ch12", "dslab.hangs.diagnoses", "dslab.launch", "dslab.live",
                     "dslab.models.loading", "dslab.this_rank")),
    Chapter(13, "13_where_time_goes", "the flops profiler, MFU, Muon and bf16 master weights", 2,
            needs=("bf16 training",),
            title="Where the time goes, and newer memory levers", title_zh="时间花在哪里，以及较新的省显存手段",
            teach_minutes=40, exercise_minutes=20,
            modules=("dslab.config.build", "dslab.config.check", "dslab.exercises", "dslab.flops", "dslab.launch",
                     "dslab.live", "dslab.machine", "dslab.models.loading", "dslab.this_rank", "dslab.zero.memory",
                     "dslab.zero.optimizer_states")),
    Chapter(14, "14_swift_and_llamafactory",
            "ms-swift and LLaMA-Factory: LoRA SFT, merge, 2 nodes, in venvs of their own", 2, needs=("bf16 training",),
            title="ms-swift and LLaMA-Factory, run for real", title_zh="真正运行 ms-swift 和 LLaMA-Factory",
            teach_minutes=45, exercise_minutes=5,
            modules=("dslab.data", "dslab.exercises", "dslab.launch", "dslab.launch.frameworks",
                     "dslab.models.evaluate", "dslab.plots", "dslab.this_rank", "dslab.training.equivalents",
                     "dslab.training.framework_data", "dslab.zero.memory"),
            framework_venvs=True),
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
