"""Chapter 13 (where the time goes, newer memory levers): count a forward pass's FLOPs in code, Muon's optimizer
bytes per parameter, and a bf16-states config run for real.

Solutions: notebooks/solutions/13_solutions.py."""
import numbers

from dslab.exercises import Mistake, exercise, expect, on_ranks, references, require_valid_config


# 13.forward_flops: the learner writes my_forward_flops(config, batch_size, seq_len) -> the forward FLOPs DeepSpeed's
# flops profiler counts for a Qwen2-style model. The checker compares it with dslab.flops.forward_flops on shapes that
# tell the terms apart (tied and untied heads, grouped-query attention, a head size set apart from hidden/heads), and
# refuses a function that gets its number from that reference (dslab.exercises.references): it is right on every shape
# by construction.
def _configs():
    from dslab.models.loading import tiny_config

    return [
        (tiny_config(), 4, 128),
        (tiny_config(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6,
                     num_key_value_heads=3, vocab_size=1000, tie_word_embeddings=False), 2, 48),
        (tiny_config(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, vocab_size=512), 3, 20),
    ]


def _diagnose(got, terms, config, batch_size, seq_len):
    """A hint naming the term the answer is off by, when it is off by exactly one."""
    from dslab import flops

    total = terms["total"]
    if got == total - terms["attention (QK^T, AV)"]:
        return "the attention term is missing: Q K^T and the weighted sum of V, 2 x 2 x batch x heads x seq^2 x head_dim"
    if got == total - terms["attention (QK^T, AV)"] // 2:
        return ("the profiler counts attention over the whole seq x seq square, causal mask or not: "
                "4 x batch x heads x seq^2 x head_dim")
    if got == total - terms["SiLU"]:
        return "SiLU is missing: the profiler counts one FLOP per element it activates (tokens x intermediate per layer)"
    if got == total - terms["output head"]:
        return "the output head is missing: one more linear layer, hidden -> vocab, for every token"
    layers, h, heads, kv_heads, d, _, _ = flops.layer_shape(config)
    if kv_heads != heads and got == total + 2 * 2 * batch_size * seq_len * layers * h * (heads - kv_heads) * d:
        return "k_proj and v_proj produce num_key_value_heads x head_dim features, not hidden_size (grouped-query attention)"
    if got * 2 == total or got == 2 * total:
        return "a multiply-add is 2 FLOPs: count 2 x in x out per token for each linear layer"
    return None


@exercise("13.forward_flops",
          wrong=(((lambda config, b, s: 2 * 5_525_760 * b * s), "your function gives 5,658,378,240"),
                 ((lambda config, b, s: _answer_without(config, b, s, "attention (QK^T, AV)")),
                  "the attention term is missing"),
                 ((lambda config, b, s: _answer_without(config, b, s, "SiLU")), "SiLU is missing"),
                 ((lambda config, b, s: _answer_without(config, b, s, "output head")), "the output head is missing")),
          hint="write my_forward_flops(config, batch_size, seq_len): every linear layer 2 x tokens x in x out (q, k, v, "
               "o, gate, up, down per layer, and the output head), attention 4 x batch x heads x seq^2 x head_dim per "
               "layer, SiLU tokens x intermediate per layer.")
def _check_forward_flops(fn):
    from dslab import flops

    if not callable(fn):
        raise Mistake(f"answer with the function itself (answer = my_forward_flops), got {type(fn).__name__}")
    for config, batch_size, seq_len in _configs():
        terms = flops.forward_flops(config, batch_size, seq_len)
        got = fn(config, batch_size, seq_len)
        number = isinstance(got, numbers.Real) and not isinstance(got, bool)   # numpy's integers are Real too
        if not number or got != terms["total"]:
            shape = (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} "
                     f"heads / {config.num_key_value_heads} kv heads, vocab {config.vocab_size}, batch {batch_size} "
                     f"x seq {seq_len}")
            why = _diagnose(got, terms, config, batch_size, seq_len) if number else None
            raise Mistake(f"for {shape} the profiler counts {terms['total']:,} FLOPs, your function gives "
                          + (f"{got:,.0f}" if number else repr(got)) + (f": {why}" if why else ""))
    leaned = references.leaned_on(fn, (flops.forward_flops, _answer_without))
    if leaned:
        raise Mistake(f"your function gets its number from {leaned}, the arithmetic this checker compares with: it "
                      "agrees on every shape by construction and counts nothing itself. Count the terms from the "
                      "config yourself: each linear layer, attention, SiLU and the output head")
    return True


def _answer_without(config, batch_size, seq_len, term):
    """A learner's typical miss: the right count without one term (for the wrong answers above)."""
    from dslab import flops

    terms = flops.forward_flops(config, batch_size, seq_len)
    return terms["total"] - terms[term]


# 13.muon_bytes: optimizer-state bytes per parameter (K) under DeepSpeed's Muon at ZeRO-2 in bf16, for a model whose
# layer matrices hold 90 % of its parameters: fp32 master copy for all (4), a bf16 momentum on the matrices and, at
# ZeRO 1-2, its staged copy kept between steps (0.9 x (2 + 2)), Adam's two fp32 moments on the rest (0.1 x 8).
# 6.6 is the count without the staged copy.
expect("13.muon_bytes", 8.4, rel=1e-3,
       wrong=((12, "12 is Adam's count for every parameter (4 + 8): the layer matrices use Muon, which keeps one bf16 "
                   "momentum, not two fp32 moments"),
              (6.6, "6.6 leaves out the staged copy of Muon's momentum that ZeRO-1/2 keep between steps (2 more bytes "
                    "on 90 % of the parameters)"),
              (6.0, "6.0 gives every parameter a master copy and one bf16 momentum: the 10 % that are not layer "
                    "matrices keep Adam's two fp32 moments (8 bytes), and ZeRO-1/2 keep a staged copy of Muon's "
                    "momentum"),
              (2.6, "2.6 leaves out the fp32 master copy every parameter keeps (4 bytes), and the staged momentum"),
              (4.2, "4.2 is half the count: the master copy and Adam's moments are fp32, 4 bytes a value")),
       hint="every parameter keeps a master copy (4 bytes, fp32); on top, a Muon matrix keeps a momentum buffer in "
            "the gradients' dtype (bf16: 2 bytes), and ZeRO-1/2 keep a second, staged copy of it between steps "
            "(stage_1_and_2.py, _muon_staging_momentum); every other parameter keeps Adam's two fp32 moments "
            "(8 bytes). Weigh the two by 0.9 and 0.1; dslab.zero.memory.optimizer_bytes checks it.")


# 13.bf16_states: the learner writes a ds_config whose optimizer states take 6 bytes per parameter on the
# accelerator (no offload): ZeRO-2, bf16 with bf16 master weights and bf16 optimizer states. The checker names what
# DeepSpeed would refuse, then trains one step with it on a fresh rank and reads the bytes the optimizer kept.
def _bf16_config(bf16, zero=None, **top):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": bf16, "zero_optimization": zero or {"stage": 2}, **top}


_BF16_STATES_WRONG = (  # the mistakes learners make, each named by the checker before anything runs
    _bf16_config({"enabled": True, "bf16_master_weights_and_grads": True}),  # DeepSpeed: needs offload (CPU Adam)
    _bf16_config({"enabled": True, "bf16_optimizer_states": True}),          # states need bf16 masters too
    _bf16_config({"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                 {"stage": 0}),                                              # ZeRO stage 1-3 only
    _bf16_config({"enabled": True, "bf16_master_weights": True, "bf16_optimizer_states": True}),  # a misspelt key
    _bf16_config({"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                 {"stage": 2, "offload_optimizer": {"device": "cpu"}}),      # offloaded: not on the accelerator
    _bf16_config({"enabled": True}),                                         # the paper's 12 bytes
)


def _flag(cfg, key):
    bf16 = cfg.get("bf16")
    return bool(isinstance(bf16, dict) and bf16.get(key))


# what the checker names in each of _BF16_STATES_WRONG, in order
_BF16_STATES_WORDS = ("need offload_optimizer", "bf16 optimizer states need bf16 master weights",
                      "need ZeRO stage 1, 2 or 3", "unknown key 'bf16_master_weights'", "the optimizer is offloaded",
                      "12 bytes per parameter, not 6")


@exercise("13.bf16_states", wrong=tuple(zip(_BF16_STATES_WRONG, _BF16_STATES_WORDS, strict=True)),
          hint="write a dict: bf16 enabled with bf16_master_weights_and_grads and bf16_optimizer_states both true, "
               "zero_optimization stage 2 without offload, a micro-batch size and an optimizer.")
def _check_bf16_states(cfg, world_size=2):
    from dslab.zero import memory
    require_valid_config(cfg, world_size)  # unknown keys (DeepSpeed ignores them), the batch triple, precision
    zero_cfg = cfg.get("zero_optimization") or {}
    stage = zero_cfg.get("stage", 0)
    offload = (zero_cfg.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    if not _flag(cfg, "enabled"):
        raise Mistake('bf16 is not enabled: bf16 master weights and states are keys of the "bf16" section')
    try:
        memory.check_levers(stage, "bf16", offload, master_weights="bf16" if _flag(cfg, "bf16_master_weights_and_grads")
                            else "fp32", optimizer_states="bf16" if _flag(cfg, "bf16_optimizer_states") else "fp32")
    except ValueError as exc:  # what DeepSpeed 0.19.8 refuses, said before anything runs
        raise Mistake(str(exc)) from None
    if offload:
        raise Mistake("the optimizer is offloaded: its states would sit in host memory; keep them on the accelerator")
    if not (_flag(cfg, "bf16_master_weights_and_grads") and _flag(cfg, "bf16_optimizer_states")):
        raise Mistake("this keeps the paper's fp32 master weights and Adam moments: 12 bytes per parameter, not 6")
    from dslab.zero import runner

    try:
        ran = runner.try_config(cfg)  # one optimizer step for real, on a fresh rank
    except RuntimeError as exc:
        raise Mistake(f"DeepSpeed accepted the keys but the run failed: {exc}") from None
    held = ran["memory"]
    params = held["params"] // 2  # bf16 weights, whole on the one rank
    per_param = held["optimizer"] / params
    if abs(per_param - 6) > 0.01:
        raise Mistake(f"the run kept {per_param:.2f} bytes of optimizer states per parameter, not 6")
    return True


# ---- 13.profiled_flops: the learner turns DeepSpeed's flops profiler on and reads its count, on every rank ---------
# profiled_flops(model, batches, profile_step): ZeRO-2 in bf16 with "flops_profiler" profiling global step
# profile_step, one training step per batch, and on every rank the forward FLOPs the profiler counted (only rank 0
# profiles: engine.py starts the profiler when global_steps == profile_step and global_rank == 0). Checked on 2 and 3
# ranks: a small Qwen2 model, batches of a different length at every step and the step to profile, drawn now; the
# count must be dslab.flops.forward_flops of the profiled step's batch, exactly, and it must be what DeepSpeed's
# profiler counted: the trial watches deepspeed.initialize and the profiler's report (FlopsProfiler.print_model_profile,
# which engine.step() calls at the profiled step and which sets .flops), so a count computed without the profiler, or
# profiled on an engine that is not ZeRO-2 in bf16, is refused although the number is right.
PROFILE_TRIAL = f"{__name__}:profile_trial"


def draw_profile_case(world_size, rng=None):
    """A model shape, a batch length per step (all different) and the step to profile, chosen now; never the chapter's
    profile_step 2."""
    import random

    rng = rng or random.SystemRandom()
    heads = rng.choice((2, 4))
    steps = rng.choice((4, 5))
    return {"world_size": world_size,
            "shape": {"hidden_size": heads * rng.choice((8, 16)), "num_attention_heads": heads,
                      "num_key_value_heads": heads // 2, "intermediate_size": 8 * rng.choice((6, 10, 12)),
                      "num_hidden_layers": rng.choice((1, 2)), "vocab_size": rng.choice((300, 500)),
                      "max_position_embeddings": 64},
            "rows": rng.choice((1, 3)), "seq_lens": rng.sample(range(6, 30), steps),
            "profile_step": rng.choice([s for s in range(1, steps) if s != 2]), "seed": rng.randrange(1 << 30)}


def profile_case_config(case):
    """The case's Qwen2 config."""
    from dslab.models.loading import tiny_config

    return tiny_config(**case["shape"])


class _ProfilerWatch:
    """While entered: every engine deepspeed.initialize builds (also when the learner's globals hold the function
    itself), and every report DeepSpeed's flops profiler makes (print_model_profile, where it sets .flops), with the
    engine it belongs to and the global step the engine's config profiles."""

    def __init__(self, namespaces=()):
        self.namespaces = list({id(ns): ns for ns in namespaces}.values())
        self.engines, self.profiles, self._swapped = [], [], []

    def __enter__(self):
        import deepspeed
        from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler

        self._initialize, self._report = deepspeed.initialize, FlopsProfiler.print_model_profile
        watch = self

        def initialize(*args, **kwargs):
            out = watch._initialize(*args, **kwargs)
            watch.engines.append(out[0])
            return out

        def report(profiler, *args, **kwargs):
            out = watch._report(profiler, *args, **kwargs)
            watch.profiles.append({"engine": profiler.ds_engine, "flops": getattr(profiler, "flops", None)})
            return out

        self._spy = initialize
        deepspeed.initialize = initialize
        FlopsProfiler.print_model_profile = report
        for namespace in self.namespaces:
            for name, value in list(namespace.items()):
                if value is self._initialize:
                    namespace[name] = initialize
                    self._swapped.append((namespace, name))
        return self

    def __exit__(self, *exc):
        import deepspeed
        from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler

        deepspeed.initialize = self._initialize
        FlopsProfiler.print_model_profile = self._report
        for namespace, name in self._swapped:
            namespace[name] = self._initialize
        return False

    @staticmethod
    def describe(engine):
        """{"stage", "bf16", "profiler", "profile_step"} of an engine (None: a profile made outside any engine)."""
        if engine is None:
            return None
        enabled = engine.flops_profiler_enabled()
        return {"stage": int(engine.zero_optimization_stage()), "bf16": bool(engine.bfloat16_enabled()),
                "profiler": getattr(engine, "flops_profiler", None) is not None and enabled,
                "profile_step": engine.flops_profiler_profile_step() if enabled else None}

    def summary(self):
        engines = list(self.engines)
        for profile in self.profiles:   # an engine built without deepspeed.initialize counts too
            if profile["engine"] is not None and not any(profile["engine"] is e for e in engines):
                engines.append(profile["engine"])
        return {"engines": [self.describe(e) for e in engines],
                "profiles": [{"flops": p["flops"], "engine": self.describe(p["engine"])} for p in self.profiles]}


def profile_trial(profiled_flops, case):
    """On every rank: the learner's profiled_flops on the case; the count it returned, the counts of every step's
    batch (to tell which one it profiled), and the engines it built and the profiles DeepSpeed made."""
    import torch

    from dslab import flops
    from dslab.models.loading import build_model

    config = profile_case_config(case)
    model = build_model(config, seed=case["seed"] % 1000)
    g = torch.Generator().manual_seed(case["seed"])
    batches = [torch.randint(3, config.vocab_size, (case["rows"], s), generator=g) for s in case["seq_lens"]]
    try:
        with _ProfilerWatch([getattr(profiled_flops, "__globals__", {})]) as watch:
            got = profiled_flops(model, batches, case["profile_step"])
    except AttributeError as exc:
        if "'NoneType' object has no attribute" in str(exc):
            raise Mistake("engine.flops_profiler is None: the profiler is off. \"flops_profiler\": {\"enabled\": true, "
                          "\"profile_step\": profile_step} turns it on") from None
        if "has no attribute 'flops'" in str(exc) and torch.distributed.get_rank() > 0:
            raise Mistake(f"rank {torch.distributed.get_rank()}'s profiler has no count: only rank 0 profiles "
                          "(engine.py starts it when global_rank == 0); read the count on rank 0 and send it to the "
                          "others (dist.broadcast, or broadcast_object_list)") from None
        raise
    if hasattr(got, "item"):
        got = got.item()
    counts = [flops.forward_flops(config, case["rows"], s) for s in case["seq_lens"]]
    return {"got": got if isinstance(got, (int, float)) and not isinstance(got, bool) else repr(got)[:80],
            "totals": [c["total"] for c in counts], "silu": [c["SiLU"] for c in counts],
            "rank": torch.distributed.get_rank(), "watched": watch.summary()}


def diagnose_profile(case, results):
    """A Mistake naming what the learner's profiled_flops did wrong on this case, if anything."""
    step = case["profile_step"]
    first = results[0]
    totals = first["totals"]
    want = totals[step]
    what = (f"{case['world_size']} ranks, batches of {case['rows']} x {case['seq_lens']} tokens, profile_step {step}")
    for r in results:
        got = r["got"]
        if got == want:
            continue
        if not isinstance(got, (int, float)):
            raise Mistake(f"rank {r['rank']} returned {got}: return the count, a number, on every rank ({what})")
        if got == 0 and r["rank"] > 0:
            raise Mistake(f"rank {r['rank']} returned 0: only rank 0 profiles (engine.py starts the profiler when "
                          "global_rank == 0); read its count on rank 0 and broadcast it to the others")
        if got in totals:
            other = totals.index(got)
            raise Mistake(f"rank {r['rank']} returned {got:,}, the forward FLOPs of step {other}'s batch "
                          f"({case['rows']} x {case['seq_lens'][other]} tokens); profile_step {step} (counted from 0) "
                          f"is the step whose batch is {case['rows']} x {case['seq_lens'][step]} ({what}): "
                          "\"profile_step\": profile_step, the argument")
        if 2 * got + first["silu"][step] == want:
            raise Mistake(f"rank {r['rank']} returned {got:,}, the profiler's multiply-adds (macs); the FLOPs are "
                          f"flops: {want:,} ({what})")
        raise Mistake(f"rank {r['rank']} returned {got:,}; DeepSpeed's profiler counts {want:,} forward FLOPs for "
                      f"step {step}'s batch ({what}): read engine.flops_profiler.flops after that step's engine.step()")
    _diagnose_profiler(case, first["watched"], want, what)


def _diagnose_profiler(case, watched, want, what):
    """The right number, but did DeepSpeed's profiler count it, at profile_step, on a ZeRO-2 bf16 engine? (rank 0's
    view: only rank 0 profiles.) A Mistake naming what is missing, if anything."""
    step = case["profile_step"]
    engines, profiles = watched["engines"], watched["profiles"]
    if not engines:
        raise Mistake(f"your function returned the right count ({want:,}) without building a DeepSpeed engine: "
                      "deepspeed.initialize was never called, so DeepSpeed's profiler counted nothing. The task is to "
                      "train with DeepSpeed (ZeRO-2, bf16) and read what its flops profiler counted at profile_step, "
                      f"not to compute the count ({what})")
    asked = [e for e in engines if e["stage"] == 2 and e["bf16"]]
    if not asked:
        built = ", ".join(f"ZeRO stage {e['stage']} in {'bf16' if e['bf16'] else 'fp32'}" for e in engines)
        raise Mistake(f"the engine you trained runs {built}; the task asks for ZeRO-2 in bf16 (\"zero_optimization\": "
                      "{\"stage\": 2}, \"bf16\": {\"enabled\": true}). The forward FLOPs come out the same, the run "
                      "the profiler watched is not the one asked for")
    mine = [p for p in profiles if p["engine"] is not None]
    if not any(e["profiler"] for e in asked):
        raise Mistake("the ZeRO-2 bf16 engine has no flops profiler: \"flops_profiler\": {\"enabled\": true, "
                      "\"profile_step\": profile_step} in its ds_config turns it on")
    counted = [p for p in mine if p["engine"]["stage"] == 2 and p["engine"]["bf16"] and p["flops"] == want
               and p["engine"]["profile_step"] == step]
    if not counted:
        steps = sorted({p["engine"]["profile_step"] for p in mine})
        raise Mistake(f"DeepSpeed's profiler did not count {want:,} on the ZeRO-2 bf16 engine at profile_step {step}"
                      + (f" (it reported at step(s) {steps})" if steps else " (it never reported: run the training "
                         "step at profile_step through engine.step(), which makes the report)")
                      + f"; your number did not come from it ({what})")


def _profile_answer(model, batches, profile_step, step=None, broadcast=True, macs=False, stage=2, bf16=True):
    """profiled_flops as the solution writes it, with one of the usual mistakes switched on (the wrong answers)."""
    import deepspeed
    import torch

    ds_config = {"train_micro_batch_size_per_gpu": batches[0].shape[0], "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": bf16}, "zero_optimization": {"stage": stage},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "flops_profiler": {"enabled": True, "profile_step": profile_step if step is None else step,
                                    "top_modules": 1, "detailed": False},
                 "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    for tokens in batches:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    profiler = engine.flops_profiler
    rank = torch.distributed.get_rank()
    if not broadcast:
        return getattr(profiler, "macs" if macs else "flops", 0)
    count = [getattr(profiler, "macs" if macs else "flops") if rank == 0 else None]
    torch.distributed.broadcast_object_list(count, src=0)
    return count[0]


def _profile_chapters_step(model, batches, profile_step):
    return _profile_answer(model, batches, profile_step, step=2)          # the chapter's profile_step, typed in


def _profile_rank0_only(model, batches, profile_step):
    return _profile_answer(model, batches, profile_step, broadcast=False)  # rank 0's count stays on rank 0


def _profile_macs(model, batches, profile_step):
    return _profile_answer(model, batches, profile_step, macs=True)


def _profile_zero0_fp32(model, batches, profile_step):
    return _profile_answer(model, batches, profile_step, stage=0, bf16=False)   # the right count, not the asked run


def _profile_arithmetic(model, batches, profile_step):
    from dslab import flops

    return flops.forward_flops(model.config, *batches[profile_step].shape)["total"]   # no engine, no profiler


@exercise("13.profiled_flops",
          wrong=((_profile_chapters_step, "the forward FLOPs of step 2's batch"),
                 (_profile_rank0_only, "only rank 0 profiles"),
                 (_profile_macs, "the profiler's multiply-adds"),
                 (_profile_zero0_fp32, "runs ZeRO stage 0 in fp32"),
                 (_profile_arithmetic, "without building a DeepSpeed engine")),
          prepare=on_ranks.preparer(PROFILE_TRIAL, draw_profile_case, diagnose=diagnose_profile),
          hint="complete profiled_flops(model, batches, profile_step): a ds_config (ZeRO-2, bf16) with "
               "\"flops_profiler\": {\"enabled\": true, \"profile_step\": profile_step}; one training step per batch; "
               "then engine.flops_profiler.flops on rank 0, broadcast to every rank.")
def _check_profile(profiled_flops):
    return on_ranks.check(PROFILE_TRIAL, profiled_flops, draw_profile_case, diagnose_profile)
