"""Floating-point formats and mixed precision: dtype tables, what storing a value does, master weights, speed.

Formats are named "fp32", "fp16" and "bf16" throughout dslab; dslab.models.loading.torch_dtype converts at the boundary.
Loss scaling (fp16's underflow, GradScaler, DeepSpeed's scaler) is dslab.precision.loss_scaling.
"""
import math
import time

from dslab.models.loading import torch_dtype  # the one "fp32"/"bf16"/"fp16" -> torch dtype table

FORMATS = ("fp32", "fp16", "bf16")
# (exponent bits, stored mantissa bits): the sign takes the last bit of each format.
LAYOUT = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7)}


# --------------------------------------------------------------------------- formats

def dtype_info(name):
    """One format's bits, range and precision, read from torch.finfo (not typed in by hand)."""
    import torch
    fi = torch.finfo(torch_dtype(name))
    exponent_bits, mantissa_bits = LAYOUT[name]
    return {
        "format": name,
        "bits": fi.bits,
        "exponent_bits": exponent_bits,
        "mantissa_bits": mantissa_bits,
        "max": fi.max,                              # largest finite value; beyond it: inf
        "smallest_normal": fi.smallest_normal,      # below it precision drops (subnormals)
        "smallest_subnormal": fi.smallest_normal * fi.eps,  # at or below half of it: 0
        "eps": fi.eps,                              # gap between 1.0 and the next value
        "decimal_digits": round(math.log10(2) * (mantissa_bits + 1), 1),
    }


def dtype_table(formats=FORMATS):
    """dtype_info for each format, as a list of rows."""
    return [dtype_info(f) for f in formats]


def cast(value, name):
    """`value` stored in format `name` and read back as a Python float."""
    import torch
    return torch.tensor(value, dtype=torch.float64).to(torch_dtype(name)).item()


def fate(value, name):
    """What storing `value` in format `name` does to it: exact, rounded, subnormal, underflow or overflow."""
    stored = cast(value, name)
    info = dtype_info(name)
    if math.isinf(stored) and not math.isinf(value):
        return "overflow"
    if stored == 0.0 and value != 0.0:
        return "underflow"
    if stored != 0.0 and abs(stored) < info["smallest_normal"]:
        return "subnormal"
    return "exact" if stored == value else "rounded"


def fate_table(values, formats=FORMATS):
    """For each value: what each format stores and the fate; rows of {"value", "<fmt>", "<fmt>_fate"}."""
    rows = []
    for value in values:
        row = {"value": value}
        for name in formats:
            row[name] = cast(value, name)
            row[f"{name}_fate"] = fate(value, name)
        rows.append(row)
    return rows


def format_table(rows, columns=None, float_format="{:.4g}"):
    """A plain-text table of a list of dicts (floats formatted, columns aligned)."""
    columns = columns or list(rows[0])

    def show(v):
        if isinstance(v, float):
            return float_format.format(v)
        return str(v)

    cells = [[str(c) for c in columns]] + [[show(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(s.rjust(w) for s, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- master weights

def repeated_add(start, update, steps, name):
    """Add `update` to `start` `steps` times, storing the running value in format `name`."""
    import torch
    w = torch.tensor(start, dtype=torch_dtype(name))
    for _ in range(steps):
        w = w + torch.tensor(update, dtype=torch_dtype(name))
    return w.item()


def master_weight_summary(start, end, master):
    """How many weights moved in the fp32 master copy, how many of those the bf16 copy shows, and the RMSNorm gains.

    start, end: {name: bf16 tensor} before and after training; master: {name: fp32 master tensor} after.
    """
    import torch
    norm = [n for n in start if n.endswith("norm.weight")]                     # RMSNorm gains, 1.0 at init
    return {
        "moved_in_master": sum(int((master[n] != start[n].float()).sum()) for n in start),
        "moved_in_bf16_copy": sum(int((end[n] != start[n]).sum()) for n in start),
        # updates that the bf16 copy cannot show (yet): they wait in the master copy until they add up to a bf16 step
        "moved_in_master_only": sum(int(((master[n] != start[n].float()) & (end[n] == start[n])).sum()) for n in start),
        "norm_weights": sum(start[n].numel() for n in norm),
        "norm_weights_moved_in_master": sum(int((master[n] != 1.0).sum()) for n in norm),
        "norm_weights_moved_in_bf16": sum(int((end[n] != 1.0).sum()) for n in norm),
        # the bf16 weights the model computes with are the master copy rounded to bf16
        "bf16_copy_is_rounded_master": all(torch.equal(end[n], master[n].to(torch.bfloat16)) for n in start),
    }


def zero1_state_bytes(engine):
    """Bytes of the model states a ZeRO-1/2 bf16 engine holds on this rank, read from its tensors.

    {"weights": the 16-bit module weights, "master": this rank's fp32 master partition, "adam": Adam's
    moments for that partition, "parameters": elements in the module}.
    """
    optimizer = engine.optimizer
    inner = optimizer.optimizer                     # the torch AdamW that updates the fp32 partition
    params = list(engine.module.parameters())
    return {
        "parameters": sum(p.numel() for p in params),
        "weights": sum(p.numel() * p.element_size() for p in params),
        "master": sum(t.numel() * t.element_size() for t in optimizer.single_partition_of_fp32_groups),
        "adam": sum(v.numel() * v.element_size() for state in inner.state.values()
                    for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")),
    }


# --------------------------------------------------------------------------- speed

def matmul_gflops(name, n=2048, repeats=5, threads=None):
    """Best-of-`repeats` GFLOP/s of an n x n matmul in format `name` on this CPU (2 n^3 flops each), in the faster
    of two layouts: a @ b, and a @ b.T, the one nn.Linear multiplies (its weight is stored transposed). Kernels can
    favour either by far: with oneDNN emulating bf16 (capped at AVX2) a @ b ran at 0.9 GFLOP/s and a @ b.T at 22."""
    import torch
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(torch_dtype(name))
        b = torch.randn(n, n, generator=g).to(torch_dtype(name))
        best = math.inf
        for right in (b, b.t()):
            a @ right  # warm-up: first call picks kernels and allocates
            for _ in range(repeats):
                t0 = time.perf_counter()
                a @ right
                best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(old)


# The inputs of chapter 02's exercises (dslab.exercises.ch02), shown to the learner in the notebook.
# 02.fp16_fates: what storing each value in fp16 does to it.
FP16_FATE_VALUES = (70000.0, 1e-9, 3e-6, 1 + 2**-12)
# 02.deepspeed_scale: DeepSpeed's DynamicLossScaler with these fp16 settings sees these overflows.
DS_SCALE_FP16 = {"initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 2}
DS_SCALE_OVERFLOWS = (False, True, False, True, True, False, False, False, False)
