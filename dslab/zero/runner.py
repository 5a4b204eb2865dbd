"""ZeRO on running ranks: train a model a few steps under a ds_config and read what each rank holds.

Rank side (called on every rank, by the zero_memory driver or on live ranks with `ranks.apply`):
  run_engine(ds_config, ...) one engine: build the model, deepspeed.initialize, train, snapshot the bytes
  run_setups(setups, ...)  several setups one after another in the same ranks (chapter 04's sweep)
Kernel side:
  measure(zero_stage, ...)  one setup on new ranks (the zero_memory driver) -> a dslab.zero.memory report
  fit_params(...)           the largest model whose run fits a memory budget per rank
  measure_live(ranks, ...)  one setup on already-running ranks -> a dslab.zero.memory report with its ds_config
"""
import gc
import time

from dslab.messages import say
from dslab.zero import engine_memory, memory

# Chapter 04's model: the dslab-tiny architecture, made small (1.4M parameters, untied embeddings) so that
# several stages run one after another in seconds. Its weights are random: the vocabulary only sets a size.
SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=336, num_hidden_layers=2, tie_word_embeddings=False)

# A measurement's memory per rank, roughly: twice its model states (activations, the fp32 gradient copy made
# inside step(), staging copies) plus a fixed part (buckets of make_config's 2**22 elements, the framework).
RUN_OVERHEAD_FACTOR = 2
RUN_OVERHEAD_BYTES = 64 * 2**20
# The budget the explorer measures within by default: a model of a few million parameters, so that one
# measurement (initialize + 4 micro-steps) takes seconds on a laptop CPU. Raise it on a bigger machine.
DEFAULT_BUDGET = 128 * 2**20


def describe_setup(zero_stage, offload_optimizer=False, offload_param=False):
    """'ZeRO-3 + offload optimizer + offload params' style label."""
    return (f"ZeRO-{zero_stage}" + (" + offload optimizer" if offload_optimizer else "")
            + (" + offload params" if offload_param else ""))


def _setup_of(ds_config):
    """(zero_stage, offload_optimizer, offload_param, precision) that a ds_config asks for."""
    zero = ds_config.get("zero_optimization") or {}
    off = {what: (zero.get(f"offload_{what}") or {}).get("device", "none") not in ("none", None)
           for what in ("optimizer", "param")}
    precision = "bf16" if (ds_config.get("bf16") or {}).get("enabled") else \
        "fp16" if (ds_config.get("fp16") or {}).get("enabled") else "fp32"
    return int(zero.get("stage", 0)), off["optimizer"], off["param"], precision


def run_engine(ds_config, shape=None, model=None, steps=2, seq_len=32, seed=0, comms=False, finish=True):
    """On this rank: train `steps` optimizer steps under ds_config and snapshot what the rank holds.

    The snapshot is taken after backward() of the first micro-step of the last step: not the accumulation
    boundary (ds_config needs gradient_accumulation_steps >= 2), and after a full step, so Adam's states exist.
    comms: log every collective of the last step's micro-steps with DeepSpeed's comms logger.
    finish: complete the last step after the snapshot (False: stop there, as the explorer does, to save time).
    Returns a JSON-friendly dict (memory, losses, step_seconds, comms, the ds_config, ...).
    """
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch
    from deepspeed.accelerator import get_accelerator

    from dslab import this_rank
    from dslab.models.loading import build_model, count_parameters, load_model, tiny_config

    rank, _ = this_rank.init()
    accum = int(ds_config.get("gradient_accumulation_steps", 1))
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    net = load_model(model) if model else build_model(tiny_config(**(shape or {})), seed=seed)
    params = count_parameters(net)  # before ZeRO-3 partitions them away
    # Each rank trains on its own fixed micro-batches of random tokens (the same ones under every setup).
    g = torch.Generator().manual_seed(seed + rank)
    batches = [torch.randint(3, net.config.vocab_size, (micro, seq_len), generator=g) for _ in range(accum)]
    get_accelerator().reset_peak_memory_stats()  # peak_device (on a GPU) then belongs to this run alone
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ds_config)
    # Adam's step counter before any training step (DeepSpeed's stage-0 bf16 optimizer primes it; see ch. 04)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    primed = max([int(st["step"]) for st in inner.state.values() if "step" in st] or [0])
    losses, seconds, snapshot, traffic = [], [], None, {}
    for step in range(steps):
        last = step == steps - 1
        start, total = time.perf_counter(), 0.0
        for i, tokens in enumerate(batches):
            if last and comms:  # log every collective of this micro-step (DeepSpeed's comms logger)
                ds_comm.configure(enabled=True, prof_all=True)
            tokens = tokens.to(engine.device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            if last and i == 0 and accum > 1:
                # after backward of a micro-step that is NOT the accumulation boundary: stage 1 still holds
                # full gradients, stage 2 only its partition; Adam's states exist since the first step.
                snapshot = engine_memory.measure_engine(engine)
                if not finish:
                    break
            engine.step()
            total += loss.item()
            if last and comms:
                ds_comm.configure(enabled=False)
                kind = "boundary" if i == accum - 1 else "micro"  # boundary: the step that updates weights
                traffic[kind] = {op: {int(size): rec[0] for size, rec in sizes.items()}
                                 for op, sizes in ds_comm.comms_logger.comms_dict.items()}
                ds_comm.comms_logger.comms_dict = {}
        if snapshot is not None and not finish:
            break  # the last step was left after its first micro-step: no whole-step time or loss
        seconds.append(time.perf_counter() - start)
        losses.append(total / accum)
    stage, off_opt, off_param, precision = _setup_of(ds_config)
    out = {"zero_stage": stage, "offload_optimizer": off_opt, "offload_param": off_param,
           "grad_accum_steps": accum, "precision": precision, "params": params, "ds_config": ds_config,
           "optimizer": type(engine.optimizer).__name__, "inner_optimizer": type(inner).__name__,
           "adam_steps_at_start": primed, "memory": snapshot, "losses": losses, "step_seconds": seconds,
           "comms": traffic}
    engine.destroy()  # ZeRO-3 hooks and buffers go with the engine: the next setup starts clean
    del engine, net, inner
    gc.collect()
    return out


def run_setups(setups, shape=None, model=None, steps=3, grad_accum_steps=2, micro_batch_size=2, seq_len=32,
               lr=1e-3, seed=0, comms=False):
    """On this rank: run_engine(...) each setup in turn -> {"rank", "world_size", "runs": [one dict per setup]}.

    A setup is {"zero_stage": S, "offload_optimizer": bool, "offload_param": bool}, optionally with
    "grad_accum_steps", "comms" and "config" (merged into the ds_config by dslab.config.build.make_config).
    """
    from dslab import this_rank
    from dslab.config.build import make_config

    rank, world_size = this_rank.init()
    runs = []
    for setup in setups:
        setup = dict(setup)
        extra = setup.pop("config", None) or {}
        accum = setup.pop("grad_accum_steps", None) or grad_accum_steps
        log = setup.pop("comms", comms)
        ds_config = make_config(precision="bf16", micro_batch_size=micro_batch_size, grad_accum_steps=accum,
                                world_size=world_size, lr=lr, **setup, **extra)
        out = run_engine(ds_config, shape=shape, model=model, steps=steps, seq_len=seq_len, seed=seed, comms=log)
        out["config"] = extra
        runs.append(out)
    return {"rank": rank, "world_size": world_size, "runs": runs}


# --------------------------------------------------------------------------- kernel side: new ranks

def measure(zero_stage, world_size=2, offload_optimizer=False, offload_param=False, model=None, shape=None,
            steps=2, timeout=900, stream=None):
    """Launch `world_size` new ranks running the zero_memory driver; return the report (theory + measured).

    model: a local checkpoint directory; shape: tiny_config overrides (default: dslab-tiny's shape).
    stream: where the ranks' output goes (see dslab.launch.run). Raises ValueError for a setup that cannot be
    (loading.ModelError, a ValueError, for a model folder or shape that cannot be loaded or built).
    """
    from dslab import launch
    from dslab.models import loading

    memory.check_setup(zero_stage, world_size, "bf16", offload_optimizer, offload_param)
    if not steps >= 2:  # the snapshot is taken in the last step, once Adam's states exist (run_engine)
        raise ValueError(say("number.at_least", name="steps", least=2, value=steps))
    if model:
        loading.check_model(model)
    if shape:
        loading.tiny_config(**shape)  # a size below 1 fails here, not on the ranks
    setup = {"zero_stage": zero_stage, "offload_optimizer": offload_optimizer, "offload_param": offload_param}
    kwargs = {"setups": [setup], "steps": steps}
    if model:
        kwargs["model"] = str(model)
    if shape:
        kwargs["shape"] = dict(shape)
    result = launch.run("zero_memory", world_size=world_size, timeout=timeout, stream=stream, **kwargs)
    return memory.report_from_results(result.results, 0)


def hidden_shape(hidden):
    """tiny_config overrides for this hidden_size, with an MLP of ~8/3 x hidden (a multiple of 16) as dslab-tiny."""
    return {"hidden_size": hidden, "intermediate_size": int(round(hidden * 8 / 3 / 16)) * 16}


def shape_for_params(target, **fixed):
    """tiny_config overrides whose model has about `target` parameters (hidden_size searched, `fixed` kept)."""
    from dslab.models.loading import tiny_config

    if not target >= 1:
        raise ValueError(say("number.at_least", name="params", least=1, value=target))

    def count(hidden):
        return memory.qwen2_params(tiny_config(**fixed, **hidden_shape(hidden)))

    lo, hi = 1, 256  # hidden = 32 x h (a multiple of the 4 attention heads' even head size); count grows with h
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(32 * mid) < target else (lo, mid)
    best = min({max(1, lo - 1), lo}, key=lambda h: abs(count(32 * h) - target))
    return {**fixed, **hidden_shape(32 * best)}


# --------------------------------------------------------------------------- kernel side: the explorer

def fit_params(requested, zero_stage, world_size, offload_optimizer=False, offload_param=False,
               budget=DEFAULT_BUDGET):
    """(params to measure, bytes one rank needs for `requested`): `requested`, or the largest that fits `budget`.

    On a CPU the accelerator and the host are the same memory, so device and offloaded bytes both count.
    """
    per_param = sum(memory.theory(1e6, world_size, zero_stage, "bf16", offload_optimizer, offload_param)[k]
                    for k in ("total", "offloaded")) / 1e6
    need = RUN_OVERHEAD_FACTOR * per_param * requested + RUN_OVERHEAD_BYTES
    largest = int((budget - RUN_OVERHEAD_BYTES) / (RUN_OVERHEAD_FACTOR * per_param))
    return (int(requested) if need <= budget else max(largest, 1)), int(need)


def explorer_config(zero_stage, world_size, offload_optimizer=False, offload_param=False):
    """The ds_config the explorer runs: the course's make_config with accumulation 2 (see run_engine())."""
    from dslab.config.build import make_config

    return make_config(zero_stage=zero_stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
                       precision="bf16", micro_batch_size=2, grad_accum_steps=2, world_size=world_size)


def measure_live(ranks, zero_stage, offload_optimizer=False, offload_param=False, params=None,
                 budget=DEFAULT_BUDGET, steps=2):
    """Run one setup on already-running ranks (dslab.live) and return its report (theory + measured per rank).

    The model has about `params` parameters (chapter 04's shape when None), or the largest that fits `budget`
    bytes per rank; the report adds "ds_config", "requested_params" and "needed_bytes" (for `params`).
    """
    world_size = ranks.world_size
    shape, needed = dict(SHAPE), None
    if params is not None:
        fitted, needed = fit_params(params, zero_stage, world_size, offload_optimizer, offload_param, budget)
        # chapter 04's architecture (vocabulary, layers, untied head), widened to about `fitted` parameters
        shape = shape_for_params(fitted, **{k: v for k, v in SHAPE.items() if not k.endswith("_size")
                                            or k == "vocab_size"})
    ds_config = explorer_config(zero_stage, world_size, offload_optimizer, offload_param)
    results = ranks.apply(run_setups_config, ds_config, shape, steps)
    rep = memory.report_from_results(results, 0)
    rep.update(ds_config=ds_config, requested_params=None if params is None else int(params),
               needed_bytes=needed, budget=budget, seconds=max(r["runs"][0]["seconds"] for r in results))
    return rep


def run_setups_config(ds_config, shape=None, steps=2):
    """On this rank: run_engine(ds_config) once, shaped like run_setups' result (for memory.report_from_results)."""
    from dslab import this_rank

    start = time.perf_counter()
    rank, world_size = this_rank.init()
    out = run_engine(ds_config, shape=shape, steps=steps, finish=False)  # the snapshot is all the explorer needs
    out["seconds"] = time.perf_counter() - start
    return {"rank": rank, "world_size": world_size, "runs": [out]}


# --------------------------------------------------------------------------- a learner's config, run for real

TRY_SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, vocab_size=512)  # seconds to run


def try_config(ds_config, timeout=300):
    """Train one optimizer step under ds_config on one fresh rank (the try_config driver) -> what that rank held.

    Returns {"inner_optimizer", "memory", "zero_stage"}; raises RuntimeError with the rank's last error line
    if DeepSpeed refuses the config or the run fails. The batch is resized for one rank (train_batch_size out).
    Quiet: nothing is printed and no run folder is left behind (a checker calls it from a notebook cell).
    """
    import contextlib
    import io
    import json
    import tempfile
    from pathlib import Path

    from dslab import launch

    cfg = json.loads(json.dumps(ds_config))
    total = cfg.pop("train_batch_size", None)
    accum = cfg.get("gradient_accumulation_steps", 1)
    if "train_micro_batch_size_per_gpu" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = max(1, (total or 1) // accum)
    with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(io.StringIO()):
        config_file = Path(run_dir) / "ds_config.json"  # read with --deepspeed_config, as DeepSpeed's examples do
        config_file.write_text(json.dumps(cfg))
        try:
            result = launch.run("try_config", world_size=1, timeout=timeout, stream=False, run_dir=run_dir,
                                deepspeed_config=str(config_file))
        except launch.LaunchError as exc:  # the message ends with the rank's traceback: keep its last line
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise RuntimeError(lines[-1] if lines else "the run failed") from None
    if not result.rank0:
        raise RuntimeError("the run left no result")
    return result.rank0


def try_step(ds_config):
    """On this rank (the try_config driver): the tiny TRY_SHAPE model, one optimizer step, then what it holds."""
    import deepspeed
    import torch

    from dslab import this_rank
    from dslab.models.loading import build_model, tiny_config

    this_rank.init()
    net = build_model(tiny_config(**TRY_SHAPE))
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ds_config)
    tokens = torch.randint(3, TRY_SHAPE["vocab_size"], (engine.train_micro_batch_size_per_gpu(), 16))
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return {"inner_optimizer": type(inner).__name__, "zero_stage": engine.zero_optimization_stage(),
            "memory": engine_memory.measure_engine(engine)}
