"""Bytes each rank sends in one optimizer step: the ZeRO paper's ideal, DeepSpeed's own algorithm, and measured.

Three numbers per rank, side by side in sent_per_rank() (`dslab comm` prints it):
  ideal_bytes(...)            the ZeRO paper's ring formulas: 2(N-1)/N x Ψ bytes for stages 0-2 (a reduce-scatter
                              and an all-gather, one all-reduce's worth), 3(N-1)/N x Ψ for stage 3
  deepspeed_collectives(...)  the collectives DeepSpeed 0.19.8 runs in one step for this parameter list and
                              config, read from its source (each step below names where; how a bucket is reduced in
                              dslab.zero.partition, ZeRO-3's fetches in dslab.comm.zero3_fetch), each priced by
                              dslab.comm.gloo_bytes: what gloo writes to its sockets, headers included, and by
                              dslab.comm.nccl_bytes: what NCCL's rings would send on GPUs
  measure(...)                new ranks run the comm_bytes driver: the bytes each process wrote during one step
                              (/proc/self/io `wchar`) and the collectives DeepSpeed's comms logger recorded
On live ranks, logged_messages(deepspeed.comm.log_summary(return_dict=True)) and wire.bytes_written() give the
measured side. measure_ddp / ddp_step_bytes do the same for torch's DistributedDataParallel, with and without no_sync().
"""
from dslab.comm import gloo_bytes, nccl_bytes, wire, zero3_fetch
from dslab.zero import memory, partition

# DeepSpeed 0.19.8's defaults for the keys read below (deepspeed/runtime/zero/config.py, precision_config.py).
ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7, "stage3_max_reuse_distance": 1e9,
                 "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9,
                 "overlap_comm": False,
                 "use_multi_rank_bucket_allreduce": True, "reduce_scatter": True, "compute_grad_norm": True}
# engine.py MEMORY_OPT_ALLREDUCE_SIZE: ZeRO-0 all-reduces the gradients in buckets of this many elements.
ZERO0_BUCKET = 500_000_000
# Steps run before the measured one: ZeRO-3 records its parameter fetch order in the first, uses it from the
# second on (the second still differs by a few calls), so the third is the steady state the numbers describe.
WARMUP_STEPS = 2
# torch DDP's bucket caps in bytes: a small first bucket (its all-reduce can start early), then 25 MiB ones.
DDP_BUCKET_CAPS = (1 << 20, 25 << 20)


def ideal_bytes(params, world_size, zero_stage, precision="bf16"):
    """Bytes one rank sends per step in the ZeRO paper's accounting, with ring collectives on world_size ranks.

    Ψ = params x the training dtype's bytes. Stages 0-2: reduce-scatter the gradients and all-gather the
    parameters, (N-1)/N x Ψ each. Stage 3: all-gather the parameters for forward and again for backward, plus
    the reduce-scatter: 3(N-1)/N x Ψ.
    """
    memory.check_setup(zero_stage, world_size, precision)
    psi = params * memory.BYTES_PER_PARAM[precision]["params"]
    gathers = 2 if zero_stage == 3 else 1
    return round(wire.ring_bytes("reduce_scatter", psi, world_size)
                 + gathers * wire.ring_bytes("all_gather", psi, world_size))


# --------------------------------------------------------------------------- DeepSpeed's algorithm

def _close_before_overflow(indexes, numels, limit):
    """Buckets (lists of parameter indexes) as DeepSpeed's ZeRO reduce buckets fill: a bucket is sent before a
    tensor that would overflow it."""
    buckets, current = [], []
    for i in indexes:
        if current and sum(numels[j] for j in current) + numels[i] > limit:
            buckets.append(current)
            current = []
        current.append(i)
    return buckets + [current] if current else buckets


def _close_when_full(numels, limits):
    """Buckets closed once they reach their limit (limits[0] for the first, limits[-1] after): DDP, ZeRO-0, prefetch."""
    buckets, current = [], []
    for n in numels:
        current.append(n)
        if sum(current) >= limits[min(len(buckets), len(limits) - 1)]:
            buckets.append(current)
            current = []
    return buckets + [current] if current else buckets


def _setup(ds_config, world_size):
    """What deepspeed_collectives reads from a ds_config, with DeepSpeed's defaults filled in."""
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise ValueError("fp16 is not covered: DeepSpeed's fp16 optimizer needs a GPU (and adds loss-scale checks); "
                         "use bf16 or fp32")
    bf16 = bool((ds_config.get("bf16") or {}).get("enabled"))
    zero = {**ZERO_DEFAULTS, **(ds_config.get("zero_optimization") or {})}
    precision = "bf16" if bf16 else "fp32"
    comm_dtype = ds_config.get("communication_data_type") or precision
    comm_dtype = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16"}.get(comm_dtype, comm_dtype)
    off = {what: (zero.get(f"offload_{what}") or {}).get("device", "none") not in ("none", None)
           for what in ("optimizer", "param")}
    stage = int(zero.get("stage", 0))
    memory.check_setup(stage, world_size, precision, off["optimizer"], off["param"])
    return {"stage": stage, "precision": precision, "comm_dtype": comm_dtype, "zero": zero,
            "offload_optimizer": off["optimizer"], "offload_param": off["param"],
            "accum": int(ds_config.get("gradient_accumulation_steps") or 1),
            "clipping": float(ds_config.get("gradient_clipping", 1.0)),
            "check_overflow": bf16 and (ds_config.get("bf16") or {}).get("check_grad_overflow", True)}


def _parameters(items):
    return f"{len(items)} parameter{'' if len(items) == 1 else 's'}"


def _op(op, what, numel, dtype, count=1, removed_by=None, root=None):
    out = {"op": op, "what": what, "numel": int(numel), "dtype": dtype, "count": count, "removed_by": removed_by}
    return {**out, "root": root} if root is not None else out


def deepspeed_collectives(trace, world_size, ds_config, first_step=False):
    """The collectives DeepSpeed 0.19.8 runs in one optimizer step (after WARMUP_STEPS) -> (collectives, notes).

    trace: dslab.comm.zero3_fetch.model_trace(shape) (parameter sizes in model.parameters() order and the module
    order of forward), or a bare list of parameter sizes. Each collective is a dict: op, what it carries, numel
    and dtype of the message as DeepSpeed's comms logger counts it, count per step, and the setting that removes
    it (None: nothing does), and for a reduce its root. first_step: the first step after deepspeed.initialize
    instead (only ZeRO-3's differs). notes: where the prediction for this model is an estimate.
    """
    trace = trace if isinstance(trace, dict) else zero3_fetch.plain_trace(trace)
    numels = trace["numels"]
    ready = zero3_fetch.ready_order(trace)  # parameter indexes in the order backward finishes their gradients
    s = _setup(ds_config, world_size)
    n, stage, zero, accum, cdt = world_size, s["stage"], s["zero"], s["accum"], s["comm_dtype"]
    psi, notes, ops = sum(numels), [], []
    if n == 1:
        return [], notes
    shard = [-(-k // n) for k in numels]  # ZeRO-3 keeps ceil(numel / N) elements of each parameter per rank
    if stage == 0:
        # engine.allreduce_gradients -> buffered_allreduce_fallback: every gradient, flattened, at the boundary
        for bucket in _close_when_full(numels, [ZERO0_BUCKET + 1]):
            ops.append(_op("all_reduce", "gradients (flattened, all-reduced and averaged)", sum(bucket), cdt))
        if s["precision"] == "fp32" and s["clipping"] > 0:  # bf16 runs FP16_Optimizer, whose norm stays local
            ops.append(_op("all_reduce", "gradient norm (clip_grad_norm_ averages it over ranks)", 1, "fp32", 1,
                           '"gradient_clipping": 0'))
    elif stage in (1, 2):
        # stage_1_and_2.py: stage 1 reduces at the boundary in parameter order (reduce_gradients); stage 2 in the
        # backward hooks, as gradients become ready. A bucket is one all-reduce, or one reduce per owner.
        in_hooks = stage == 2 or zero["overlap_comm"]
        order = ready if in_hooks else range(len(numels))
        for bucket in _close_before_overflow(order, numels, int(zero["reduce_bucket_size"])):
            for op, numel, root in partition.bucket_reductions(bucket, numels, n, zero):
                to = f", to rank {root}, its owner" if op == "reduce" else ""
                ops.append(_op(op, f"gradients: a reduce bucket of {_parameters(bucket)}{to}", numel, cdt,
                               accum if stage == 2 else 1, root=root))
        if s["check_overflow"]:  # bf16 only: fp32 ZeRO skips the check
            ops.append(_op("all_reduce", "overflow flag: did any rank see inf/nan gradients", 1, "uint8", 1,
                           '"bf16": {"check_grad_overflow": false}'))
        if zero["compute_grad_norm"]:
            ops.append(_op("all_reduce", "gradient norm (squared, summed over ranks)", 1, "fp32", 1,
                           '"zero_optimization": {"compute_grad_norm": false}, with "gradient_clipping": 0'))
        ops.append(_op("all_gather_into_tensor", "updated parameters: each rank's partition to every rank",
                       partition.partition_size(psi, n), s["precision"]))
    else:
        ops += _zero3(trace, ready, shard, n, s, notes, first_step)
    return ops, notes


def _zero3(trace, ready, shard, n, s, notes, first_step):
    """stage3.py and partitioned_param_coordinator.py (via dslab.comm.zero3_fetch), in the steady state or first step."""
    zero, accum, precision = s["zero"], s["accum"], s["precision"]
    keep = zero3_fetch.persistent(trace, int(zero["stage3_param_persistence_threshold"]))
    ops = [_op("broadcast", f"first step: {what}", numel, dtype) for what, numel, dtype in
           (zero3_fetch.TRACE_CHECK if first_step else ())]
    calls = zero3_fetch.first_step_fetches(trace, keep) if first_step else zero3_fetch.fetch_calls(
        trace, max(0, int(zero["stage3_prefetch_bucket_size"])), int(zero["stage3_max_reuse_distance"]),
        int(zero["stage3_max_live_parameters"]), keep)
    if len(calls) > 1 and not first_step:
        notes.append("ZeRO-3 fetches in several all-gathers: replayed from the forward module order (checked "
                     "call for call here, one call off with a small stage3_max_live_parameters)")
    gathered = [p for call in calls for p in call]
    ops += [_op("all_gather_into_tensor", f"parameters: {_parameters(call)} fetched together",
                sum(shard[p] for p in call), precision, accum) for call in calls]
    if len(gathered) > len(set(gathered)):
        ops[-1]["what"] += f" ({len(gathered) - len(set(gathered))} fetched again for backward in this step)"
    # Backward: gradients go into reduce buckets as they become ready; a bucket is reduce_scatter_coalesced:
    # each gradient padded to a multiple of N elements, then one reduce_scatter_tensor
    for bucket in _close_before_overflow(ready, trace["numels"], int(zero["reduce_bucket_size"])):
        ops.append(_op("reduce_scatter_tensor", f"gradients: a reduce bucket of {_parameters(bucket)}",
                       n * sum(shard[p] for p in bucket), s["comm_dtype"], accum))
    # step(): one norm all-reduce per optimizer sub-group (fp64, or fp32 when the optimizer is offloaded)
    sub_group = int(zero["sub_group_size"])
    for _ in _close_when_full(shard, [sub_group]) if sum(shard) > sub_group else [shard]:
        ops.append(_op("all_reduce", "gradient norm (squared, summed over ranks)", 1,
                       "fp32" if s["offload_optimizer"] else "fp64"))
    # after the update (stage3.py's post-step): the persistent parameters are re-gathered one by one
    for p in sorted(keep):
        ops.append(_op("all_gather_into_tensor", "a persistent parameter, re-gathered after the update", shard[p],
                       precision, 1, '"stage3_param_persistence_threshold": 0'))
    return ops


def wire_bytes(collectives, world_size, backend=gloo_bytes):
    """Bytes each rank sends for these collectives: a list, one number per rank. backend: dslab.comm.gloo_bytes (what
    gloo writes to its sockets, headers included) or dslab.comm.nccl_bytes (NCCL's ring data volume, the GPU case)."""
    totals = [0] * world_size
    for c in collectives:
        for rank, nbytes in enumerate(backend.collective(c["op"], c["numel"], c["dtype"], world_size,
                                                         c.get("root", 0))):
            totals[rank] += c["count"] * nbytes
    return totals


def logged(collectives):
    """The comms-logger view of these collectives: {op: {message bytes: count}}."""
    out = {}
    for c in collectives:
        size = c["numel"] * gloo_bytes.ELEMENT_BYTES[c["dtype"]]
        out.setdefault(c["op"], {})
        out[c["op"]][size] = out[c["op"]].get(size, 0) + c["count"]
    return out


def logged_messages(summary):
    """On a rank: DeepSpeed's comms log as {op: {message bytes: count}}, from deepspeed.comm.log_summary(
    return_dict=True) (or its "summary"), without the barrier log_summary itself runs and logs."""
    summary = summary.get("summary", summary)
    return {op: {int(size): record["count"] for size, record in sizes.items()}
            for op, sizes in summary.items() if op != "log_summary_barrier"}


def logger_bytes(comms, world_size):
    """Data bytes one rank sends for the collectives in a comms log {op: {message bytes: count}} (no headers)."""
    return round(sum(gloo_bytes.payload(op, int(size), world_size) * count
                     for op, sizes in comms.items() for size, count in sizes.items()))


def _one_or_list(values):
    return values[0] if len(set(values)) == 1 else list(values)


def sent_per_rank(trace, world_size, ds_config, measured=None, first_step=False):
    """Ideal, DeepSpeed's predicted and (if given) measured bytes per rank for one step: the `dslab comm` JSON.

    trace: dslab.comm.zero3_fetch.model_trace(shape), or a bare list of parameter sizes (see deepspeed_collectives).
    "nccl_bytes": what the same collectives would send on GPUs (dslab.comm.nccl_bytes). first_step: see
    deepspeed_collectives.
    measured: [{"rank", "bytes" (socket writes), "comms_logger": {op: {message bytes: count}}}, ...]; each
    entry gains "logger_bytes" (what the logged collectives send, headers aside) and "ratio" (bytes / predicted).
    """
    s = _setup(ds_config, world_size)
    collectives, notes = deepspeed_collectives(trace, world_size, ds_config, first_step)
    per_rank = wire_bytes(collectives, world_size)
    for c in collectives:
        c["bytes_per_rank"] = _one_or_list(wire_bytes([c], world_size))
    params = sum(trace["numels"] if isinstance(trace, dict) else trace)
    out = {"zero_stage": s["stage"], "world_size": world_size, "params": params, "precision": s["precision"],
           "offload_optimizer": s["offload_optimizer"], "offload_param": s["offload_param"],
           "grad_accum_steps": s["accum"],
           "param_bytes": params * memory.BYTES_PER_PARAM[s["precision"]]["params"],
           "ideal_bytes": ideal_bytes(params, world_size, s["stage"], s["precision"]),
           "deepspeed_bytes": _one_or_list(per_rank), "first_step": bool(first_step),
           "nccl_bytes": _one_or_list([round(b) for b in wire_bytes(collectives, world_size, nccl_bytes)]),
           "collectives": collectives, "notes": notes,
           "predicted_comms_logger": logged(collectives), "ds_config": ds_config}
    if measured is not None:
        out["measured"] = [{**m, "logger_bytes": logger_bytes(m["comms_logger"], world_size),
                            "ratio": m["bytes"] / per_rank[m["rank"]] if per_rank[m["rank"]] else None}
                           for m in sorted(measured, key=lambda m: m["rank"])]
    return out


def format_report(rep):
    """A small text table of a report: ideal, predicted collectives, measured per rank, in bytes and in Ψ."""
    psi = rep["param_bytes"]
    ds, nccl = ([b] if not isinstance(b, list) else b for b in (rep["deepspeed_bytes"], rep["nccl_bytes"]))
    off = (" + offload optimizer" if rep["offload_optimizer"] else "") + (" + params" if rep["offload_param"] else "")
    head = (f"ZeRO-{rep['zero_stage']}{off}, {rep['world_size']} ranks, {rep['precision']}, Ψ = {rep['params']:,} "
            f"parameters = {psi:,} bytes; bytes each rank sends in {'the first' if rep['first_step'] else 'one'} "
            "optimizer step "
            f"({rep['grad_accum_steps']} micro-step(s))")
    largest = "  (largest rank)" if len(ds) > 1 else ""
    lines = [head,
             f"  {'ideal (ZeRO paper, ring)':44s}{rep['ideal_bytes']:>14,}  {rep['ideal_bytes'] / psi:6.3f} Ψ",
             f"  {'DeepSpeed on gloo (predicted)':44s}{max(ds):>14,}  {max(ds) / psi:6.3f} Ψ{largest}",
             f"  {'the same on NCCL (GPU ring, computed)':44s}{max(nccl):>14,}  {max(nccl) / psi:6.3f} Ψ{largest}"]
    for c in rep["collectives"]:
        b = c["bytes_per_rank"] if isinstance(c["bytes_per_rank"], list) else [c["bytes_per_rank"]]
        lines.append(f"    {c['op']:23s}{c['numel']:>10,} {c['dtype']:5s} x{c['count']}  {max(b):>12,}  {c['what']}")
    for m in rep.get("measured", []):
        lines.append(f"  {'measured, rank ' + str(m['rank']) + ' (socket writes)':44s}{m['bytes']:>14,}  "
                     f"{m['bytes'] / psi:6.3f} Ψ  measured/predicted "
                     + (f"{m['ratio']:.4f}" if m["ratio"] is not None else "-")
                     + f"; the logged collectives' data {m['logger_bytes']:,}")
    return "\n".join(lines + [f"  note: {n}" for n in rep["notes"]])


# --------------------------------------------------------------------------- measured on new ranks

def comm_config(zero_stage, world_size, precision="bf16", offload=False, grad_accum_steps=1, micro_batch_size=2):
    """The course's ds_config for a setup (dslab.config.build.make_config) with DeepSpeed's comms logger switched on."""
    from dslab.config.build import make_config

    return make_config(zero_stage=zero_stage, precision=precision, offload_optimizer=offload,
                       offload_param=offload and zero_stage == 3, micro_batch_size=micro_batch_size,
                       grad_accum_steps=grad_accum_steps, world_size=world_size,
                       comms_logger={"enabled": True, "prof_all": True})


def measure(zero_stages, world_size=2, precision="bf16", offload=False, shape=None, grad_accum_steps=1,
            timeout=900, stream=None):
    """Launch world_size new ranks that train one setup per stage in turn; one report per stage.

    offload: the optimizer (stages 1-3) and, at stage 3, the parameters go to CPU memory. shape: tiny_config
    overrides. Raises ValueError for a setup that cannot be (checked before anything starts).
    """
    from dslab import launch

    if int(grad_accum_steps) < 1:
        raise ValueError(f"grad_accum_steps must be at least 1, got {grad_accum_steps}")
    configs = []
    for stage in zero_stages:
        memory.check_setup(stage, world_size, precision, offload, offload and stage == 3)
        configs.append(comm_config(stage, world_size, precision, offload, grad_accum_steps))
    trace = zero3_fetch.model_trace(shape)  # the prediction's input: parameter sizes and module order
    result = launch.run("comm_bytes", world_size=world_size, timeout=timeout, stream=stream, ds_configs=configs,
                        shape=dict(shape or {}), warmup_steps=WARMUP_STEPS)
    _same_parameters(trace, result.results)
    return [sent_per_rank(trace, world_size, cfg, [{"rank": r["rank"], **r["runs"][i]} for r in result.results])
            for i, cfg in enumerate(configs)]


def _same_parameters(trace, results):
    for r in results:
        if r["numels"] != trace["numels"]:
            raise RuntimeError(f"rank {r['rank']} trained other parameters than the prediction assumes")


# --------------------------------------------------------------------------- torch DDP, for comparison

def ddp_collectives(trace, world_size, precision="fp32", synced_micro_steps=1):
    """The all-reduces torch DDP runs for synced_micro_steps backward passes: one per gradient bucket each.

    After its first step DDP rebuilds its buckets in the order gradients became ready, 1 MiB for the first
    bucket and 25 MiB after, and all-reduces a bucket once all its gradients are in. trace as in sent_per_rank().
    """
    trace = trace if isinstance(trace, dict) else zero3_fetch.plain_trace(trace)
    ready = [trace["numels"][i] for i in zero3_fetch.ready_order(trace)]
    size = memory.BYTES_PER_PARAM[precision]["params"]
    caps = [cap // size for cap in DDP_BUCKET_CAPS]
    return [_op("all_reduce", f"gradients: a DDP bucket of {_parameters(b)}", sum(b), precision,
                synced_micro_steps) for b in _close_when_full(ready, caps)] if world_size > 1 else []


def ddp_step_bytes(shape=None, no_sync=False, micro_steps=2, precision="fp32", micro_batch_size=2, seq_len=32,
                   warmup_steps=WARMUP_STEPS, seed=0):
    """On this rank: the bytes it writes in one optimizer step of `micro_steps` micro-steps under torch DDP.

    no_sync: the micro-steps before the last run inside ddp.no_sync(), so gradients are all-reduced once per
    step instead of once per micro-step. Runs in a recipe or on live ranks (`ranks.apply`).
    Returns {"rank", "no_sync", "micro_steps", "synced_micro_steps", "bytes", "numels", "precision"}.
    """
    import contextlib

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from dslab import this_rank
    from dslab.models.loading import build_model, tiny_config

    rank, _ = this_rank.init()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = build_model(tiny_config(**(shape or {})), seed=seed).to(dtype)
    # broadcast_buffers=False: the model's only buffer (rotary inv_freq) is the same on every rank, and DDP
    # would otherwise broadcast it from rank 0 at every forward (a few dozen bytes and their headers)
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + rank)
    tokens = torch.randint(3, model.config.vocab_size, (micro_batch_size, seq_len), generator=g)

    def one_step():
        for i in range(micro_steps):
            last = i == micro_steps - 1
            with ddp.no_sync() if no_sync and not last else contextlib.nullcontext():
                loss = ddp(input_ids=tokens, labels=tokens).loss / micro_steps  # the mean over micro-steps
                loss.backward()   # outside no_sync: DDP all-reduces each bucket as its gradients are ready
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup_steps):  # the first steps build (then rebuild, in ready order) DDP's buckets
        one_step()
    before = wire.bytes_written()
    one_step()
    sent = wire.bytes_written() - before
    return {"rank": rank, "no_sync": bool(no_sync), "micro_steps": micro_steps,
            "synced_micro_steps": 1 if no_sync else micro_steps, "bytes": sent, "precision": precision,
            "numels": [p.numel() for p in model.parameters()]}


def ddp_report(results, trace=None):
    """Predicted and measured bytes per rank of ddp_step_bytes results (one per rank, same setup)."""
    first = results[0]
    world_size = len(results)
    collectives = ddp_collectives(trace or first["numels"], world_size, first["precision"],
                                  first["synced_micro_steps"])
    predicted = wire_bytes(collectives, world_size)
    params = sum(first["numels"])
    return {"no_sync": first["no_sync"], "micro_steps": first["micro_steps"], "world_size": world_size,
            "synced_micro_steps": first["synced_micro_steps"], "params": params, "precision": first["precision"],
            "param_bytes": params * memory.BYTES_PER_PARAM[first["precision"]]["params"],
            "predicted_bytes": _one_or_list(predicted), "collectives": collectives,
            "measured": [{"rank": r["rank"], "bytes": r["bytes"], "ratio": r["bytes"] / predicted[r["rank"]]}
                         for r in sorted(results, key=lambda r: r["rank"])]}


def measure_ddp(world_size=2, shape=None, micro_steps=2, precision="fp32", timeout=600, stream=None):
    """Launch new ranks that measure one DDP step with and without no_sync(): [report without, report with]."""
    from dslab import launch

    trace = zero3_fetch.model_trace(shape)
    result = launch.run("comm_bytes", world_size=world_size, timeout=timeout, stream=stream, shape=dict(shape or {}),
                        ddp=[False, True], ddp_micro_steps=micro_steps, ddp_precision=precision,
                        warmup_steps=WARMUP_STEPS)
    return [ddp_report([r["ddp"][i] for r in result.results], trace) for i in range(2)]
