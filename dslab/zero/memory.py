"""ZeRO memory per rank on paper: the ZeRO paper's formulas, DeepSpeed's own estimators, and reports.

Three views of the same question, "how many bytes does each rank keep for the model?":
  theory()              the ZeRO paper's formulas (Rajbhandari et al., 2020), plus where offload moves bytes;
  deepspeed_estimate()  DeepSpeed's estimate_zero2/zero3_model_states_mem_needs, for comparison;
  measured              what live engines hold: dslab.zero.engine_memory.measure_engine on each rank, run by
                        dslab.zero.runner (zero.measure launches ranks; zero.measure_live uses running ones).
bytes_per_rank() puts theory and measured numbers side by side; `dslab estimate` and `dslab measure` print them.
"""
import contextlib
import math
import sys

from dslab.messages import say

PARTS = ("params", "grads", "optimizer")  # the three model states, in the paper's order

# Bytes per parameter of each model state. Mixed precision (bf16 or fp16) with Adam: 16-bit parameters and
# gradients (2 + 2) and K = 12 bytes of optimizer states (fp32 master weights, Adam momentum and variance,
# 4 bytes each). Plain fp32 Adam: the fp32 parameters are their own master copy, so K = 8.
BYTES_PER_PARAM = {
    "bf16": {"params": 2, "grads": 2, "optimizer": 12},
    "fp16": {"params": 2, "grads": 2, "optimizer": 12},
    "fp32": {"params": 4, "grads": 4, "optimizer": 8},
}
# ZeRO-Offload: DeepSpeed's CPU Adam reads this rank's gradient partition in fp32, kept in host memory.
HOST_GRAD_BYTES = 4

# "How many bytes per parameter does training need?" Three numbers circulate; all are right about
# something different (mixed precision + Adam, one GPU, no ZeRO):
QUOTED_BYTES_PER_PARAM = {
    16: "ZeRO paper: 2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master weights, momentum, variance)",
    18: "Hugging Face's training-memory guide: 6 (fp32 + 16-bit weights) + 4 (fp32 gradients) + 8 (Adam)",
    20: "DeepSpeed's estimator: 2 (16-bit weights) + 2 (16-bit gradients) + 4 (fp32 gradients) "
        "+ 4 (fp32 master weights) + 8 (Adam)",
}

# Newer levers on the optimizer states K (chapter 13 measures each on live ranks; DeepSpeed 0.19.8):
#   optimizer "adam"       a master copy + Adam's two moments (exp_avg, exp_avg_sq): K = 4 + 4 + 4
#   optimizer "muon"       DeepSpeed's Muon takes the 2-D weight matrices of the layers (not the embeddings or the
#                          output head): a master copy + ONE momentum buffer each; the other parameters get Adam.
#                          The momentum has the gradients' dtype under ZeRO 1-3 (bf16: 2 bytes), and ZeRO 1-2 keep a
#                          second, staged copy of it between steps (stage_1_and_2.py, _muon_staging_momentum: a step
#                          writes the copy and commits it only if it is not skipped): K = 4 + f x (2 + 2) + (1 - f) x 8
#                          at ZeRO 1-2, 4 + f x 2 + (1 - f) x 8 at ZeRO-3 (f: Muon's share). At stage 0 and with
#                          offload the momentum is fp32 beside the master copy, one copy: 4 + f x 4 + (1 - f) x 8
#   master_weights "bf16"  bf16.bf16_master_weights_and_grads: the master copy (and the gradient partition the
#                          optimizer reads) in bf16, 2 bytes
#   optimizer_states "bf16"  bf16.bf16_optimizer_states: Adam's moments in bf16, 2 + 2
OPTIMIZERS = ("adam", "muon")
STATE_DTYPES = ("fp32", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
LEVER_DEFAULTS = {"optimizer": "adam", "master_weights": "fp32", "optimizer_states": "fp32", "muon_fraction": None}
MUON_MOMENTUM_COPIES = 2   # ZeRO 1-2 on the accelerator: the committed momentum and its staged copy


def check_setup(zero_stage, world_size, precision="bf16", offload_optimizer=False, offload_param=False,
                optimizer="adam", master_weights="fp32", optimizer_states="fp32", muon_fraction=None):
    """Raise ValueError naming what is wrong with a ZeRO setup (a stage, world size or offload that cannot be)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {', '.join(BYTES_PER_PARAM)}, got {precision!r}")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (ZeRO-Offload partitions first)")
    if offload_param and zero_stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3: only stage 3 partitions the parameters")
    check_levers(zero_stage, precision, offload_optimizer, optimizer, master_weights, optimizer_states, muon_fraction)


def theory(params, world_size=1, zero_stage=0, precision="bf16", offload_optimizer=False, offload_param=False,
           optimizer="adam", master_weights="fp32", optimizer_states="fp32", muon_fraction=None, trainable=None):
    """Model-state bytes per rank from the ZeRO paper: {"params", "grads", "optimizer", "total", "offloaded"}.

    Ψ = params, N = world_size, K = 12 (mixed-precision Adam): stage 0 (2+2+K)Ψ, stage 1 4Ψ + KΨ/N,
    stage 2 2Ψ + (2+K)Ψ/N, stage 3 (2+2+K)Ψ/N. "total" is on the accelerator; "offloaded" is host memory:
    offload_optimizer moves the optimizer states plus an fp32 copy of the gradient partition there,
    offload_param (stage 3) moves the parameter partition. optimizer, master_weights, optimizer_states and
    muon_fraction change K (see optimizer_bytes): the newer levers of chapter 13.

    trainable (default: all of params) is how many of the params train, e.g. LoRA's adapters (params then counts
    the adapters too). A frozen parameter has no gradient and no optimizer state: it keeps only its weight in the
    training dtype (2 bytes in bf16), which chapter 05 measures on ZeRO-2 ranks. So the weights term stays
    per-parameter x params, and the gradient and optimizer terms count the trainable ones only.
    """
    if not math.isfinite(params):
        raise ValueError(say("number.finite", name="params", value=params))
    if not params >= 1:
        raise ValueError(say("number.at_least", name="params", least=1, value=params))
    trained = float(params) if trainable is None else check_trainable(trainable, params)
    check_setup(zero_stage, world_size, precision, offload_optimizer, offload_param, optimizer, master_weights,
                optimizer_states, muon_fraction)
    psi, n, per = float(params), world_size, BYTES_PER_PARAM[precision]
    k = optimizer_bytes(precision, optimizer, master_weights, optimizer_states, muon_fraction, zero_stage,
                        offload_optimizer)
    device = {
        "params": per["params"] * psi / (n if zero_stage >= 3 else 1),
        "grads": per["grads"] * trained / (n if zero_stage >= 2 else 1),
        "optimizer": k["total"] * trained / (n if zero_stage >= 1 else 1),
    }
    host = 0.0
    if offload_optimizer:
        # The optimizer step runs on the CPU: states there, and the gradient partition goes there too (in the
        # master weights' dtype: fp32, or bf16 with bf16 master weights).
        host += device["optimizer"] + k["host_grads"] * trained / n
        device["optimizer"] = 0.0
        if zero_stage >= 2:
            device["grads"] = 0.0  # stage 1 still keeps full 16-bit gradients until the accumulation boundary
    if offload_param:
        host += device["params"]
        device["params"] = 0.0
    out = {part: _whole(device[part]) for part in PARTS}
    out["total"] = _whole(sum(device.values()))
    out["offloaded"] = _whole(host)
    return out


def _whole(x):
    return int(round(x))


def check_trainable(trainable, params):
    """trainable as a float, or ValueError: it must be a finite number from 1 to params (the trainable parameters
    are some of the model's)."""
    if not math.isfinite(trainable):
        raise ValueError(say("number.finite", name="trainable", value=trainable))
    if not trainable >= 1:
        raise ValueError(say("number.at_least", name="trainable", least=1, value=trainable))
    if trainable > params:
        raise ValueError(say("memory.trainable_above_params", trainable=trainable, params=params))
    return float(trainable)


def comm_volume(params, zero_stage, precision="bf16"):
    """Bytes each rank moves per optimizer step, as the ZeRO paper counts it (2Ψ elements; 3Ψ for stage 3).

    Stages 0-2 reduce-scatter the gradients and all-gather the parameters (an all-reduce's worth: 2Ψ);
    stage 3 all-gathers each parameter twice (forward and backward) and reduce-scatters once: 3Ψ.
    """
    elements = (3 if zero_stage == 3 else 2) * float(params)
    return _whole(elements * BYTES_PER_PARAM[precision]["params"])


# How much of a tensor each collective moves, in the ZeRO paper's accounting (which counts an all-reduce as a
# reduce-scatter plus an all-gather of the whole tensor). DeepSpeed's comms logger records each call's message
# size: the input for all-gather (one rank's shard), the whole tensor for the others.
_VOLUME_FACTOR = {"all_reduce": 2, "reduce_scatter_tensor": 1, "reduce_scatter": 1, "reduce": 1, "broadcast": 1}


def traffic_volume(comms, world_size):
    """Bytes one micro-step moved, from DeepSpeed's comms log {op: {message bytes: calls}}, paper-style."""
    total = 0
    for op, sizes in comms.items():
        factor = world_size if op.startswith("all_gather") else _VOLUME_FACTOR.get(op, 1)
        total += sum(factor * int(size) * calls for size, calls in sizes.items())
    return total


def deepspeed_estimate(params, world_size=1, zero_stage=2, offload_optimizer=False, offload_param=False,
                       largest_layer_params=0, num_nodes=1):
    """DeepSpeed's own per-GPU / per-CPU estimate {"device", "host", "function"}; None for stages 0 and 1.

    Its formulas count fp32 gradients as well (2 + 18Ψ/N on the GPU, not the paper's 2 + 14Ψ/N), add a
    1.5x buffer factor to host memory, and, for stage 3, 4 bytes x the largest layer (gathered for compute).
    """
    if zero_stage not in (2, 3):
        return None
    gpus_per_node = max(1, world_size // num_nodes)
    with contextlib.redirect_stdout(sys.stderr):  # importing deepspeed may log to stdout
        if zero_stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as fn
            host, device = fn(int(params), gpus_per_node, num_nodes, cpu_offload=offload_optimizer)
        else:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as fn
            host, device, _ = fn(int(params), int(largest_layer_params), gpus_per_node, num_nodes,
                                 cpu_offload=offload_optimizer, cpu_offload_params=offload_param)
    return {"device": int(device), "host": int(host), "function": fn.__name__}


def ladder(params, world_size, precision="bf16"):
    """From stage 0 to stage 3 + offload: theory per rank for each rung, most device memory first."""
    rungs = [(0, False, False), (1, False, False), (2, False, False), (2, True, False), (3, False, False),
             (3, True, False), (3, True, True)]
    rows = []
    for stage, opt, par in rungs:
        t = theory(params, world_size, stage, precision, opt, par)
        name = f"ZeRO-{stage}" + (" + offload optimizer" if opt else "") + (" + offload params" if par else "")
        rows.append({"setup": name, "zero_stage": stage, "offload_optimizer": opt, "offload_param": par, **t})
    return rows


# --------------------------------------------------------------------------- newer levers on the optimizer states

def check_levers(zero_stage, precision="bf16", offload_optimizer=False, optimizer="adam", master_weights="fp32",
                 optimizer_states="fp32", muon_fraction=None):
    """Raise ValueError for an optimizer / master-weight choice DeepSpeed 0.19.8 refuses or this theory does not cover."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    for name, value in (("master_weights", master_weights), ("optimizer_states", optimizer_states)):
        if value not in STATE_DTYPES:
            raise ValueError(f"{name} must be one of {', '.join(STATE_DTYPES)}, got {value!r}")
    if optimizer_states == "bf16" and master_weights != "bf16":
        raise ValueError("bf16 optimizer states need bf16 master weights: DeepSpeed asserts "
                         "bf16_optimizer_states requires bf16_master_weights_and_grads; set both")
    if master_weights == "bf16":
        if precision != "bf16":
            raise ValueError(f"bf16 master weights are a key of the bf16 section: precision must be bf16, "
                             f"got {precision!r}")
        if zero_stage not in (1, 2, 3):
            raise ValueError("bf16 master weights need ZeRO stage 1, 2 or 3 (DeepSpeed refuses them at stage 0)")
        if not offload_optimizer and optimizer_states != "bf16":
            raise ValueError("bf16 master weights with fp32 optimizer states need offload_optimizer "
                             "(DeepSpeedCPUAdam): without it DeepSpeed stops with 'Master weights feature requires "
                             "ZeRO-2 Offload with DeepSpeedCPUAdam'. Offload the optimizer, or add bf16 optimizer "
                             "states")
    if optimizer == "muon":
        if muon_fraction is None or not 0 <= muon_fraction <= 1:
            raise ValueError("optimizer muon needs muon_fraction, the share of parameters in the layers' 2-D "
                             f"weight matrices (0 to 1; memory.muon_split counts it for a model), got {muon_fraction!r}")
        if master_weights != "fp32" or optimizer_states != "fp32":
            raise ValueError("Muon with bf16 master weights or states is not covered: chapter 13 measured Muon "
                             "with fp32 master weights only")
    elif muon_fraction is not None:
        raise ValueError("muon_fraction applies to optimizer muon only")


def optimizer_bytes(precision="bf16", optimizer="adam", master_weights="fp32", optimizer_states="fp32",
                    muon_fraction=None, zero_stage=1, offload_optimizer=False):
    """Optimizer-state bytes per parameter, averaged over the model: {"master", "moments", "total", "host_grads"}.

    "total" is K of the ZeRO paper (12 for mixed-precision Adam); "host_grads" is what the gradient partition
    costs per parameter in host memory when the optimizer is offloaded (it has the master weights' dtype).
    """
    check_levers(zero_stage, precision, offload_optimizer, optimizer, master_weights, optimizer_states,
                 muon_fraction)
    mixed = precision != "fp32"
    master = DTYPE_BYTES[master_weights] if mixed else 0  # fp32 training: the weights are their own master copy
    adam = 2 * DTYPE_BYTES[optimizer_states] if mixed else BYTES_PER_PARAM["fp32"]["optimizer"]
    if optimizer == "muon":
        # one momentum buffer: fp32 beside the master copy at stage 0 and with offload; else in the gradients' dtype,
        # and ZeRO 1-2 keep a staged copy of it too (stage_1_and_2.py, _muon_staging_momentum)
        if zero_stage == 0 or offload_optimizer:
            momentum = 4
        else:
            momentum = BYTES_PER_PARAM[precision]["grads"] * (MUON_MOMENTUM_COPIES if zero_stage in (1, 2) else 1)
        moments = muon_fraction * momentum + (1 - muon_fraction) * adam
    else:
        moments = adam
    host_grads = DTYPE_BYTES[master_weights] if mixed else HOST_GRAD_BYTES
    return {"master": master, "moments": moments, "total": master + moments, "host_grads": host_grads}


def is_muon_matrix(name, shape):
    """DeepSpeed's rule (deepspeed.set_optimizer_flags): Muon takes parameters of 2 or more dimensions whose name
    mentions neither "embed" nor "lm_head"; Adam takes the rest (embeddings, output head, norms, biases)."""
    return len(shape) >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def muon_split(named_shapes):
    """{"muon": elements, "adam": elements, "muon_fraction", "muon_shapes"} for [(name, shape), ...] of a model."""
    shapes = [tuple(shape) for name, shape in named_shapes if is_muon_matrix(name, shape)]
    muon = sum(math.prod(s) for s in shapes)
    total = sum(math.prod(shape) for _, shape in named_shapes)
    return {"muon": muon, "adam": total - muon, "muon_fraction": muon / total if total else 0.0,
            "muon_shapes": shapes}


def muon_momentum_elements(shapes, world_size):
    """Elements of Muon momentum each rank keeps under ZeRO 1-2: every matrix that touches its partition, whole.

    MuonWithAuxAdam sorts its matrices by their shape tuples, in descending order (sorted(..., key=p.size(),
    reverse=True): the first dimension decides, not the number of elements); ZeRO flattens them in that order and
    cuts the flat buffer (padded to a multiple of 2 x world_size) into equal partitions. Newton-Schulz works on whole
    matrices, so a matrix cut by a partition boundary is kept whole, with its momentum, by both ranks. (Elements per
    momentum copy: ZeRO 1-2 keep two, see optimizer_bytes.)
    """
    sizes = [math.prod(s) for s in sorted((tuple(s) for s in shapes), reverse=True)]
    align = 2 * world_size
    part = -(-sum(sizes) // align) * align // world_size
    held = []
    for rank in range(world_size):
        start, end, offset, elements = rank * part, (rank + 1) * part, 0, 0
        for size in sizes:
            if offset < end and offset + size > start:  # the matrix overlaps this rank's partition
                elements += size
            offset += size
        held.append(elements)
    return held


def levers(params, world_size, zero_stage=2, muon_fraction=0.5, precision="bf16"):
    """Model-state bytes per rank for each optimizer / master-weight choice at one ZeRO stage (theory), with K."""
    choices = [
        ("Adam, fp32 master weights (the paper)", False, {}),
        ("Muon on the matrices, Adam on the rest", False, {"optimizer": "muon", "muon_fraction": muon_fraction}),
        ("Adam, bf16 master weights + bf16 states", False, {"master_weights": "bf16", "optimizer_states": "bf16"}),
        ("Adam, fp32 master weights, offload optimizer", True, {}),
        ("Adam, bf16 master weights, offload optimizer", True, {"master_weights": "bf16"}),
    ]
    rows = []
    for name, offload, choice in choices:
        k = optimizer_bytes(precision, zero_stage=zero_stage, offload_optimizer=offload, **choice)["total"]
        t = theory(params, world_size, zero_stage, precision, offload_optimizer=offload, **choice)
        rows.append({"setup": name, "offload_optimizer": offload, "K": k, **t})
    return rows


def bytes_per_rank(params, world_size, zero_stage, precision="bf16", offload_optimizer=False, offload_param=False,
           measured=None, trainable=None, **choice):
    """The JSON object `dslab estimate` / `dslab measure` print: theory, and measured per rank if given.

    choice: optimizer, master_weights, optimizer_states, muon_fraction (as theory()); reported when not the
    paper's (LEVER_DEFAULTS), so a plain report stays what it was. trainable (as theory()) is reported when given.
    """
    bytes_in_theory = theory(params, world_size, zero_stage, precision, offload_optimizer, offload_param,
                             trainable=trainable, **choice)
    out = {"zero_stage": zero_stage, "world_size": world_size, "params": int(params), "precision": precision,
           "offload_optimizer": bool(offload_optimizer), "offload_param": bool(offload_param),
           **({} if trainable is None else {"trainable": int(trainable)}),
           **{key: value for key, value in choice.items() if value != LEVER_DEFAULTS.get(key)},
           "theory": bytes_in_theory}
    if measured is not None:
        out["measured"] = measured
    return out


def ratios(rep, key="total"):
    """Measured / theory of `key` for each rank of a report (1.0 = exactly the paper's number)."""
    want = rep["theory"][key]
    return [m[key] / want if want else float(m[key] == 0) for m in rep["measured"]]


def human(nbytes):
    """Bytes in the largest binary unit that keeps the number >= 1 (2.5 MiB, 12.0 GiB)."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024


def qwen2_params(config):
    """Parameters of a Qwen2 causal LM of this config, counted from its shapes (no model is built)."""
    h, v, i, layers = config.hidden_size, config.vocab_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    attention = (h * q + q) + 2 * (h * kv + kv) + q * h  # q, k, v projections have a bias; o does not
    per_layer = attention + 3 * h * i + 2 * h            # SwiGLU MLP (gate, up, down) and two RMSNorms
    return v * h * (1 if config.tie_word_embeddings else 2) + layers * per_layer + h


def report_from_results(results, index):
    """The report (theory + measured per rank) of setup number `index` of a zero_memory run."""
    runs = [r["runs"][index] for r in results]
    first = runs[0]
    measured = [{"rank": r["rank"], **run["memory"]} for r, run in zip(results, runs)]
    return bytes_per_rank(first["params"], len(results), first["zero_stage"], first["precision"],
                  first["offload_optimizer"], first["offload_param"], measured)


def describe_levers(rep):
    """", Muon (f = 0.52), bf16 master weights" for a report whose optimizer choice is not the paper's Adam."""
    words = []
    if rep.get("optimizer", "adam") == "muon":
        words.append(f"Muon (f = {rep['muon_fraction']:.2f})")
    if rep.get("master_weights", "fp32") == "bf16":
        words.append("bf16 master weights")
    if rep.get("optimizer_states", "fp32") == "bf16":
        words.append("bf16 optimizer states")
    return "".join(f", {w}" for w in words)


def format_report(rep):
    """A small text table: theory, then each rank, in MiB, with measured/theory of the total."""
    head = (f"ZeRO-{rep['zero_stage']}, {rep['world_size']} rank(s), Ψ = {rep['params']:,} parameters"
            + (f" ({rep['trainable']:,} trainable)" if "trainable" in rep else "") + f", {rep['precision']}"
            + (", offload optimizer" if rep["offload_optimizer"] else "")
            + (", offload params" if rep["offload_param"] else "") + describe_levers(rep))
    cols = ("params", "grads", "optimizer", "total", "offloaded", "buffers")
    big = max(rep["theory"]["total"], rep["theory"]["offloaded"]) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    lines = [head, f"{'':>10}" + "".join(f"{c:>13}" for c in cols) + f"{'measured/theory':>17}"]
    cell = lambda b: f"{b / scale:13.3f}" if b is not None else f"{'-':>13}"  # noqa: E731
    lines.append(f"{'theory':>10}" + "".join(cell(rep["theory"].get(c)) for c in cols))
    for m, r in zip(rep.get("measured", []), ratios(rep) if rep.get("measured") else []):
        lines.append(f"{'rank ' + str(m['rank']):>10}" + "".join(cell(m.get(c)) for c in cols) + f"{r:17.4f}")
    lines.append(f"({unit} per rank; total = params + grads + optimizer on the accelerator; "
                 "offloaded = in host memory)")
    return "\n".join(lines)
