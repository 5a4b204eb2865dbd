"""Chapter 10's table: the setups it measures and, for each, the bytes one rank sends per optimizer step in units of
Ψ (the parameters' bytes): the ZeRO paper's ideal, DeepSpeed's algorithm on gloo (predicted), measured, and the
same collectives on NCCL (computed). The numbers come from dslab.comm.step_bytes; this module names and lines them up.
"""
from dslab.comm import gloo_bytes, nccl_bytes, step_bytes, zero3_fetch
from dslab.config.build import deep_merge

# ZeRO-1/2 without the two one-element all-reduces of every step: the bf16 overflow flag and the gradient norm
# (which clipping needs, so clipping goes too).
QUIET = {"gradient_clipping": 0.0, "bf16": {"check_grad_overflow": False},
         "zero_optimization": {"compute_grad_norm": False}}
REDUCE_TO_OWNERS = {"zero_optimization": {"use_multi_rank_bucket_allreduce": False}}

# name: (zero_stage, offload, keys merged over dslab.comm.step_bytes.comm_config(zero_stage, ...))
SETUPS = {
    "ZeRO-0": (0, False, {}),
    "ZeRO-1": (1, False, {}),
    "ZeRO-2": (2, False, {}),
    "ZeRO-3": (3, False, {}),
    "ZeRO-2 offload": (2, True, {}),
    "ZeRO-3 offload": (3, True, {}),
    "ZeRO-1 reduce to owners": (1, False, REDUCE_TO_OWNERS),
    "ZeRO-2 reduce to owners": (2, False, REDUCE_TO_OWNERS),
    "ZeRO-2 reduce_scatter off": (2, False, {"zero_optimization": {"reduce_scatter": False}}),
    "ZeRO-2 no norm, no flag": (2, False, QUIET),
}


def setup_configs(world_size=2, names=None):
    """{name: the complete ds_config} for SETUPS (or the names given), comms logger on."""
    return {name: deep_merge(step_bytes.comm_config(stage, world_size, offload=offload), extra)
            for name, (stage, offload, extra) in SETUPS.items() if names is None or name in names}


def _largest(value):
    return max(value) if isinstance(value, list) else value


def row(label, rep):
    """One line of the table from a dslab.comm.step_bytes.sent_per_rank (with or without "measured"): values in Ψ."""
    psi = rep["param_bytes"]
    out = {"label": label, "ideal": rep["ideal_bytes"] / psi, "gloo": _largest(rep["deepspeed_bytes"]) / psi,
           "nccl": _largest(rep["nccl_bytes"]) / psi}
    if rep.get("measured"):
        out["measured"] = rep["measured"][0]["bytes"] / psi
        out["ratios"] = [m["ratio"] for m in rep["measured"]]   # measured / predicted, per rank
    return out


def ddp_row(label, rep):
    """One line of the table from a dslab.comm.step_bytes.ddp_report: DDP all-reduces every synced micro-step; the
    ideal is one all-reduce per optimizer step, 2(N-1)/N x Ψ."""
    psi, n = rep["param_bytes"], rep["world_size"]
    nccl = step_bytes.wire_bytes(rep["collectives"], n, nccl_bytes)
    return {"label": label, "ideal": 2 * (n - 1) / n, "gloo": _largest(rep["predicted_bytes"]) / psi,
            "nccl": max(nccl) / psi, "measured": rep["measured"][0]["bytes"] / psi,
            "ratios": [m["ratio"] for m in rep["measured"]]}


def predicted_rows(world_size=2, shape=None, names=None):
    """The table without measurements (no ranks needed): the setups of SETUPS (or those named), and ZeRO-3's first
    step (unless names leaves out "ZeRO-3 first step").

    shape: tiny_config overrides; None is the chapter's model, chapter 04's (dslab.zero.runner.SHAPE)."""
    from dslab.zero.runner import SHAPE

    trace = zero3_fetch.model_trace(SHAPE if shape is None else shape)
    rows = [row(name, step_bytes.sent_per_rank(trace, world_size, cfg))
            for name, cfg in setup_configs(world_size, names).items()]
    if names is None or "ZeRO-3 first step" in names:
        cfg = setup_configs(world_size, ["ZeRO-3"])["ZeRO-3"]
        rows.append(row("ZeRO-3 first step", step_bytes.sent_per_rank(trace, world_size, cfg, first_step=True)))
    return rows


def per_collective(numel=2**20, dtype="bf16", world_sizes=(2, 8)):
    """For one message of `numel` elements: what each collective sends per rank on gloo and on NCCL, in units of the
    buffer (for all_gather_into_tensor the gathered result, N shards), the mean over the ranks (a reduce's or a
    broadcast's root sends less than the others), for each world size."""
    rows = []
    for op in gloo_bytes.OPS:
        for n in world_sizes:
            buffer = numel * gloo_bytes.ELEMENT_BYTES[dtype] * (n if op == "all_gather_into_tensor" else 1)
            rows.append({"collective": op, "world_size": n,
                         "gloo": sum(gloo_bytes.collective(op, numel, dtype, n)) / n / buffer,
                         "nccl": sum(nccl_bytes.collective(op, numel, dtype, n)) / n / buffer})
    return rows
