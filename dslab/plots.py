"""Matplotlib figures for the chapters; every function returns (Figure, data) so notebooks assert on the data."""


def pyplot():
    """matplotlib.pyplot, drawing off-screen (Agg) outside a notebook: tests, CI and the slide builder have no display."""
    import matplotlib
    if not _in_notebook():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _figure(ncols=1, width=6.0, height=3.2):
    plt = pyplot()
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def _in_notebook():
    try:
        from IPython import get_ipython
        return get_ipython() is not None
    except ImportError:
        return False


# ---------------------------------------------------------------------------------------- mixed precision

def loss_scale_trace(trace, deepspeed_trace=None):
    """The loss scale at each step (log2 axis), skipped steps marked; DeepSpeed's scaler beside torch's if given.

    data: {"step", "scale", "skipped", "deepspeed_scale"} lists (scale used at each step).
    """
    fig, (ax,) = _figure(width=7.0)
    steps = [r["step"] for r in trace]
    scale = [r["scale"] for r in trace]
    skipped = [r["skipped"] for r in trace]
    ax.step(steps, scale, where="post", label="torch GradScaler", lw=2)
    ax.scatter([s for s, k in zip(steps, skipped) if k], [v for v, k in zip(scale, skipped) if k],
               color="red", zorder=3, label="step skipped (overflow)")
    data = {"step": steps, "scale": scale, "skipped": skipped, "deepspeed_scale": None}
    if deepspeed_trace:
        ds_steps = [r["step"] for r in deepspeed_trace]
        ds_scale = [r["scale"] for r in deepspeed_trace]
        ax.step(ds_steps, ds_scale, where="post", ls="--", label="DeepSpeed DynamicLossScaler")
        data["deepspeed_scale"] = ds_scale
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale used")
    ax.set_title("Dynamic loss scaling: halve on overflow, grow after a window of good steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, data


def gradient_histogram(grads, scale, smallest_subnormal, max_value):
    """Histogram of log2 |gradient| before and after multiplying by `scale`, with fp16's limits drawn.

    data: fraction of nonzero gradients fp16 flushes to zero (|g| < smallest_subnormal / 2) before and
    after scaling, and the fraction that would overflow (> max_value) after scaling.
    """
    import math
    import torch
    g = grads.detach().double().abs().flatten()
    g = g[g > 0]
    fig, (ax,) = _figure(width=7.0)
    bins = torch.linspace(-40, 20, 121)
    for values, label in ((g, "fp32 gradients"), (g * scale, f"x loss scale 2^{int(math.log2(scale))}")):
        ax.hist(torch.log2(values).clamp(-40, 20).numpy(), bins=bins.numpy(), alpha=0.6, label=label)
    ax.axvline(math.log2(smallest_subnormal), color="k", ls="--", lw=1, label="fp16 smallest subnormal")
    ax.axvline(math.log2(max_value), color="r", ls="--", lw=1, label="fp16 max")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)
    fig.tight_layout()
    half = smallest_subnormal / 2
    data = {"flushed_before": (g <= half).double().mean().item(),
            "flushed_after": (g * scale <= half).double().mean().item(),
            "overflow_after": (g * scale > max_value).double().mean().item()}
    return fig, data


# ---------------------------------------------------------------------------------------- accumulation

def activation_memory(sweep):
    """Peak activation memory vs micro batch size, and vs accumulation steps (right loop and one-backward loop).

    `sweep` is dslab.training.accumulation.activation_sweep's result; data is the same numbers in MB.
    """
    fig, (left, right) = _figure(ncols=2, width=4.6)
    mb = lambda pairs: ([x for x, _ in pairs], [b / 2**20 for _, b in pairs])
    x, y = mb(sweep["micro"])
    left.plot(x, y, "o-")
    left.set_xlabel("micro batch size (accumulation steps 1)")
    left.set_ylabel("peak activation memory (MB)")
    left.set_xscale("log", base=2)
    left.set_title("grows with the micro batch")
    data = {"micro": list(zip(x, y))}
    for key, label in (("accum", "backward per micro-batch"), ("accum_one_backward", "sum losses, one backward")):
        x, y = mb(sweep[key])
        right.plot(x, y, "o-", label=label)
        data[key] = list(zip(x, y))
    right.set_xlabel("accumulation steps (micro batch 2)")
    right.set_xscale("log", base=2)
    right.set_title("flat in accumulation steps (done right)")
    right.legend(fontsize=8)
    right.set_ylim(bottom=0)
    left.set_ylim(bottom=0)
    fig.tight_layout()
    return fig, data


# ---------------------------------------------------------------------------------------- ZeRO (chapter 04)

_ZERO_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "buffers": "#b0b0b0",
                "offloaded": "#8172b3"}


def zero_partition_map(world_size=4):
    """Who holds what: for stages 0-3, which slices of parameters, gradients and optimizer states each rank keeps.

    Each model state is drawn as a strip as long as its bytes per parameter (2, 2 and 12 in mixed precision),
    cut into `world_size` slices; a rank's strip is coloured where it holds that slice.
    data: {stage: {part: [[slice indices held by rank r] for r in ranks]}}.
    """
    from matplotlib.patches import Rectangle

    parts = ("params", "grads", "optimizer")
    length = {"params": 2, "grads": 2, "optimizer": 12}
    fig, axes = _figure(ncols=4, width=3.4, height=0.5 * world_size * 3 + 1.0)
    data = {}
    for stage, ax in enumerate(axes):
        partitioned = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
        data[stage] = {p: [[r] if partitioned[p] else list(range(world_size)) for r in range(world_size)]
                       for p in parts}
        for r in range(world_size):
            for j, part in enumerate(parts):
                y = (world_size - 1 - r) * 3.6 + (2 - j)
                w = length[part] / world_size
                for s in range(world_size):
                    held = s in data[stage][part][r]
                    ax.add_patch(Rectangle((s * w, y), w, 0.8, facecolor=_ZERO_COLORS[part] if held else "white",
                                           edgecolor="#999", lw=0.5))
            ax.text(-0.3, (world_size - 1 - r) * 3.6 + 1.4, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.set_xlim(-3.2, 12.2)
        ax.set_ylim(-0.4, world_size * 3.6)
        ax.axis("off")
        ax.set_title(f"ZeRO-{stage}", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=_ZERO_COLORS[p]) for p in parts]
    fig.legend(handles, ["parameters (2 B/param)", "gradients (2 B/param)", "optimizer states (12 B/param)"],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"What each of {world_size} ranks keeps (coloured = held; each strip is one model state of the "
                 f"whole model, cut into {world_size} slices)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.93))
    return fig, data


def zero_memory_bars(rows):
    """Grouped stacked bars: theory beside measured bytes per rank, one group per setup.

    rows: [{"label", "theory": {params, grads, optimizer, offloaded}, "measured": {... buffers ...}}];
    data: {"labels", "theory_total", "measured_total", "measured_buffers", "offloaded"} in bytes.
    """
    fig, (ax,) = _figure(width=8.0, height=3.6)
    mib = 2**20
    data = {"labels": [], "theory_total": [], "measured_total": [], "measured_buffers": [], "offloaded": []}
    for i, row in enumerate(rows):
        for dx, kind in ((-0.3, "theory"), (0.0, "measured")):
            values, base = row[kind], 0.0
            stack = ("params", "grads", "optimizer") + (("buffers",) if kind == "measured" else ())
            for part in stack:
                h = values.get(part, 0) / mib
                ax.bar(i + dx, h, width=0.28, bottom=base, color=_ZERO_COLORS[part],
                       alpha=1.0 if kind == "theory" else 0.6, edgecolor="black" if kind == "measured" else None,
                       lw=0.6, label=part if i == 0 and (kind == "measured" or part != "buffers") and
                       (kind == "theory" or part == "buffers") else None)
                base += h
        off = row["measured"].get("offloaded", 0) / mib
        if off:
            ax.bar(i + 0.3, off, width=0.28, color=_ZERO_COLORS["offloaded"], alpha=0.7,
                   label="offloaded (host)" if "offloaded (host)" not in ax.get_legend_handles_labels()[1] else None)
        data["labels"].append(row["label"])
        data["theory_total"].append(row["theory"]["total"])
        data["measured_total"].append(row["measured"]["total"])
        data["measured_buffers"].append(row["measured"].get("buffers", 0))
        data["offloaded"].append(row["measured"].get("offloaded", 0))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(data["labels"], fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title("Model states per rank: theory (left, solid) vs measured (middle, outlined); host (right)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=5, loc="upper right")
    fig.tight_layout()
    return fig, data


def zero_loss_curves(curves):
    """Loss per optimizer step for each setup ({label: [loss, ...]}); data is that dict."""
    fig, (ax,) = _figure(width=6.0, height=3.0)
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, marker="o", ms=3, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title("Same data, same seed: ZeRO changes where bytes live, not the math", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, dict(curves)


# ---------------------------------------------------------------------------------------- fine-tuning

def loss_curve(loss_log, window=8, title="Training loss"):
    """Loss per optimizer step with a trailing mean over `window` steps; data holds the steps, losses and means."""
    steps = [e["step"] for e in loss_log]
    losses = [e["loss"] for e in loss_log]
    smoothed = [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]
    fig, (ax,) = _figure(width=6.0, height=3.0)
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="per step (mean over every label token of the step)")
    ax.plot(steps, smoothed, lw=1.8, label=f"mean of the last {window} steps")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, {"step": steps, "loss": losses, "smoothed": smoothed}


def framework_runs(runs):
    """Loss and learning rate per optimizer step of the same SFT run in several frameworks, side by side.

    runs: {label: [{"step", "loss", "lr"}, ...]} (dslab.training.framework_data.training_log, dslab's loss_log.json); data: the
    same, as {label: {"step": [...], "loss": [...], "lr": [...]}}."""
    fig, (loss_ax, lr_ax) = _figure(ncols=2, width=5.0, height=3.2)
    data = {}
    for label, log in runs.items():
        data[label] = {key: [e[key] for e in log] for key in ("step", "loss", "lr")}
        loss_ax.plot(data[label]["step"], data[label]["loss"], lw=1.2, label=label)
        lr_ax.plot(data[label]["step"], data[label]["lr"], lw=1.2, label=label)
    loss_ax.set(xlabel="optimizer step", ylabel="loss (nats per token)")
    loss_ax.set_title("Training loss, as each framework logs it", fontsize=9)
    lr_ax.set(xlabel="optimizer step", ylabel="learning rate")
    lr_ax.set_title("Learning-rate schedule", fontsize=9)
    for ax in (loss_ax, lr_ax):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, data


# ---------------------------------------------------------------------------------------- communication

_COMM_BARS = (("ideal", "ideal (ZeRO paper, ring)", "#b0b0b0"),
              ("gloo", "DeepSpeed on gloo, predicted", "#4c72b0"),
              ("measured", "measured (rank 0, socket writes)", "#dd8452"),
              ("nccl", "DeepSpeed on NCCL, computed", "#55a868"))


def comm_bytes_bars(rows, title="Bytes each rank sends per optimizer step"):
    """Grouped bars per setup: the paper's ideal, DeepSpeed's algorithm on gloo, measured, and on NCCL.

    rows: [{"label", "ideal", "gloo", "measured" (optional), "nccl"}] in units of Ψ (bytes / parameter bytes);
    data: {"labels", and one list per kind, None where a row has no value}.
    """
    fig, (ax,) = _figure(width=9.0, height=3.4)
    data = {"labels": [row["label"] for row in rows]}
    for k, (kind, label, color) in enumerate(_COMM_BARS):
        data[kind] = [row.get(kind) for row in rows]
        xs = [i + (k - 1.5) * 0.2 for i, v in enumerate(data[kind]) if v is not None]
        if xs:  # a kind no row has (nothing measured) gets no bars and no key
            ax.bar(xs, [v for v in data[kind] if v is not None], width=0.19, color=color, label=label)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(data["labels"], fontsize=7, rotation=20, ha="right")
    ax.set_ylim(0, 1.3 * max(v for kind, _, _ in _COMM_BARS for v in data[kind] if v is not None))  # room for the key
    ax.set_ylabel("Ψ (parameter bytes)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig, data


# ---------------------------------------------------------------------------------------- a workshop's progress

def class_progress(exercise_rows):
    """Per exercise, how many learners passed it and how many tried it and have not passed yet (stacked bars).

    exercise_rows: (exercise, passed, not yet, ...) as dslab.exercises.progress.class_rows gives them; data: the
    same as {"exercise": [...], "passed": [...], "not yet": [...]}."""
    data = {"exercise": [r[0] for r in exercise_rows], "passed": [r[1] for r in exercise_rows],
            "not yet": [r[2] for r in exercise_rows]}
    fig, (ax,) = _figure(width=6.0, height=max(2.0, 0.22 * len(exercise_rows) + 1.0))
    rows = range(len(exercise_rows))
    ax.barh(rows, data["passed"], color="#55a868", label="passed")
    ax.barh(rows, data["not yet"], left=data["passed"], color="#dd8452", label="tried, not passed yet")
    ax.set_yticks(list(rows), data["exercise"], fontsize=7)
    ax.invert_yaxis()   # course order, top to bottom
    ax.set_xlabel("learners")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Exercises: who passed, who is still trying", fontsize=9)
    fig.tight_layout()
    return fig, data
