"""MFU arithmetic (dslab.flops): the forward FLOPs equal what DeepSpeed's flops profiler counts, the rule of thumb's gap
is exactly the terms it names, and the profiler's report is read back. Nothing here starts a rank."""
import pytest

from dslab import flops
from dslab.models.loading import tiny_config

SHAPES = [  # (config overrides, batch, seq): tied and untied heads, grouped-query attention, a set head_dim
    ({}, 4, 128),
    ({"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 6,
      "num_key_value_heads": 3, "vocab_size": 1000, "tie_word_embeddings": False}, 2, 48),
    ({"hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 8,
      "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512}, 3, 20),
]


@pytest.mark.parametrize("overrides, batch, seq", SHAPES)
def test_forward_flops_is_what_deepspeeds_profiler_counts(overrides, batch, seq):
    import torch
    from deepspeed.profiling.flops_profiler import FlopsProfiler

    from dslab.models.loading import build_model

    config = tiny_config(**overrides)
    model = build_model(config).eval()
    tokens = torch.randint(3, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with torch.no_grad():
        model(input_ids=tokens)
    counted, macs = profiler.get_total_flops(), profiler.get_total_macs()
    profiler.end_profile()
    terms = flops.forward_flops(config, batch, seq)
    assert terms["total"] == counted
    assert counted == 2 * macs + terms["SiLU"]  # MACs are the matmuls; SiLU is one FLOP per element
    assert sum(v for k, v in terms.items() if k != "total") == terms["total"]


@pytest.mark.parametrize("overrides, batch, seq", SHAPES)
def test_rule_of_thumb_differs_by_exactly_the_named_terms(overrides, batch, seq):
    from dslab.zero.memory import qwen2_params

    config = tiny_config(**overrides)
    psi = qwen2_params(config)
    gap = flops.rule_of_thumb_gap(psi, config, batch, seq)
    assert gap["rule"] == 2 * psi * batch * seq + flops.attention_flops(config, batch, seq)
    assert gap["rule"] - gap["profiler"] == gap["not multiplied"] - gap["SiLU"]
    if not config.tie_word_embeddings:  # the untied input embedding is a lookup: the rule overcounts it
        assert gap["not multiplied"] >= 2 * batch * seq * config.hidden_size * config.vocab_size


def test_dslab_tiny_numbers():
    terms = flops.forward_flops(tiny_config(), 4, 128)
    assert terms["total"] == 5_923_766_272 and 0.45 < terms["output head"] / terms["total"] < 0.46
    assert flops.mfu(terms["total"], 1.0, 3 * terms["total"] / 1e9) == pytest.approx(1.0)  # ceiling = achieved: 100 %
    assert flops.mfu(terms["total"], 2.0, 3 * terms["total"] / 1e9) == pytest.approx(0.5)


REPORT = """
-------------------------- DeepSpeed Flops Profiler --------------------------
Profile Summary at step 3:
world size:                                                             1
batch size per GPU:                                                     4
fwd flops per GPU:                                                      5.92 G
fwd latency:                                                            48.54 ms
bwd latency:                                                            96.96 ms
step latency:                                                           25.09 ms
iter latency:                                                           1.7 s
samples/second:                                                         23.45
"""


def test_profile_report_is_read_back(tmp_path):
    path = tmp_path / "profile.txt"
    path.write_text(REPORT)
    assert flops.profile_summary(path)[0] == "world size:  1"
    assert flops.profile_latencies(path) == pytest.approx({"fwd": 0.04854, "bwd": 0.09696, "step": 0.02509,
                                                           "iter": 1.7})
    path.write_text(REPORT.replace("bwd latency", "xx").replace("step latency", "yy"))
    with pytest.raises(ValueError, match="wall_clock_breakdown"):
        flops.profile_latencies(path)


def test_ceiling_reuses_chapter_02s_measurement(monkeypatch):
    seen = {}

    def fake(name, n, repeats, threads):
        seen.update(name=name, n=n, repeats=repeats, threads=threads)
        return 123.0

    monkeypatch.setattr(flops.formats, "matmul_gflops", fake)
    assert flops.ceiling("bf16", 1) == 123.0 and seen == {"name": "bf16", "n": flops.CEILING_N, "repeats": 3, "threads": 1}
