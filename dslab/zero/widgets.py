"""Widgets for the notebooks: the ZeRO explorer (per-rank memory from theory, measured on live ranks).

The chart is an SVG drawn into a widgets.HTML, so it changes without a kernel round-trip for images and a
browser test can read it: every bar segment is a <rect> with data-rank, data-kind, data-part, data-bytes.
Each control carries a stable CSS class (dslab-zero-*) for the same reason.
"""
import contextlib
import html
import io
import json
import math
import time

from dslab.zero import memory

COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "buffers": "#b0b0b0",
          "offloaded": "#8172b3"}
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
          "buffers": "buffers (measured)", "offloaded": "offloaded to host"}
STAGES = [("ZeRO-0: plain data parallel", 0), ("ZeRO-1: partition optimizer states", 1),
          ("ZeRO-2: + gradients", 2), ("ZeRO-3: + parameters", 3)]


def _unit(nbytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1


def bars_svg(bars, width=640, height=300):
    """An SVG stacked-bar chart of per-rank bytes: theory bars solid, measured bars outlined beside them."""
    top = max([sum(b.get(p, 0) for p in ("params", "grads", "optimizer", "buffers")) for b in bars]
              + [b.get("offloaded", 0) for b in bars] + [1])
    unit, scale = _unit(top)
    left, bottom, plot_h = 60, 40, height - 70
    ranks = sorted({b["rank"] for b in bars})
    slot = (width - left - 10) / max(1, len(ranks))
    bar_w = min(32, slot / 5)
    y = lambda v: height - bottom - plot_h * v / top  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="dslab-zero-svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):  # axis ticks in the chart's unit
        v = top * frac
        parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e5e5"/>'
                     f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v / scale:.3g}</text>')
    parts.append(f'<text x="12" y="{height / 2:.0f}" transform="rotate(-90 12 {height / 2:.0f})" '
                 f'text-anchor="middle">{unit} per rank</text>')
    for i, rank in enumerate(ranks):
        x0 = left + i * slot + slot / 2
        for bar in [b for b in bars if b["rank"] == rank]:
            offset = {"theory": -2.1, "measured": -1.0, "host": 0.1, "host-measured": 1.1}[bar["kind"]]
            x = x0 + offset * bar_w
            stack = ("offloaded",) if bar["kind"].startswith("host") else ("params", "grads", "optimizer", "buffers")
            base = 0
            for part in stack:
                value = bar.get(part) or 0
                if value <= 0:
                    continue
                style = (f'fill="{COLORS[part]}"' if not bar["kind"].endswith("measured") else
                         f'fill="{COLORS[part]}" fill-opacity="0.35" stroke="{COLORS[part]}" stroke-width="1.5"')
                title = f'rank {rank} {bar["kind"]}: {LABELS[part]} {memory.human(value)}'
                parts.append(f'<rect class="dslab-zero-bar" data-rank="{rank}" data-kind="{bar["kind"]}" '
                             f'data-part="{part}" data-bytes="{int(value)}" x="{x:.1f}" y="{y(base + value):.1f}" '
                             f'width="{bar_w:.1f}" height="{y(base) - y(base + value):.1f}" {style}>'
                             f'<title>{html.escape(title)}</title></rect>')
                base += value
        name = f"rank {rank}" if rank >= 0 else "every rank"
        parts.append(f'<text x="{x0:.1f}" y="{height - bottom + 14}" text-anchor="middle">{name}</text>')
    x = left
    for part in ("params", "grads", "optimizer", "buffers", "offloaded"):  # legend
        parts.append(f'<rect x="{x}" y="{height - 16}" width="10" height="10" fill="{COLORS[part]}"/>'
                     f'<text x="{x + 14}" y="{height - 7}">{LABELS[part]}</text>')
        x += 18 + 6.2 * len(LABELS[part])
    parts.append(f'<text x="{width - 10}" y="14" text-anchor="end">per rank: accelerator (theory, measured '
                 f'outlined), then host memory (theory, measured outlined)</text></svg>')
    return "".join(parts)


class ZeroExplorer:
    """Stage, offload, world size and model size in; per-rank memory bars out: theory at once, measured on ranks.

    ranks: live ranks (dslab.live.start): a change of stage or offload re-initializes DeepSpeed on them and
    re-measures in seconds, with no new launch; the measure button does the same for the model size on the
    slider. The model measured has the slider's size when its run fits `budget` bytes per rank, else the
    largest that does (the status line says so). Without ranks, the button launches real ranks instead
    (dslab.zero.runner.measure, the chapter's small model). measure_fn(zero_stage, world_size, offload_optimizer,
    offload_param, params) -> a dslab.zero.memory report replaces both.
    """

    MAX_RANKS_DRAWN = 8  # ranks hold the same bytes in theory; past 8 bars the chart draws one for all

    def __init__(self, params=7e9, world_size=8, zero_stage=2, offload_optimizer=False, offload_param=False,
                 precision="bf16", ranks=None, budget=None, measure_fn=None, measure_world_sizes=(1, 2, 3, 4)):
        import ipywidgets as W

        from dslab.zero import runner

        self.precision = precision
        self.ranks = ranks
        self.budget = budget or runner.DEFAULT_BUDGET
        self.live = ranks is not None  # live ranks: stage / offload changes re-measure by themselves
        if measure_fn is not None:
            self.measure_fn = measure_fn
        elif ranks is not None:
            self.measure_fn = lambda s, n, oo, op, psi: runner.measure_live(ranks, s, oo, op, params=psi,
                                                                          budget=self.budget)
        else:
            self.measure_fn = lambda s, n, oo, op, psi: runner.measure(s, n, oo, op, stream=False)
        self.measure_world_sizes = (ranks.world_size,) if ranks is not None else tuple(measure_world_sizes)
        self.measured = None  # the last measured report, drawn while the controls still match it
        self.seconds = None   # how long the last measurement took
        self._psi = None      # exact Ψ of the measured model (the slider shows it rounded to its step)
        self._syncing = False
        style = {"description_width": "150px"}
        layout = W.Layout(width="480px")
        self.stage = W.Dropdown(options=STAGES, value=zero_stage, description="ZeRO stage", style=style,
                                layout=layout)
        box = {"style": {"description_width": "initial"}, "layout": W.Layout(width="240px")}  # labels in full
        self.offload_optimizer = W.Checkbox(value=offload_optimizer, description="offload optimizer to CPU", **box)
        self.offload_param = W.Checkbox(value=offload_param, description="offload parameters to CPU", **box)
        self.world_size = W.IntSlider(value=world_size, min=1, max=64, description="world size N", style=style,
                                      layout=layout, continuous_update=True)
        self.params = W.FloatLogSlider(value=params, base=10, min=5, max=12, step=0.01, description="parameters Ψ",
                                       readout_format=".3g", style=style, layout=layout, continuous_update=True)
        self.measure_button = W.Button(description="measure", button_style="primary", icon="play",
                                       tooltip="run this stage, offload and model size on real ranks")
        self.summary = W.HTML()
        self.status = W.HTML()
        self.chart = W.HTML()
        self.config_view = W.HTML()  # the complete ds_config of the last measurement, sorted JSON
        for widget, name in ((self.stage, "stage"), (self.offload_optimizer, "offload-optimizer"),
                             (self.offload_param, "offload-param"), (self.world_size, "world-size"),
                             (self.params, "params"), (self.measure_button, "measure"), (self.summary, "summary"),
                             (self.status, "status"), (self.chart, "chart"), (self.config_view, "config")):
            widget.add_class(f"dslab-zero-{name}")
        for control in (self.stage, self.offload_optimizer, self.offload_param, self.world_size, self.params):
            control.observe(self._changed, names="value")
        self.measure_button.on_click(lambda _button: self.measure())
        self.widget = W.VBox([self.stage, W.HBox([self.offload_optimizer, self.offload_param]), self.world_size,
                              self.params, W.HBox([self.measure_button, self.status]), self.summary, self.chart,
                              self.config_view])
        self.widget.add_class("dslab-zero-explorer")
        self.data = {}
        self._sync_controls()
        self.update()
        if self.live and self.world_size.value in self.measure_world_sizes:
            self.measure()

    # ----------------------------------------------------------------------------------------- state
    def setup(self):
        """The current choice: (zero_stage, world_size, offload_optimizer, offload_param, params)."""
        psi = self._psi if self._psi is not None else int(round(self.params.value))
        return (self.stage.value, self.world_size.value, self.offload_optimizer.value, self.offload_param.value, psi)

    def _sync_controls(self):
        # offload_optimizer needs a ZeRO stage >= 1; offload_param needs stage 3 (DeepSpeed refuses otherwise).
        # Switching a box off here fires _changed again: _syncing makes that nested call do nothing.
        self._syncing = True
        try:
            stage = self.stage.value
            if stage == 0 and self.offload_optimizer.value:
                self.offload_optimizer.value = False
            if stage != 3 and self.offload_param.value:
                self.offload_param.value = False
            self.offload_optimizer.disabled = stage == 0
            self.offload_param.disabled = stage != 3
            self.measure_button.disabled = self.world_size.value not in self.measure_world_sizes
        finally:
            self._syncing = False

    def _changed(self, change=None):
        if self._syncing:
            return
        if change is not None and change["owner"] is self.params and self._psi is not None and \
                abs(math.log10(change["new"]) - math.log10(self._psi)) > 0.006:  # half a slider step: a real move
            self._psi = None
        self._sync_controls()
        if self.measured is not None and self._measured_setup() != self.setup():
            self.measured = None  # the controls moved away from what was measured: drop the stale bars
        self.update()
        # live ranks re-measure by themselves when the stage or an offload box changes (seconds, no launch)
        if self.live and change is not None and change["owner"] in (self.stage, self.offload_optimizer,
                                                                    self.offload_param) \
                and self.world_size.value in self.measure_world_sizes:
            self.measure()

    def _measured_setup(self):
        m = self.measured
        return (m["zero_stage"], m["world_size"], m["offload_optimizer"], m["offload_param"], int(m["params"]))

    # ----------------------------------------------------------------------------------------- drawing
    def update(self):
        """Recompute the theory bars (and keep measured ones that still match) and redraw."""
        stage, n, off_opt, off_param, params = self.setup()
        t = memory.theory(params, n, stage, self.precision, off_opt, off_param)
        drawn = list(range(n)) if n <= self.MAX_RANKS_DRAWN else [-1]  # -1: one bar standing for every rank
        bars = []
        for rank in drawn:
            bars.append({"rank": rank, "kind": "theory", **{p: t[p] for p in memory.PARTS}, "buffers": 0,
                         "total": t["total"]})
            if t["offloaded"]:
                bars.append({"rank": rank, "kind": "host", "offloaded": t["offloaded"]})
        if self.measured is not None:
            for m in self.measured["measured"]:
                bars.append({"rank": m["rank"], "kind": "measured", **{p: m[p] for p in memory.PARTS},
                             "buffers": m["buffers"], "total": m["total"]})
                if m["offloaded"] or t["offloaded"]:
                    bars.append({"rank": m["rank"], "kind": "host-measured", "offloaded": m["offloaded"]})
        self.data = {"setup": dict(zip(("zero_stage", "world_size", "offload_optimizer", "offload_param", "params"),
                                       self.setup())),
                     "theory": t, "bars": bars,
                     "ratios": memory.ratios(self.measured) if self.measured is not None else None,
                     "ds_config": (self.measured or {}).get("ds_config")}
        self.chart.value = bars_svg(bars)
        gpu = memory.human(t["total"])
        per = ", ".join(f"{LABELS[p]} {memory.human(t[p])}" for p in memory.PARTS)
        text = (f"<b>Theory, per rank:</b> {gpu} on the accelerator ({per})"
                + (f"; {memory.human(t['offloaded'])} offloaded to host memory" if t["offloaded"] else "")
                + f". That is {t['total'] / params:.3g} bytes per parameter (stage 0: 16).")
        if self.measured is not None:
            worst = max(abs(r - 1) for r in self.data["ratios"])
            kind = "live" if self.live else "real"
            text += (f"<br><b>Measured</b> on {n} {kind} ranks: measured/theory of the total within "
                     f"{100 * worst:.2f}% on every rank; buffers (buckets, boundary gradients) shown in grey.")
        self.summary.value = text
        cfg = self.data["ds_config"]
        self.config_view.value = ("" if cfg is None else
                                  "<details open><summary>ds_config of this measurement</summary><pre>"
                                  + html.escape(json.dumps(cfg, indent=2, sort_keys=True)) + "</pre></details>")

    # ----------------------------------------------------------------------------------------- measuring
    def measure(self):
        """Run the current stage / offload / model size on real ranks and overlay what each rank holds."""
        stage, n, off_opt, off_param, psi = self.setup()
        if n not in self.measure_world_sizes:
            self.status.value = (f"measures on {', '.join(map(str, self.measure_world_sizes))} rank(s) here: "
                                 "set the world size to that")
            return None
        self.measure_button.disabled = True
        where = "live ranks" if self.live else "rank(s)"
        self.status.value = f"measuring ZeRO-{stage} on {n} {where}..."
        printed = io.StringIO()  # the launcher prints its command line; show it here instead of in a log
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(printed):
                rep = self.measure_fn(stage, n, off_opt, off_param, psi)
        except Exception as exc:  # show the failure in the widget rather than losing it in a callback
            self.status.value = f"<span style='color:#c00'>measurement failed: {html.escape(str(exc)[:400])}</span>"
            return None
        finally:
            self._sync_controls()
        self.seconds = time.perf_counter() - start
        # draw the theory for the model that was measured, so the bars compare like with like
        self.measured, self._psi = rep, int(rep["params"])
        self._syncing = True  # moving the slider to the measured size is not a change of setup
        try:
            self.params.value = rep["params"]
        finally:
            self._syncing = False
        lines = [f"measured in {self.seconds:.1f} s: Ψ = {rep['params']:,} parameters"]
        asked = rep.get("requested_params")
        if asked and rep["params"] < asked and rep.get("needed_bytes"):
            lines.append(f"Ψ = {asked:.3g} needs about {memory.human(rep['needed_bytes'])} per rank to run, more "
                         f"than the {memory.human(rep['budget'])} per rank this explorer may use here: measured the "
                         "largest model that fits")
        command = [line[2:] for line in printed.getvalue().splitlines() if line.startswith("$ ")]
        if command:
            lines.append(f"<code>{html.escape(command[0])}</code>")
        self.status.value = "<br>".join(lines)
        self.update()
        return rep


def zero_explorer(**kwargs):
    """The ZeRO explorer widget (display it as the last line of a cell); see ZeroExplorer for the options."""
    return ZeroExplorer(**kwargs).widget
