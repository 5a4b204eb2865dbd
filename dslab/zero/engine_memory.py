"""What a live DeepSpeed engine holds on this rank, in bytes, read from its own tensors.

measure_engine(engine) finds the model states where DeepSpeed keeps them (parameters or their ZeRO-3
partition, p.grad or the gradient partition, the inner optimizer's fp32 master weights and Adam's moments)
and counts every other tensor reachable from the ZeRO optimizer as a buffer. It reads tensors, not the
allocator, so it works on the CPU accelerator too; dslab.zero.memory gives the numbers to compare with.
"""
import re

from dslab import compat
from dslab.zero.memory import PARTS


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
    partition, the inner optimizer's fp32 master weights and states, Muon's staged momentum); every other tensor
    reachable from the ZeRO optimizer (communication buckets, gathered parameters, staging copies) counts as a buffer.
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
    # Muon under ZeRO 1-2: a staged copy of each group's momentum, kept between steps (stage_1_and_2.py,
    # _muon_staging_momentum: a step writes it and commits it to the state only if the step is not skipped)
    for staged in compat.muon_staged_momentum(wrapper):
        ledger.add(staged, "optimizer", "Muon staged momentum", host=off_opt)
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
            label = compat.ZERO_BUFFER_LABELS.get(name, f"buffer: {name}")
            ledger.add(tensor, "buffers", label, host=off_opt and "cpu" in name)  # *_cpu_* live on the host

        _walk(wrapper, visit)
    out = ledger.summary()
    out["peak_device"] = int(accel.max_memory_allocated()) if accel.device_name() != "cpu" else None
    return out
