"""The newer levers on the optimizer states (chapter 13): Muon, bf16 master weights and bf16 optimizer states.

Theory (dslab.zero.memory.optimizer_bytes / theory / muon_split / muon_momentum_elements), what DeepSpeed 0.19.8 refuses,
`dslab estimate` with the levers, and the bytes two real ranks hold (dslab.zero.optimizer_states) against the theory.
"""
import json
import math
from types import SimpleNamespace

import pytest

from dslab import cli
from dslab.config import build
from dslab.zero import memory, optimizer_states

PSI = 1_234_568  # even: ZeRO pads nothing at N = 2


@pytest.mark.parametrize("n", [1, 2, 8])
def test_k_of_each_lever_per_stage(n):
    f = 0.75
    cases = {  # (choice, K at ZeRO 1-2, K at ZeRO-3): optimizer-state bytes per parameter
        "adam": ({}, 12, 12),
        # ZeRO 1-2: the bf16 momentum and its staged copy (dslab.compat.muon_staged_momentum); ZeRO-3: one
        "muon": ({"optimizer": "muon", "muon_fraction": f}, 4 + f * (2 + 2) + (1 - f) * 8, 4 + f * 2 + (1 - f) * 8),
        "bf16 masters + states": ({"master_weights": "bf16", "optimizer_states": "bf16"}, 2 + 2 + 2, 2 + 2 + 2),
    }
    for stage in (1, 2, 3):
        for choice, k12, k3 in cases.values():
            t = memory.theory(PSI, n, stage, **choice)
            assert t["optimizer"] == round((k3 if stage == 3 else k12) * PSI / n)
            assert t["params"] == round(2 * PSI / (n if stage == 3 else 1))  # the weights do not change
    # stage 0 and offload keep Muon's momentum fp32, beside the fp32 master copy
    assert memory.theory(PSI, 1, 0, optimizer="muon", muon_fraction=f)["optimizer"] == round((4 + 4 * f + 8 * (1 - f)) * PSI)
    off = memory.theory(PSI, n, 2, offload_optimizer=True, optimizer="muon", muon_fraction=f)
    assert off["offloaded"] == round((4 + 4 * f + 8 * (1 - f) + 4) * PSI / n)


def test_bf16_masters_with_offload_keep_bf16_gradients_on_the_host():
    n = 4
    plain = memory.theory(PSI, n, 2, offload_optimizer=True)
    masters = memory.theory(PSI, n, 2, offload_optimizer=True, master_weights="bf16")
    both = memory.theory(PSI, n, 2, offload_optimizer=True, master_weights="bf16", optimizer_states="bf16")
    assert plain["offloaded"] == round((4 + 8 + 4) * PSI / n)    # fp32 master, Adam, fp32 gradient partition
    assert masters["offloaded"] == round((2 + 8 + 2) * PSI / n)  # bf16 master and gradient partition
    assert both["offloaded"] == round((2 + 4 + 2) * PSI / n)
    assert plain["total"] == masters["total"] == both["total"] == 2 * PSI  # the device keeps the bf16 weights


def test_defaults_are_the_papers_numbers():
    for stage in range(4):
        assert memory.optimizer_bytes(zero_stage=stage)["total"] == 12
        assert memory.theory(PSI, 4, stage) == memory.theory(PSI, 4, stage, optimizer="adam", master_weights="fp32",
                                                             optimizer_states="fp32")
    assert memory.optimizer_bytes("fp32")["total"] == 8  # fp32 training: the weights are their own master copy


@pytest.mark.parametrize("kwargs, words", [
    ({"zero_stage": 2, "master_weights": "bf16"}, "requires ZeRO-2 Offload with DeepSpeedCPUAdam"),
    ({"zero_stage": 2, "optimizer_states": "bf16"}, "requires bf16_master_weights_and_grads"),
    ({"zero_stage": 0, "master_weights": "bf16", "optimizer_states": "bf16"}, "stage 1, 2 or 3"),
    ({"zero_stage": 2, "precision": "fp32", "master_weights": "bf16", "optimizer_states": "bf16"}, "precision must be bf16"),
    ({"zero_stage": 2, "optimizer": "muon"}, "muon_fraction"),
    ({"zero_stage": 2, "optimizer": "muon", "muon_fraction": 1.5}, "muon_fraction"),
    ({"zero_stage": 2, "muon_fraction": 0.5}, "optimizer muon only"),
    ({"zero_stage": 2, "optimizer": "lion"}, "adam, muon"),
    ({"zero_stage": 2, "master_weights": "fp16"}, "fp32, bf16"),
    ({"zero_stage": 2, "optimizer": "muon", "muon_fraction": 0.5, "master_weights": "bf16", "optimizer_states": "bf16"},
     "not covered"),
])
def test_refused_choices_name_the_rule(kwargs, words):
    with pytest.raises(ValueError, match=words):
        memory.theory(PSI, **{"world_size": 2, **kwargs})


def _tiny_meta():
    import torch
    from transformers import AutoModelForCausalLM

    from dslab.models.loading import tiny_config

    with torch.device("meta"):  # shapes only
        return AutoModelForCausalLM.from_config(tiny_config())


def test_muon_split_is_deepspeeds_rule():
    """memory.is_muon_matrix tags the same parameters as deepspeed.set_optimizer_flags (what initialize runs)."""
    from deepspeed import set_optimizer_flags
    from deepspeed.runtime.config import MUON_OPTIMIZER

    model = _tiny_meta()
    set_optimizer_flags(SimpleNamespace(optimizer_name=MUON_OPTIMIZER, optimizer_params={}), model)
    ours = [n for n, p in model.named_parameters() if memory.is_muon_matrix(n, p.shape)]
    assert ours == [n for n, p in model.named_parameters() if p.use_muon]
    split = memory.muon_split([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    assert (split["muon"], split["adam"]) == (2_899_968, 2_625_792)  # dslab-tiny: 7 matrices x 4 layers
    assert len(split["muon_shapes"]) == 28 and math.isclose(split["muon_fraction"], 2_899_968 / 5_525_760)


def test_muon_momentum_keeps_whole_matrices_at_partition_boundaries():
    import torch

    shapes = [(4, 4), (2, 4), (4, 4)]  # sorted: (4, 4), (4, 4), (2, 4): 16, 16, 8 elements; partitions of 20 at N = 2
    assert memory.muon_momentum_elements(shapes, 1) == [40]
    assert memory.muon_momentum_elements(shapes, 2) == [32, 24]  # the second 4 x 4 straddles: both keep it
    assert memory.muon_momentum_elements([(8, 2)] * 4, 2) == [32, 32]  # a boundary between matrices: no overlap
    # DeepSpeed sorts by the shape tuple (original_muon.py: key=lambda x: x.size(), reverse=True), not by size:
    # (3, 10) comes before the larger (2, 100), which then straddles the boundary at 116
    shapes = [(2, 100), (3, 10)]
    ordered = sorted((torch.empty(shape) for shape in shapes), key=lambda x: x.size(), reverse=True)
    assert [tuple(t.shape) for t in ordered] == [(3, 10), (2, 100)]
    assert memory.muon_momentum_elements(shapes, 2) == [30 + 200, 200]


def test_estimate_cli_with_levers(capsys):
    assert cli.main(["estimate", "--params", "7e9", "--world-size", "8", "--zero", "2", "--optimizer", "muon",
                     "--muon-fraction", "0.9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["optimizer"], out["muon_fraction"]) == ("muon", 0.9)
    assert out["theory"]["optimizer"] == round((4 + 0.9 * (2 + 2) + 0.1 * 8) * 7e9 / 8)   # momentum + staged copy
    assert cli.main(["estimate", "--params", "7e9", "--world-size", "8", "--zero", "2", "--master-weights", "bf16",
                     "--optimizer-states", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "bf16 master weights, bf16 optimizer states" in text and "DeepSpeed's estimate" not in text
    assert cli.main(["estimate", "--params", "7e9", "--zero", "2", "--master-weights", "bf16"]) == 2
    assert "DeepSpeedCPUAdam" in capsys.readouterr().err
    assert cli.main(["estimate", "--params", "7e9", "--zero", "2", "--optimizer", "muon"]) == 2
    assert "muon_fraction" in capsys.readouterr().err
    assert cli.main(["estimate", "--params", "1e9", "--zero", "2", "--json"]) == 0  # no lever: the report as before
    assert "optimizer" not in json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- measured on two real ranks

BASE = build.make_config(zero_stage=2, precision="bf16", micro_batch_size=2, grad_accum_steps=2, world_size=2)
LEVERS = {
    "Adam": {},
    "Muon": {"optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "adam_lr": 1e-3}}},
    "bf16 masters + states": {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
}


@pytest.fixture(scope="module")
def two_ranks(live_two_ranks):
    """One real 2-rank run of dslab-tiny's shape under Adam, Muon and bf16 masters + states (ZeRO-2), on the session's
    live ranks (chapter 13 launches the same run_setups with optimizer_states.measure)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 ranks: 2 GPUs, or the CPU")
    setups = [{"name": name, "ds_config": build.deep_merge(BASE, change)} for name, change in LEVERS.items()]
    return [r["runs"] for r in live_two_ranks.apply(optimizer_states.run_setups, setups)]


def test_measured_optimizer_bytes_match_theory_on_two_ranks(two_ranks):
    model = _tiny_meta()
    psi = sum(p.numel() for p in model.parameters())
    split = memory.muon_split([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    whole = memory.muon_momentum_elements(split["muon_shapes"], 2)
    for rank, runs in enumerate(two_ranks):
        adam = memory.theory(psi, 2, 2)["optimizer"]
        bf16 = memory.theory(psi, 2, 2, master_weights="bf16", optimizer_states="bf16")["optimizer"]
        muon = memory.theory(psi, 2, 2, optimizer="muon", muon_fraction=split["muon_fraction"])["optimizer"]
        # the bf16 momentum of the matrix cut by the boundary, in both copies (committed and staged)
        straddle = 2 * memory.MUON_MOMENTUM_COPIES * (whole[rank] - split["muon"] // 2)
        measured = {name: run["memory"]["optimizer"] - 4 for name, run in runs.items()}  # - Adam's step counter
        assert measured == {"Adam": adam, "bf16 masters + states": bf16, "Muon": muon + straddle}
        assert abs(measured["Muon"] / muon - 1) < 0.02  # the even-split theory, within the straddling matrix
        census = runs["Muon"]["census"]
        assert optimizer_states.state_bytes(census, "muon", "momentum_buffer") == 2 * whole[rank]
        assert optimizer_states.state_bytes(census, "muon", "staged momentum") == 2 * whole[rank]
        assert {r["dtype"] for r in census if r["state"] == "momentum_buffer"} == {"bf16"}
        assert {r["dtype"] for r in runs["bf16 masters + states"]["census"]} == {"bf16"}


def test_bf16_masters_lose_updates_smaller_than_half_a_step(two_ranks):
    for runs in two_ranks:
        assert runs["Adam"]["norm_moved"] == runs["Adam"]["norm_elements"] == 2304
        assert runs["bf16 masters + states"]["norm_moved"] == 0
        assert runs["Muon"]["inner_optimizer"] == "MuonWithAuxAdam"
