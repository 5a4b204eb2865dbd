"""Where a training step's time goes: the FLOPs of a forward pass, this machine's matmul ceiling, and MFU.

Model FLOPs utilization (MFU) = the FLOPs a training step has to do / the step's time / the FLOP/s this machine's
matmul reaches. Three pieces, each checkable:
  forward_flops(config, batch_size, seq_len)  the forward FLOPs DeepSpeed's flops profiler counts for a Qwen2-style
        causal LM, term by term, from its shapes alone (what the profiler patches, in profiler.py):
          every nn.Linear  2 x tokens x in x out        (F.linear; the bias add is not counted)
          attention        4 x batch x heads x seq^2 x head_dim   (F.scaled_dot_product_attention: Q K^T and the
                           weighted sum of V, over the whole square even though the mask is causal)
          SiLU             tokens x intermediate per layer       (F.silu, one per element)
        Not counted: the embedding lookup, RMSNorm, rotary embeddings, the elementwise products and residual adds
        (Python operators, which the profiler does not patch), the loss, and the optimizer step.
  rule_of_thumb(params, batch_size, seq_len, config)  2 x params x tokens + the attention term: the usual estimate
  ceiling(precision, threads)  the best GFLOP/s of a square matmul here (dslab.precision.formats.matmul_gflops)
A training step costs TRAIN_FACTOR = 3 forwards (backward computes two matmuls per forward matmul: the gradient of
the input and of the weight), so training MFU = 3 x forward FLOPs / step seconds / ceiling.
Measuring: time_phases(engine, tokens) times forward, backward and step of a live engine; sweep(setups) measures
several setups in this process, in alternating rounds so that a change in the machine's load hits all of them.
"""
import re
import time
from pathlib import Path

from dslab.precision import formats

TRAIN_FACTOR = 3          # forward + backward = 3 forwards' worth of matmul FLOPs
CEILING_N = 1024          # matmul size for the ceiling: large enough to reach this CPU's best, a fraction of a second
# A sweep setup: the course's tiny model in one process, one rank's share of the machine.
DEFAULT_SETUP = {"precision": "bf16", "threads": 1, "micro_batch_size": 4, "seq_len": 128, "zero_stage": 2}


# --------------------------------------------------------------------------- arithmetic

def layer_shape(config):
    """(layers, hidden, heads, kv_heads, head_dim, intermediate, vocab) of a Qwen2-style config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (config.num_hidden_layers, config.hidden_size, heads, config.num_key_value_heads, head_dim,
            config.intermediate_size, config.vocab_size)


def forward_flops(config, batch_size, seq_len):
    """Forward FLOPs of one micro-batch as DeepSpeed's flops profiler counts them: {term: flops, "total": sum}."""
    layers, h, heads, kv_heads, d, inter, vocab = layer_shape(config)
    tokens = batch_size * seq_len
    q, kv = heads * d, kv_heads * d
    per_layer_linear = h * q + 2 * h * kv + q * h + 3 * h * inter  # q, k, v, o projections; gate, up, down
    terms = {
        "layer matmuls": 2 * tokens * layers * per_layer_linear,
        "attention (QK^T, AV)": 4 * batch_size * layers * heads * seq_len * seq_len * d,
        "output head": 2 * tokens * h * vocab,  # lm_head: one linear over the vocabulary, tied to the embedding or not
        "SiLU": tokens * inter * layers,
    }
    terms["total"] = sum(terms.values())
    return terms


def forward_table(config, batch_size, seq_len):
    """forward_flops as rows {"term", "GFLOP", "share"} (the slides' table)."""
    terms = forward_flops(config, batch_size, seq_len)
    return [{"term": k, "GFLOP": v / 1e9, "share": v / terms["total"]} for k, v in terms.items()]


def attention_flops(config, batch_size, seq_len):
    """The attention term the usual estimate adds to 2 x params x tokens: 4 x batch x layers x seq^2 x heads x head_dim."""
    layers, _, heads, _, d, _, _ = layer_shape(config)
    return 4 * batch_size * layers * seq_len * seq_len * heads * d


def rule_of_thumb(params, batch_size, seq_len, config):
    """2 x params x tokens + attention: every parameter is one multiply-add per token (a matmul), plus attention."""
    return 2 * params * batch_size * seq_len + attention_flops(config, batch_size, seq_len)


def rule_of_thumb_gap(params, config, batch_size, seq_len):
    """(rule of thumb - profiler count) / profiler count, and why: {"gap", "biases and norms", "SiLU"} in FLOPs.

    The rule counts every parameter as a multiply-add per token, also those no matmul multiplies: biases, norm
    gains and, when the output head is untied, the input embedding (a lookup). The profiler counts SiLU, which the
    rule leaves out. A tied embedding is one matrix: the head's matmul, counted once by both.
    """
    counted = forward_flops(config, batch_size, seq_len)
    layers, h, heads, kv_heads, d, inter, vocab = layer_shape(config)
    in_matmuls = layers * (h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * inter) + h * vocab
    rule = rule_of_thumb(params, batch_size, seq_len, config)
    return {"gap": (rule - counted["total"]) / counted["total"],
            "not multiplied": 2 * batch_size * seq_len * (params - in_matmuls), "SiLU": counted["SiLU"],
            "rule": rule, "profiler": counted["total"]}


def mfu(forward, step_seconds, ceiling_gflops):
    """Training MFU: TRAIN_FACTOR x forward FLOPs per step / step seconds / the ceiling (GFLOP/s)."""
    return TRAIN_FACTOR * forward / step_seconds / (ceiling_gflops * 1e9)


# --------------------------------------------------------------------------- measuring

def ceiling(name, threads, n=CEILING_N, repeats=3):
    """This machine's matmul ceiling in GFLOP/s for format `name` on `threads` threads (best of `repeats`)."""
    return formats.matmul_gflops(name, n=n, repeats=repeats, threads=threads)


def ceilings(names, threads, rounds=3):
    """{name: ceiling} for several formats, measured in alternating rounds (best of each): a burst of load on the
    machine then cannot make one format look slower than the other."""
    best = dict.fromkeys(names, 0.0)
    for _ in range(rounds):
        for name in names:
            best[name] = max(best[name], ceiling(name, threads))
    return best


def time_phases(engine, tokens):
    """Seconds of one training step of a live engine, by phase: {"forward", "backward", "step", "total"}."""
    t0 = time.perf_counter()
    loss = engine(input_ids=tokens, labels=tokens).loss
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0}


def setup_config(setup, world_size=1):
    """The ds_config a sweep setup trains under: the course's make_config for its precision, stage and micro-batch."""
    from dslab.config.build import make_config

    return make_config(zero_stage=setup["zero_stage"], precision=setup["precision"],
                       micro_batch_size=setup["micro_batch_size"], world_size=world_size)


def setup_label(setup):
    """'bf16, 1 thread, 4 x 128 tokens' for a sweep setup."""
    threads = setup["threads"]
    return (f"{setup['precision']}, {threads} thread{'s' if threads != 1 else ''}, "
            f"{setup['micro_batch_size']} x {setup['seq_len']} tokens")


def sweep(setups, rounds=3, model=None, seed=0):
    """Training MFU of each setup in this process (a world of one, set up by dslab.this_rank.init_single_process).

    Each setup ({precision, threads, micro_batch_size, seq_len, zero_stage}, missing keys from DEFAULT_SETUP) gets
    its own engine on the course model. After a warm-up step each, `rounds` rounds time one step of every setup
    and measure the ceiling right after it, so load that comes and goes hits every setup alike; a setup's step
    time is its fastest, the ceiling of a format and thread count the best measured. Returns one dict per setup
    (GFLOP/s, seconds, MFU, phases).
    """
    import deepspeed
    import torch

    from dslab.models.loading import load_model

    setups = [{**DEFAULT_SETUP, **s} for s in setups]
    threads_before = torch.get_num_threads()
    runs = []
    try:
        for setup in setups:
            net = load_model(model)
            net.train()
            engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                              config=setup_config(setup))
            g = torch.Generator().manual_seed(seed)
            tokens = torch.randint(3, net.config.vocab_size, (setup["micro_batch_size"], setup["seq_len"]), generator=g)
            forward = forward_flops(net.config, setup["micro_batch_size"], setup["seq_len"])["total"]
            runs.append({"setup": setup, "engine": engine, "tokens": tokens, "forward": forward, "steps": [],
                         "ceilings": []})
        for run in runs:  # warm-up: the first step allocates the optimizer states and picks kernels
            torch.set_num_threads(run["setup"]["threads"])
            time_phases(run["engine"], run["tokens"])
        for _ in range(rounds):
            for run in runs:
                torch.set_num_threads(run["setup"]["threads"])
                run["steps"].append(time_phases(run["engine"], run["tokens"]))
                run["ceilings"].append(ceiling(run["setup"]["precision"], run["setup"]["threads"]))
    finally:
        torch.set_num_threads(threads_before)
    # the ceiling belongs to the machine, not to a setup: the best of every round with the same format and threads
    best_of = {}
    for run in runs:
        key = (run["setup"]["precision"], run["setup"]["threads"])
        best_of[key] = max([best_of.get(key, 0.0), *run["ceilings"]])
    rows = []
    for run in runs:
        fastest = min(s["total"] for s in run["steps"])
        best = best_of[(run["setup"]["precision"], run["setup"]["threads"])]
        achieved = TRAIN_FACTOR * run["forward"] / fastest / 1e9
        rows.append({"setup": setup_label(run["setup"]), **run["setup"], "forward_flops": run["forward"],
                     "step_seconds": fastest, "achieved_gflops": achieved, "ceiling_gflops": best,
                     "mfu": achieved / best,
                     # each phase's fastest round: forward, backward and the optimizer step
                     "phases": {k: min(s[k] for s in run["steps"]) for k in ("forward", "backward", "step")},
                     "all_steps": [s["total"] for s in run["steps"]]})
        run["engine"].destroy()
    return rows


def format_sweep(rows):
    """The sweep as a small text table (times and GFLOP/s depend on the machine and its load)."""
    lines = [f"{'setup':34s} {'step ms':>8s} {'GFLOP/s':>8s} {'ceiling':>8s} {'MFU':>6s}"]
    for r in rows:
        lines.append(f"{r['setup']:34s} {r['step_seconds'] * 1000:8.0f} {r['achieved_gflops']:8.1f} "
                     f"{r['ceiling_gflops']:8.0f} {r['mfu']:6.1%}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the profiler's report

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def profile_summary(path):
    """The summary lines of a flops-profiler report file (from 'world size' to 'samples/second')."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("world size"))
    end = next(i for i, line in enumerate(lines) if line.startswith("samples/second"))
    return [re.sub(r"\s{2,}", "  ", line).rstrip() for line in lines[start:end + 1]]


def profile_latencies(path):
    """{"fwd", "bwd", "step", "iter"} seconds from a flops-profiler report (bwd/step need wall_clock_breakdown)."""
    found = {}
    for line in profile_summary(path):
        m = re.match(r"(fwd|bwd|step|iter) latency:\s+([\d.]+)\s*(s|ms|us)\b", line)
        if m:
            found[m.group(1)] = float(m.group(2)) * _UNITS[m.group(3)]
    missing = {"fwd", "bwd", "step", "iter"} - set(found)
    if missing:
        raise ValueError(f"{path}: no {', '.join(sorted(missing))} latency; the profiler reports backward and step "
                         'times only with "wall_clock_breakdown": true in the ds_config')
    return found
