"""Chapter 13 (where the time goes, newer memory levers): count a forward pass's FLOPs in code, Muon's optimizer
bytes per parameter, and a bf16-states config run for real.

Solutions: notebooks/solutions/13_solutions.py."""
from dslab.exercises import Mistake, exercise, expect, require_valid_config


# 13.forward_flops: the learner writes my_forward_flops(config, batch_size, seq_len) -> the forward FLOPs DeepSpeed's
# flops profiler counts for a Qwen2-style model. The checker compares it with dslab.mfu.forward_flops on shapes that
# tell the terms apart (tied and untied heads, grouped-query attention, a head size set apart from hidden/heads).
def _configs():
    from dslab.models import tiny_config

    return [
        (tiny_config(), 4, 128),
        (tiny_config(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6,
                     num_key_value_heads=3, vocab_size=1000, tie_word_embeddings=False), 2, 48),
        (tiny_config(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, vocab_size=512), 3, 20),
    ]


def _diagnose(got, terms, config, batch_size, seq_len):
    """A hint naming the term the answer is off by, when it is off by exactly one."""
    from dslab import mfu

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
    layers, h, heads, kv_heads, d, _, _ = mfu.layer_shape(config)
    if kv_heads != heads and got == total - 2 * 2 * batch_size * seq_len * layers * h * (heads - kv_heads) * d:
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
    from dslab import mfu

    if not callable(fn):
        raise Mistake(f"answer with the function itself (answer = my_forward_flops), got {type(fn).__name__}")
    for config, batch_size, seq_len in _configs():
        terms = mfu.forward_flops(config, batch_size, seq_len)
        got = fn(config, batch_size, seq_len)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or got != terms["total"]:
            shape = (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} "
                     f"heads / {config.num_key_value_heads} kv heads, vocab {config.vocab_size}, batch {batch_size} "
                     f"x seq {seq_len}")
            number = isinstance(got, (int, float)) and not isinstance(got, bool)
            why = _diagnose(got, terms, config, batch_size, seq_len) if number else None
            raise Mistake(f"for {shape} the profiler counts {terms['total']:,} FLOPs, your function gives "
                          + (f"{got:,.0f}" if number else repr(got)) + (f": {why}" if why else ""))
    return True


def _answer_without(config, batch_size, seq_len, term):
    """A learner's typical miss: the right count without one term (for the wrong answers above)."""
    from dslab import mfu

    terms = mfu.forward_flops(config, batch_size, seq_len)
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
            "(8 bytes). Weigh the two by 0.9 and 0.1; dslab.memory.optimizer_bytes checks it.")


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
    from dslab import memory
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
    from dslab import zero

    try:
        ran = zero.try_config(cfg)  # one optimizer step for real, on a fresh rank
    except RuntimeError as exc:
        raise Mistake(f"DeepSpeed accepted the keys but the run failed: {exc}") from None
    held = ran["memory"]
    params = held["params"] // 2  # bf16 weights, whole on the one rank
    per_param = held["optimizer"] / params
    if abs(per_param - 6) > 0.01:
        raise Mistake(f"the run kept {per_param:.2f} bytes of optimizer states per parameter, not 6")
    return True
