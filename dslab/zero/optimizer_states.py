"""What an optimizer keeps per parameter, read from a live DeepSpeed engine: the newer levers on ZeRO's largest state.

Chapter 04's formulas give the optimizer states K = 12 bytes per parameter (fp32 master weights + Adam's two
moments). Three choices change K, each read here from the engine's own tensors:
  Muon            ("optimizer": {"type": "Muon"}) one momentum buffer per 2-D weight matrix (and, at ZeRO 1-2, a
                  staged copy of it), Adam for the rest
  bf16 masters    ("bf16": {"bf16_master_weights_and_grads": true}) the master copy in bf16
  bf16 states     ("bf16": {"bf16_optimizer_states": true}) Adam's moments in bf16
census(engine)          every optimizer-state tensor of this rank: which group, which state, dtype, elements, bytes
muon_tags(engine)       the parameters DeepSpeed gave to Muon (p.use_muon), to compare with dslab.zero.memory's rule
run_setups(setups)      on each rank: train under each ds_config, snapshot bytes (dslab.zero.engine_memory) and census
measure(setups)         launch the memory_levers driver on new ranks (dslab.launch) and return each rank's result
dslab.zero.memory holds the theory these measurements are compared with (optimizer_bytes, muon_momentum_elements).
"""
import gc
import json
import os
from pathlib import Path

from dslab import compat
from dslab.zero import engine_memory

DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def dtype_name(tensor):
    """"fp32" / "bf16" / "fp16": dslab's name for a tensor's dtype."""
    return DTYPE_NAMES.get(str(tensor.dtype), str(tensor.dtype))


def _group_label(group):
    if "use_muon" not in group:
        return "all"
    return "muon" if group["use_muon"] else "adam"


def census(engine):
    """This rank's optimizer states: [{"group", "state", "dtype", "elements", "bytes"}], one row per kind.

    The inner optimizer's parameters are the master weights (ZeRO 1-2: this rank's flat partition of each group;
    without a master copy, the weights themselves); its `state` holds Adam's exp_avg / exp_avg_sq or Muon's
    momentum_buffer. Step counters (one number each) are left out. "muon" / "adam" name the halves DeepSpeed's
    Muon optimizer builds; "all" a single-optimizer run. A Muon run under ZeRO 1-2 also keeps a staged copy of
    the momentum between steps (a step writes it, and commits it to momentum_buffer only if the step is not
    skipped): state "staged momentum", as large as momentum_buffer.
    """
    import torch

    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)
    totals = {}

    def add(group, state, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.numel() <= 1:
            return
        key = (group, state, dtype_name(tensor))
        elements, nbytes = totals.get(key, (0, 0))
        totals[key] = (elements + tensor.numel(), nbytes + tensor.numel() * tensor.element_size())

    for group in inner.param_groups:
        label = _group_label(group)
        for p in group["params"]:
            add(label, "master weights", p)
            for name, value in inner.state.get(p, {}).items():
                add(label, name, value)
    # DeepSpeed keeps this dict between steps (stage_1_and_2.py, _muon_staging_momentum): optimizer state in all
    # but name, which dslab.zero.engine_memory counts under "optimizer" too
    for staged in compat.muon_staged_momentum(wrapper):
        add("muon", "staged momentum", staged)
    return [{"group": g, "state": s, "dtype": d, "elements": e, "bytes": b}
            for (g, s, d), (e, b) in sorted(totals.items())]


def muon_tags(engine):
    """{"muon": [names], "adam": [names]}: how DeepSpeed split the model's parameters (their `use_muon` flag)."""
    split = {"muon": [], "adam": []}
    for name, p in engine.module.named_parameters():
        split["muon" if getattr(p, "use_muon", False) else "adam"].append(name)
    return split


def master_moved(engine, before, names):
    """Elements of the master weights of `names` that differ from `before` (a collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    moved = 0
    for name, p in engine.module.named_parameters():
        if name in names:
            moved += int((safe_get_full_fp32_param(p).detach().float() != before[name]).sum())
    return moved


def masters(engine, names):
    """{name: the master copy (fp32 or bf16, as DeepSpeed keeps it) as fp32} for `names` (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().float().clone()
            for name, p in engine.module.named_parameters() if name in names}


def run_setup(ds_config, steps=2, seq_len=32, seed=0):
    """On this rank: train dslab-tiny's shape (random weights, norm gains at 1.0) under ds_config and read it.

    The snapshot is taken after backward() of the first micro-step of the last optimizer step (not the
    accumulation boundary: ds_config needs gradient_accumulation_steps >= 2), as chapter 04 measures.
    Returns {"memory", "census", "muon", "adam", "norm_elements", "norm_moved", "losses", ...}.
    """
    import deepspeed
    import torch

    from dslab import this_rank
    from dslab.models.loading import build_model, count_parameters, tiny_config

    rank, _ = this_rank.init()
    accum = int(ds_config["gradient_accumulation_steps"])
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    net = build_model(tiny_config(), seed=seed)
    params = count_parameters(net)
    norms = [name for name, _ in net.named_parameters() if "norm" in name]
    g = torch.Generator().manual_seed(seed + rank)
    batches = [torch.randint(3, net.config.vocab_size, (micro, seq_len), generator=g) for _ in range(accum)]
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ds_config)
    before = masters(engine, norms)
    losses, snapshot, states = [], None, None
    for step in range(steps):
        total = 0.0
        for i, tokens in enumerate(batches):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            if step == steps - 1 and i == 0:  # inside the accumulation window, after full steps
                snapshot, states = engine_memory.measure_engine(engine), census(engine)
            engine.step()
            total += loss.item()
        losses.append(total / accum)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out = {"params": params, "memory": snapshot, "census": states, **muon_tags(engine),
           "norm_elements": sum(before[n].numel() for n in norms), "norm_moved": master_moved(engine, before, norms),
           "losses": losses, "optimizer": type(engine.optimizer).__name__, "inner_optimizer": type(inner).__name__,
           "ds_config": ds_config}
    engine.destroy()
    del engine, net
    gc.collect()
    return out


def run_setups(setups, steps=2, seq_len=32, seed=0):
    """On this rank: run_setup(...) for each {"name", "ds_config"} (a list, or a JSON file of one) ->
    {"rank", "world_size", "runs": {name: ...}}."""
    from dslab import this_rank

    rank, world_size = this_rank.init()
    runs = {s["name"]: run_setup(s["ds_config"], steps=steps, seq_len=seq_len, seed=seed) for s in load_setups(setups)}
    return {"rank": rank, "world_size": world_size, "runs": runs}


def measure(setups, world_size=2, steps=2, timeout=600, stream=False, run_dir=None):
    """Launch new ranks (the memory_levers driver) that run each setup; one result dict per rank, rank order.

    The setups (whole ds_configs) go to the ranks as a JSON file beside the run's folder, so the command line
    stays one that a learner can read: `... --module dslab.drivers.memory_levers --setups runs/memory_levers.json`.
    """
    from dslab import files, launch

    path = Path(run_dir or os.environ.get("DSLAB_RUNS_DIR", "runs")) / "memory_levers.json"
    files.atomic_write_json(path, list(setups), indent=1)
    result = launch.run("memory_levers", world_size=world_size, timeout=timeout, stream=stream, run_dir=run_dir,
                        setups=str(path), steps=steps)
    return result.results


def load_setups(setups):
    """The setups a driver was given: a list, or the path of a JSON file holding one (see measure)."""
    if isinstance(setups, str):
        return json.loads(Path(setups).read_text(encoding="utf-8"))
    return list(setups)


def state_bytes(rows, group=None, state=None):
    """Bytes of the census rows of `group` and/or `state` (None: any)."""
    return sum(r["bytes"] for r in rows if (group is None or r["group"] == group)
               and (state is None or r["state"] == state))


def format_census(rows):
    """The census as a small text table."""
    lines = [f"{'group':6s} {'state':26s} {'dtype':5s} {'elements':>11s} {'bytes':>12s}"]
    lines += [f"{r['group']:6s} {r['state']:26s} {r['dtype']:5s} {r['elements']:11,d} {r['bytes']:12,d}" for r in rows]
    return "\n".join(lines)
