"""ZeRO memory per rank: the paper's formulas, DeepSpeed's own estimators, and what a live engine really holds.

Three views of the same question, "how many bytes does each rank keep for the model?":
  theory()              the ZeRO paper's formulas (Rajbhandari et al., 2020), plus where offload moves bytes;
  deepspeed_estimate()  DeepSpeed's estimate_zero2/zero3_model_states_mem_needs, for comparison;
  measure_engine()      the bytes a live DeepSpeed engine holds on this rank, read from its own tensors
                        (parameters, p.grad / gradient partitions, optimizer states), so it works on CPU too.
`dslab estimate` and `dslab measure` print them (or JSON with --json); measure() runs real ranks.
"""
import contextlib
import json
import re
import sys

from dslab.exercises import exercise as _exercise, expect  # chapter 04's exercise checkers are registered at the end

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


def _check_setup(zero_stage, world_size, precision, offload_optimizer, offload_param):
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


def theory(params, world_size=1, zero_stage=0, precision="bf16", offload_optimizer=False, offload_param=False):
    """Model-state bytes per rank from the ZeRO paper: {"params", "grads", "optimizer", "total", "offloaded"}.

    Ψ = params, N = world_size, K = 12 (mixed-precision Adam): stage 0 (2+2+K)Ψ, stage 1 4Ψ + KΨ/N,
    stage 2 2Ψ + (2+K)Ψ/N, stage 3 (2+2+K)Ψ/N. "total" is on the accelerator; "offloaded" is host memory:
    offload_optimizer moves the optimizer states plus an fp32 copy of the gradient partition there,
    offload_param (stage 3) moves the parameter partition.
    """
    _check_setup(zero_stage, world_size, precision, offload_optimizer, offload_param)
    psi, n, per = float(params), world_size, BYTES_PER_PARAM[precision]
    device = {
        "params": per["params"] * psi / (n if zero_stage >= 3 else 1),
        "grads": per["grads"] * psi / (n if zero_stage >= 2 else 1),
        "optimizer": per["optimizer"] * psi / (n if zero_stage >= 1 else 1),
    }
    host = 0.0
    if offload_optimizer:
        # The optimizer step runs on the CPU: states there, and the gradient partition goes there too.
        host += device["optimizer"] + HOST_GRAD_BYTES * psi / n
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


def bytes_per_param(zero_stage, world_size, precision="bf16"):
    """Model-state bytes per parameter on each rank (16 for stage 0 in mixed precision)."""
    return theory(1e6, world_size, zero_stage, precision)["total"] / 1e6


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


def report(params, world_size, zero_stage, precision="bf16", offload_optimizer=False, offload_param=False,
           measured=None):
    """The JSON object `dslab estimate` / `dslab measure` print: theory, and measured per rank if given."""
    out = {"zero_stage": zero_stage, "world_size": world_size, "params": int(params), "precision": precision,
           "offload_optimizer": bool(offload_optimizer), "offload_param": bool(offload_param),
           "theory": theory(params, world_size, zero_stage, precision, offload_optimizer, offload_param)}
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


# --------------------------------------------------------------------------- measurement on a live engine

class _Ledger:
    """Storages counted once each, as (part, where, label, bytes) rows; a view never counts its storage twice."""

    def __init__(self, accelerator_is_cpu):
        self.accelerator_is_cpu = accelerator_is_cpu
        self.seen = set()
        self.rows = []

    def add(self, tensor, part, label, host=False, split=None):
        """Count the storage behind `tensor` once; `host` says where DeepSpeed means it to live.

        split: [(part, label, bytes), ...] to book one storage under several rows (they must add up).
        """
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return False
        storage = tensor.untyped_storage()
        key = (tensor.device.type, storage.data_ptr())
        if storage.nbytes() == 0 or key in self.seen:
            return False
        self.seen.add(key)
        # On a GPU the device says where a tensor lives. On the CPU accelerator both "places" are the same
        # memory, so we go by where DeepSpeed would put it on a GPU (offload: the host).
        where = ("host" if host else "device") if self.accelerator_is_cpu else \
            ("host" if tensor.device.type == "cpu" else "device")
        for row_part, row_label, size in (split or [(part, label, storage.nbytes())]):
            self.rows.append((row_part, where, row_label, int(size)))
        return True

    def summary(self):
        out = {part: 0 for part in PARTS}
        out.update(buffers=0, offloaded=0, host_buffers=0)
        detail = {}
        for part, where, label, size in self.rows:
            if part == "buffers":
                out["buffers" if where == "device" else "host_buffers"] += size
            elif where == "device":
                out[part] += size
            else:
                out["offloaded"] += size
            name = f"{label} [host]" if where == "host" else label
            detail[name] = detail.get(name, 0) + size
        out["total"] = sum(out[part] for part in PARTS)
        out["detail"] = dict(sorted(detail.items(), key=lambda kv: -kv[1]))
        return out


# Readable names for the buffers DeepSpeed's ZeRO optimizers keep (attribute names in deepspeed 0.19).
BUFFER_NAMES = {
    "ipg_buckets": "reduce bucket (reduce_bucket_size)",
    "accumulated_grads_in_cpu": "16-bit gradient accumulation",
    "param_buffer_of_bit16_for_cpu_offload_groups": "16-bit parameter staging",
    "temp_grad_buffer_for_cpu_offload": "gradient staging",
    "temp_grad_buffer_for_gpu_offload": "gradient staging",
    "_global_grad_norm": "gradient norm",
    "inf_or_nan_tracker": "overflow flag",
}


def _unique_params(module):
    return list({id(p): p for p in module.parameters()}.values())


def _stage2_grad_rows(zero_opt, ledger):
    """Book ZeRO-2's gradients: this rank's partition as grads, the rest of boundary parameters as a buffer.

    Stage 2 keeps the *whole* gradient of every parameter that touches the rank's partition, so a
    parameter straddling a partition edge is held by both neighbours. The part outside the partition is
    not this rank's model state (its neighbour updates it), so it is reported as a buffer.
    """
    import torch.distributed as torch_dist

    by_storage = {}
    for group, flat in enumerate(zero_opt.bit16_groups_flat):
        rank = torch_dist.get_rank(group=zero_opt.real_dp_process_group[group])
        size = int(zero_opt.partition_size[group])
        start, end = rank * size, (rank + 1) * size
        # between backward and the boundary the accumulated gradients live in all_grad_tensors (p.grad is cleared)
        params = zero_opt.params_in_partition[group]
        held = (getattr(zero_opt, "all_grad_tensors", None) or {}).get(group) or [None] * len(params)
        for p, grad in zip(params, held):
            grad = grad if grad is not None else zero_opt.get_param_gradient_attribute(p)
            if grad is None:
                continue
            offset = (p.data_ptr() - flat.data_ptr()) // p.element_size()  # p is a view into the flat buffer
            inside = max(0, min(end, offset + p.numel()) - max(start, offset))
            key = grad.untyped_storage().data_ptr()
            owned, other, tensor = by_storage.get(key, (0, 0, grad))
            by_storage[key] = (owned + inside * grad.element_size(), other + (p.numel() - inside) *
                               grad.element_size(), tensor)
    for owned, other, tensor in by_storage.values():
        slack = tensor.untyped_storage().nbytes() - owned - other  # bytes of the buffer no gradient uses
        ledger.add(tensor, "grads", "", split=[
            ("grads", "gradient partition", owned),
            ("buffers", "gradients of boundary parameters, neighbour's part", other + slack)])


def _walk(obj, visit, path="", depth=0, seen=None):
    """Call visit(tensor, path) for every tensor reachable from a DeepSpeed object (lists, dicts, attributes)."""
    import torch

    seen = set() if seen is None else seen
    if depth > 7 or id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        visit(obj, path)
        if obj.grad is not None:
            visit(obj.grad, path + ".grad")
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            _walk(value, visit, f"{path}[{key if isinstance(key, (str, int)) else '.'}]", depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _walk(value, visit, f"{path}[{i}]", depth + 1, seen)
    elif isinstance(obj, (torch.nn.Module, type)):
        return  # model parameters are counted by name; modules hold nothing else of ZeRO's
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        for key, value in list(vars(obj).items()):
            _walk(value, visit, f"{path}.{key}", depth + 1, seen)


def measure_engine(engine):
    """Bytes this rank holds now, read from the engine's tensors: params, grads, optimizer, buffers, offloaded.

    Call it after backward() of a micro-step that is *not* the accumulation boundary (gradient accumulation
    >= 2, after at least one optimizer step so Adam's states exist): only then do stage 1 (full gradients
    kept until the boundary) and stage 2 (only the gradient partition) differ as the paper says.
    Model states are found where DeepSpeed keeps them (p.data / p.ds_tensor, p.grad or the gradient
    partition, the inner optimizer's fp32 master weights and states); every other tensor reachable from
    the ZeRO optimizer (communication buckets, gathered parameters, staging copies) counts as a buffer.
    """
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    stage = engine.zero_optimization_stage()
    off_opt = bool(engine.zero_cpu_offload())  # offload_optimizer with device "cpu"
    param_cfg = engine.zero_offload_param()
    off_param = stage == 3 and param_cfg is not None and \
        getattr(param_cfg.device, "value", param_cfg.device) != "none"
    ledger = _Ledger(accel.device_name() == "cpu")
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)  # the torch / DeepSpeedCPUAdam optimizer doing the update

    # 1. parameters: the 16-bit copy (stage 3: this rank's partition, p.ds_tensor; p.data is then empty)
    for p in _unique_params(engine.module):
        if hasattr(p, "ds_tensor"):
            ledger.add(p.ds_tensor, "params", "parameter partition (ds_tensor)", host=off_param)
            ledger.add(p.data, "buffers", "gathered parameters")
        else:
            ledger.add(p.data, "params", "parameters")
    # 2. optimizer states: fp32 master weights and Adam's moments; under offload, their fp32 gradient too
    masters = [q for group in inner.param_groups for q in group["params"]]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat"):
        masters += list(getattr(wrapper, name, None) or [])  # stage 1-2, stage 3, stage 0 (bf16)
    for q in masters:
        ledger.add(q, "optimizer", "fp32 master weights", host=off_opt)
        ledger.add(q.grad, "grads", "fp32 gradient partition", host=off_opt)
    for state in inner.state.values():
        for name, value in state.items():
            ledger.add(value, "optimizer", f"Adam {name}", host=off_opt)
    # 3. gradients on the accelerator: full p.grad (stages 0-1) or this rank's partition (stages 2-3)
    if stage == 2 and not off_opt:
        _stage2_grad_rows(wrapper, ledger)
    partition = getattr(wrapper, "grad_partitions_flat_buffer", None)
    if partition is not None:  # stage 3; with offload_optimizer it is a 16-bit staging copy on the host
        if off_opt:
            ledger.add(partition, "buffers", "16-bit gradient partition (staging)", host=True)
        else:
            ledger.add(partition, "grads", "gradient partition")
    for p in _unique_params(engine.module):
        ledger.add(p.grad, "grads", "gradients (p.grad)")
        ledger.add(getattr(p, "grad_accum", None), "grads", "gradients (p.grad)")
    # 4. everything else the ZeRO optimizer holds: buckets, staging buffers, gathered copies
    if wrapper is not inner:
        def visit(tensor, path):
            name = re.sub(r"\[[^\]]*\]", "", path).strip(".").split(".")[0] or "tensors"
            label = BUFFER_NAMES.get(name, f"buffer: {name}")
            ledger.add(tensor, "buffers", label, host=off_opt and "cpu" in name)  # *_cpu_* live on the host

        _walk(wrapper, visit)
    out = ledger.summary()
    out["peak_device"] = int(accel.max_memory_allocated()) if accel.device_name() != "cpu" else None
    return out


# --------------------------------------------------------------------------- running ranks

def qwen2_params(config):
    """Parameters of a Qwen2 causal LM of this config, counted from its shapes (no model is built)."""
    h, v, i, layers = config.hidden_size, config.vocab_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    attention = (h * q + q) + 2 * (h * kv + kv) + q * h  # q, k, v projections have a bias; o does not
    per_layer = attention + 3 * h * i + 2 * h            # SwiGLU MLP (gate, up, down) and two RMSNorms
    return v * h * (1 if config.tie_word_embeddings else 2) + layers * per_layer + h


def shape_for_params(target, **fixed):
    """tiny_config overrides whose model has about `target` parameters (hidden_size searched, the rest kept)."""
    from dslab.models import tiny_config

    def count(hidden):
        return qwen2_params(tiny_config(**fixed, **_hidden_shape(hidden)))

    lo, hi = 1, 256  # hidden = 32 x h (a multiple of the 4 attention heads' even head size); count grows with h
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(32 * mid) < target else (lo, mid)
    best = min({max(1, lo - 1), lo}, key=lambda h: abs(count(32 * h) - target))
    return {**fixed, **_hidden_shape(32 * best)}


def _hidden_shape(hidden):
    """hidden_size with an intermediate size of ~8/3 x hidden (a multiple of 16), as dslab-tiny has."""
    return {"hidden_size": hidden, "intermediate_size": int(round(hidden * 8 / 3 / 16)) * 16}


def measure(zero_stage, world_size=2, offload_optimizer=False, offload_param=False, model=None, shape=None,
            steps=2, timeout=900, stream=None):
    """Run the zero_memory recipe on `world_size` real ranks and return the report (theory + measured)."""
    from dslab import launch

    setup = {"zero_stage": zero_stage, "offload_optimizer": offload_optimizer, "offload_param": offload_param}
    _check_setup(zero_stage, world_size, "bf16", offload_optimizer, offload_param)
    kwargs = {"setups": [setup], "steps": steps}
    if model:
        kwargs["model"] = str(model)
    if shape:
        kwargs["shape"] = dict(shape)
    result = launch.run("zero_memory", world_size=world_size, timeout=timeout, stream=stream, **kwargs)
    return report_from_results(result.results, 0)


def report_from_results(results, index):
    """The report (theory + measured per rank) of setup number `index` of a zero_memory run."""
    runs = [r["runs"][index] for r in results]
    first = runs[0]
    measured = [{"rank": r["rank"], **run["memory"]} for r, run in zip(results, runs)]
    return report(first["params"], len(results), first["zero_stage"], first["precision"],
                  first["offload_optimizer"], first["offload_param"], measured)


def format_report(rep):
    """A small text table: theory, then each rank, in MiB, with measured/theory of the total."""
    head = (f"ZeRO-{rep['zero_stage']}, {rep['world_size']} rank(s), Ψ = {rep['params']:,} parameters, "
            f"{rep['precision']}" + (", offload optimizer" if rep["offload_optimizer"] else "")
            + (", offload params" if rep["offload_param"] else ""))
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


# --------------------------------------------------------------------------- command line

def _print(rep, as_json):
    if as_json:
        print(json.dumps(rep, indent=2))
    else:
        print(format_report(rep))


def _cmd_estimate(args):
    try:
        rep = report(args.params, args.world_size, args.zero, args.precision, args.offload_optimizer,
                     args.offload_param)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        est = deepspeed_estimate(args.params, args.world_size, args.zero, args.offload_optimizer,
                                 args.offload_param)
        _print(rep, False)
        if est:
            print(f"DeepSpeed's {est['function']}: {human(est['device'])} per GPU, {human(est['host'])} per CPU "
                  "(it also counts fp32 gradients and a 1.5x host buffer factor)")
        return 0
    _print(rep, True)
    return 0


def _cmd_measure(args):
    from dslab.launch import LaunchError

    shape = {k: v for k, v in (("hidden_size", args.hidden_size), ("num_hidden_layers", args.layers),
                                ("vocab_size", args.vocab_size), ("intermediate_size", args.intermediate_size))
             if v is not None}
    if args.hidden_size is not None and args.intermediate_size is None:
        shape.update(intermediate_size=_hidden_shape(args.hidden_size)["intermediate_size"])
    if args.params is not None:
        shape = shape_for_params(args.params, **{k: v for k, v in shape.items() if k != "hidden_size"})
    if args.model and shape:
        print("error: give either --model PATH or shape options (--hidden-size, --layers, ...), not both",
              file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout  # keep stdout pure JSON
    try:
        with contextlib.redirect_stdout(out):
            rep = measure(args.zero, args.world_size, args.offload_optimizer, args.offload_param,
                          model=args.model, shape=shape or None, steps=args.steps, timeout=args.timeout)
    except (LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print(rep, args.json)
    return 0


def _add_setup_args(p):
    p.add_argument("--zero", type=int, required=True, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--world-size", type=int, default=2, help="number of data-parallel ranks N")
    p.add_argument("--offload-optimizer", action="store_true", help="optimizer states to CPU (stages 1-3)")
    p.add_argument("--offload-param", action="store_true", help="parameters to CPU (stage 3)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def add_commands(subparsers):
    """`dslab estimate` (the paper's formulas) and `dslab measure` (real ranks)."""
    est = subparsers.add_parser("estimate", help="ZeRO model-state bytes per rank from the paper's formulas")
    est.add_argument("--params", type=float, required=True, help="number of parameters Ψ (1.5e9 works)")
    _add_setup_args(est)
    est.add_argument("--precision", default="bf16", choices=list(BYTES_PER_PARAM))
    est.set_defaults(func=_cmd_estimate)

    mea = subparsers.add_parser("measure", help="run N real ranks and measure each rank's model-state bytes")
    _add_setup_args(mea)
    mea.add_argument("--model", default=None, help="a local Hugging Face checkpoint directory (default: a "
                     "randomly initialised dslab-tiny shape)")
    mea.add_argument("--hidden-size", type=int, default=None, help="model shape: hidden size")
    mea.add_argument("--layers", type=int, default=None, help="model shape: number of layers")
    mea.add_argument("--vocab-size", type=int, default=None, help="model shape: vocabulary size")
    mea.add_argument("--intermediate-size", type=int, default=None, help="model shape: MLP width "
                     "(default ~8/3 x hidden)")
    mea.add_argument("--params", type=float, default=None, help="pick a hidden size for about this many "
                     "parameters")
    mea.add_argument("--steps", type=int, default=2, help="optimizer steps before the snapshot (>= 2)")
    mea.add_argument("--timeout", type=float, default=900, help="stop all ranks after this many seconds")
    mea.set_defaults(func=_cmd_measure)


# --------------------------------------------------------------------------- exercises (chapter 04)

# 13B parameters, 16 GPUs, ZeRO-2, bf16 + Adam: 2Ψ + 14Ψ/16 bytes per GPU, in GB (1e9 bytes).
expect("04.zero2_gb", 37.375, rel=1e-3, wrong=(208.0, 13.0, 26.0, 61.75),
       hint="ZeRO-2 keeps the 16-bit parameters whole (2 bytes each) and partitions gradients and optimizer "
            "states: 2Ψ + (2 + 12)Ψ/N. Answer in GB (1e9 bytes); dslab.memory.theory gives bytes.")
# 7B parameters under ZeRO-3 on 24 GB GPUs: 16Ψ/N <= 24e9 -> N >= 4.67, so 5.
expect("04.min_gpus", 5, wrong=(4, 8, 2, 6),
       hint="under ZeRO-3 every model state is partitioned: 16Ψ/N bytes per GPU. Find the smallest whole N "
            "with 16 x 7e9 / N <= 24e9.")
# 1.5B parameters on 8 GPUs of 16 GB: stage 0 needs 24 GB, stage 1 needs 4Ψ + 12Ψ/8 = 8.25 GB.
expect("04.lowest_stage", 1, wrong=(0, 2, 3),
       hint="compute theory(1.5e9, 8, stage)['total'] for stages 0, 1, 2, 3 and take the first that is "
            "at most 16e9 bytes.")


# 04.zero3_offload: the learner writes a ds_config for ZeRO-3 with optimizer states and parameters offloaded to
# CPU memory. dslab.config's checker names what DeepSpeed would refuse or silently ignore; then the config trains
# one step on a fresh rank, and the bytes must be where the learner meant them: none on the accelerator.
def _offload_device(zero_cfg, what):
    block = zero_cfg.get(f"offload_{what}")
    return block.get("device", "none") if isinstance(block, dict) else "none"


def _offload_config(zero_cfg, zero_key="zero_optimization", **top):
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
            **top, zero_key: zero_cfg}


_CPU = {"device": "cpu"}
_ZERO3_OFFLOAD_WRONG = (  # the mistakes learners make, each named by the checker
    _offload_config({"stage": 2, "offload_optimizer": _CPU, "offload_param": _CPU}),  # offload_param below stage 3
    _offload_config({"stage": 4, "offload_optimizer": _CPU, "offload_param": _CPU}),  # no stage 4
    _offload_config({"stage": 3, "offload_optimizer": {"pin_memory": True},           # no device: "none", no offload
                     "offload_param": {"pin_memory": True}}),
    _offload_config({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": "true"},  # a string, not true
                     "offload_param": {"device": "cpu", "pin_memory": "true"}}),
    _offload_config({"stage": 3, "offload_optimizer": _CPU, "offload_param": _CPU},  # misspelled: silently ignored
                    zero_key="zero_optimisation"),
    _offload_config({"stage": 3, "offload_optimizer": _CPU, "offload_param": _CPU},  # 6 != 2 x 1 x 2 ranks
                    train_batch_size=6),
    _offload_config({"stage": 3, "offload_optimizer": _CPU}),                          # parameters not offloaded
)


@_exercise("04.zero3_offload", wrong=_ZERO3_OFFLOAD_WRONG,
           hint="write a dict: zero_optimization with stage 3, offload_optimizer and offload_param, each with "
                "device \"cpu\"; a batch size, bf16 and an optimizer as in the chapter's ds_config.")
def _check_zero3_offload(cfg, world_size=2):
    from dslab.config import check_config
    from dslab.exercises import Mistake

    if not isinstance(cfg, dict):
        raise Mistake(f"a ds_config is a dict (the JSON object DeepSpeed reads), got {type(cfg).__name__}")
    problems = check_config(cfg, world_size=world_size, device="cpu")
    if problems:  # what DeepSpeed would refuse, or silently ignore
        raise Mistake("dslab.config.check_config finds:\n  " + "\n  ".join(str(p) for p in problems[:3]))
    zero_cfg = cfg.get("zero_optimization") or {}
    if zero_cfg.get("stage", 0) != 3:
        raise Mistake(f"zero_optimization.stage is {zero_cfg.get('stage', 0)}: parameters are partitioned (and so "
                      "can be offloaded) only at stage 3")
    for what, why in (("optimizer", "Adam's states and the fp32 master weights stay on the accelerator"),
                      ("param", "the 16-bit parameter partitions stay on the accelerator")):
        device = _offload_device(zero_cfg, what)
        if device != "cpu":
            missing = f"offload_{what} is missing" if f"offload_{what}" not in zero_cfg else \
                f"offload_{what}.device is {device!r} (DeepSpeed's default when no device is given is \"none\")"
            raise Mistake(f"zero_optimization.{missing}: nothing is offloaded, so {why}; "
                          f"set \"offload_{what}\": {{\"device\": \"cpu\"}}")
    from dslab import zero

    try:
        ran = zero.try_config(cfg)  # one optimizer step for real, on a fresh rank
    except RuntimeError as exc:
        raise Mistake(f"DeepSpeed accepted the keys but the run failed: {exc}") from None
    held = ran["memory"]
    if ran["inner_optimizer"] != "DeepSpeedCPUAdam" or held["total"] != 0 or held["offloaded"] == 0:
        raise Mistake(f"the run kept {human(held['total'])} of model states on the accelerator with "
                      f"{ran['inner_optimizer']}; with both offloads it keeps none and updates with DeepSpeedCPUAdam")
    return True
