"""dslab.precision.formats (format tables, rounding fates, master weights) and dslab.precision.loss_scaling (underflow, GradScaler,
DeepSpeed's scaler, the AMP step of chapter 02)."""
import functools
import json
import math
import subprocess
import sys

import pytest
import torch

from dslab import plots
from dslab.models import loading
from dslab.precision import formats, loss_scaling
from dslab.exercises import ch02
from support import FP16_REFUSAL


def test_dtype_table_matches_ieee_layouts():
    info = {row["format"]: row for row in formats.dtype_table()}
    assert info["fp16"]["max"] == 65504.0
    assert info["fp16"]["smallest_subnormal"] == 2.0**-24
    assert info["fp32"]["smallest_subnormal"] == 2.0**-149
    assert info["bf16"]["smallest_subnormal"] == 2.0**-133
    assert info["bf16"]["eps"] == 2.0**-7 and info["fp16"]["eps"] == 2.0**-10 and info["fp32"]["eps"] == 2.0**-23
    for row in info.values():
        assert 1 + row["exponent_bits"] + row["mantissa_bits"] == row["bits"]
    # bf16 keeps fp32's exponent: the same range, to within its coarser rounding
    assert math.isclose(info["bf16"]["max"], info["fp32"]["max"], rel_tol=2**-7)
    assert info["bf16"]["smallest_normal"] == info["fp32"]["smallest_normal"]


@pytest.mark.parametrize("value, name, expected", [
    (65504.0, "fp16", "exact"),
    (65520.0, "fp16", "overflow"),        # halfway to 65536 rounds to even: inf
    (1e5, "bf16", "rounded"),
    (2.0**-24, "fp16", "subnormal"),
    (2.0**-25, "fp16", "underflow"),      # exactly half the smallest subnormal: ties to 0
    (1e-8, "bf16", "rounded"),
    (1e-46, "fp32", "underflow"),
    (3.5e38, "bf16", "overflow"),
    (1 + 2.0**-8, "bf16", "rounded"),
    (1 + 2.0**-7, "bf16", "exact"),
])
def test_fate(value, name, expected):
    assert formats.fate(value, name) == expected


def test_formats_are_named_by_string_everywhere():
    assert loading.torch_dtype("bf16") is torch.bfloat16
    for wrong in (torch.float16, "float16", "half"):
        with pytest.raises(ValueError, match="fp32, bf16, fp16"):
            loading.torch_dtype(wrong)
    x, targets, make_layer = loss_scaling.nearly_fit_problem(batch=8, d_out=4)
    weight_grad, output_grad = loss_scaling.gradients(x, targets, make_layer, dtype="bf16")
    assert output_grad.dtype is torch.bfloat16 and weight_grad.dtype is torch.float32


def test_fate_table_and_format_table():
    rows = formats.fate_table([70000.0])
    assert rows[0]["fp16"] == math.inf and rows[0]["fp16_fate"] == "overflow"
    assert rows[0]["fp32_fate"] == "exact"
    text = formats.format_table(rows, ["value", "fp16_fate"])
    assert "overflow" in text and text.splitlines()[1].startswith("-")


def test_underflow_experiment_shows_fp16_losing_gradients_and_scaling_saving_them():
    result = loss_scaling.underflow_experiment()
    rows = result["by_run"]
    assert rows["fp16"]["output_grads_zero"] > 0.5                # most per-element gradients flushed to 0
    assert rows["fp16"]["weight_grad_rel_error"] > 0.5
    assert rows["fp16 x scale"]["output_grads_zero"] < 1e-3
    assert rows["fp16 x scale"]["weight_grad_rel_error"] < 0.1
    assert rows["bf16"]["output_grads_zero"] < 1e-3               # bf16's range holds them
    fig, data = plots.gradient_histogram(result["reference_output_grads"], result["scale"], 2.0**-24, 65504.0)
    assert data["flushed_before"] > 0.5 and data["flushed_after"] < 1e-3 and data["overflow_after"] == 0.0


def test_grad_scaler_trace_obeys_the_rules():
    trace = loss_scaling.trace_grad_scaler(steps=12, spike_steps=(2, 3), init_scale=2.0**8, growth_interval=4)
    assert loss_scaling.check_scaler_trace(trace, growth_interval=4) == []
    assert [r["step"] for r in trace if r["skipped"]] == [2, 3]
    assert [r["scale"] for r in trace] == [256, 256, 256, 128] + [64] * 4 + [128] * 4
    fig, data = plots.loss_scale_trace(trace)
    assert data["skipped"] == [r["skipped"] for r in trace]


def test_check_scaler_trace_catches_a_broken_trace():
    trace = loss_scaling.trace_grad_scaler(steps=8, spike_steps=(2,), growth_interval=4)
    broken = [dict(r) for r in trace]
    broken[2]["next_scale"] = broken[2]["scale"]        # an overflow that did not halve the scale
    assert loss_scaling.check_scaler_trace(broken, growth_interval=4)
    broken = [dict(r) for r in trace]
    broken[2]["skipped"] = False                        # an overflow whose step was applied
    assert loss_scaling.check_scaler_trace(broken, growth_interval=4)


def test_bf16_needs_no_scaler_and_takes_the_spike():
    trace = loss_scaling.trace_grad_scaler(steps=6, spike_steps=(2,), dtype="bf16")
    assert not any(r["overflow"] or r["skipped"] for r in trace)
    assert {r["scale"] for r in trace} == {1.0}


_DEEPSPEED_SCALER = """
import json
from dslab import this_rank
from dslab.precision import formats, loss_scaling
this_rank.quiet()
ex = loss_scaling.trace_deepspeed_scaler(formats.DS_SCALE_OVERFLOWS, **formats.DS_SCALE_FP16)
floor = loss_scaling.trace_deepspeed_scaler([True] * 8, initial_scale_power=3, loss_scale_window=4, min_loss_scale=1)
print(json.dumps({"exercise": ex, "floor": floor}))
"""


def test_deepspeed_scaler_replay_and_minimum():
    # In a subprocess: the scaler needs a (single-process) group, which must not leak into other tests.
    out = subprocess.run([sys.executable, "-c", _DEEPSPEED_SCALER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ex = result["exercise"]
    assert ex[-1]["next_scale"] == ch02.DS_SCALE_ANSWER
    assert ex[1]["next_scale"] == ex[1]["scale"]            # first overflow: hysteresis absorbs it
    assert ex[3]["next_scale"] == ex[3]["scale"] / 2        # second: halves
    floor = result["floor"]
    assert [r["scale"] for r in floor] == [8, 8, 4, 2, 1]
    assert "already at minimum" in floor[-1]["error"]


_DEEPSPEED_FP16 = """
import json, sys
from deepspeed.accelerator import get_accelerator
if get_accelerator().device_name() == "cpu":   # the CPU accelerator's answer, forced: both branches on any CPU
    get_accelerator().is_fp16_supported = lambda: sys.argv[1] == "yes"
from dslab import this_rank
from dslab.precision import loss_scaling
this_rank.quiet()
try:
    trace = loss_scaling.trace_deepspeed_fp16(steps=16, spike_steps=(2, 3), initial_scale_power=8,
                                              loss_scale_window=4, hysteresis=2)
except ValueError as exc:
    print(json.dumps({"refused": str(exc)}))
else:
    replay = loss_scaling.trace_deepspeed_scaler([r["skipped"] for r in trace], initial_scale_power=8,
                                                 loss_scale_window=4, hysteresis=2)
    print(json.dumps({"trace": trace, "replay": replay}))
"""


@pytest.mark.parametrize("fp16_supported", ["yes", "no"])
def test_deepspeed_fp16_engine_runs_where_the_accelerator_allows_it_and_is_refused_elsewhere(fp16_supported):
    """Chapter 02 section 9, both branches: where the accelerator allows fp16 (a GPU, an AVX512-FP16 Xeon; here
    forced on the CPU accelerator, whose fp16 then runs in torch's fp16 CPU kernels), DeepSpeed's fp16 optimizer
    skips the two overflowing steps and halves its loss scale exactly as the scaler replay says; elsewhere
    deepspeed.initialize refuses fp16."""
    from dslab.machine import gpu_count

    if gpu_count() and fp16_supported == "no":
        pytest.skip("a GPU supports fp16")
    out = subprocess.run([sys.executable, "-c", _DEEPSPEED_FP16, fp16_supported], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if fp16_supported == "no":
        assert FP16_REFUSAL in result["refused"]
        return
    trace, replay = result["trace"], result["replay"]
    assert [r["step"] for r in trace if r["skipped"]] == [2, 3]          # the spiky batches, and only those
    assert [r["scale"] for r in trace] == [r["scale"] for r in replay]   # engine.optimizer.loss_scale, step by step
    assert trace[3]["next_scale"] == trace[3]["scale"] / 2 == 128        # hysteresis 2: the 2nd overflow halves
    assert max(r["scale"] for r in trace) == 512                        # ... and good steps doubled it back twice
    assert all(math.isfinite(r["loss"]) for r in trace)


def test_repeated_add_loses_small_updates_in_bf16_only():
    assert formats.repeated_add(1.0, 1e-3, 100, "bf16") == 1.0
    assert formats.repeated_add(1.0, 1e-3, 100, "fp32") == pytest.approx(1.1, rel=1e-4)


def test_matmul_gflops_is_positive_and_restores_threads():
    threads = torch.get_num_threads()
    assert formats.matmul_gflops("fp32", n=64, repeats=2, threads=1) > 0
    assert torch.get_num_threads() == threads


def test_wrong_amp_loop_does_not_learn_and_the_scaled_one_follows_fp32():
    x, y, new_model = loss_scaling.amp_problem(rows=1024, d_out=256, offset=0.002)
    model = new_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=60.0)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):   # the circulating loop: no scaler
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    assert (model.weight.grad == 0).all()
    assert all(torch.equal(model.state_dict()[k], start[k]) for k in start)
    runs = loss_scaling.amp_runs(steps=4, lr=60.0, rows=1024, d_out=256, offset=0.002)
    assert runs["fp32"][-1] < runs["fp32"][0] / 10
    scaled = runs["scaler, backward inside autocast"]
    assert abs(scaled[0] / runs["fp32"][0] - 1) < 0.05 and scaled[-1] < scaled[0] / 10   # it learns, like fp32


def test_run_amp_step_tells_clipping_orders_apart():
    reference = loss_scaling.reference_amp_clip_step
    right = loss_scaling.run_amp_step(reference)
    scaled = loss_scaling.run_amp_step(functools.partial(reference, unscale_first=False))
    unclipped = loss_scaling.run_amp_step(functools.partial(reference, clip=False))
    none = loss_scaling.run_amp_step(functools.partial(reference, scale=False))
    assert right["moved"] and right["grad_zero"] < 1.0
    assert not loss_scaling.same_weights(scaled["weights"], right["weights"])
    assert not loss_scaling.same_weights(unclipped["weights"], right["weights"])
    assert not none["moved"] and none["grad_zero"] == 1.0


def test_master_weight_summary_counts_updates_the_bf16_copy_cannot_show():
    start = {"norm.weight": torch.ones(4, dtype=torch.bfloat16), "w": torch.zeros(2, dtype=torch.bfloat16)}
    master = {"norm.weight": torch.tensor([1.001, 1.0, 1.01, 1.0]), "w": torch.tensor([0.5, 0.0])}
    end = {n: t.to(torch.bfloat16) for n, t in master.items()}
    s = formats.master_weight_summary(start, end, master)
    assert s["moved_in_master"] == 3 and s["moved_in_bf16_copy"] == 2 and s["moved_in_master_only"] == 1
    assert s["norm_weights"] == 4 and s["norm_weights_moved_in_master"] == 2 and s["norm_weights_moved_in_bf16"] == 1
    assert s["bf16_copy_is_rounded_master"]
