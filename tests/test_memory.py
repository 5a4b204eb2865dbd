"""ZeRO memory: the paper's formulas, DeepSpeed's estimators, the CLI, and per-rank measurement on real ranks."""
import json
import re

import pytest

from dslab import cli, launch
from dslab.zero import memory, runner

PSI = 1_234_567


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_theory_matches_the_paper_formulas(n):
    k = 12
    expected = {0: (2 + 2 + k) * PSI, 1: 4 * PSI + k * PSI / n, 2: 2 * PSI + (2 + k) * PSI / n,
                3: (2 + 2 + k) * PSI / n}
    for stage, total in expected.items():
        t = memory.theory(PSI, n, stage)
        assert t["total"] == round(total)
        assert abs(t["params"] + t["grads"] + t["optimizer"] - t["total"]) <= 2  # rounding of each part
        assert t["offloaded"] == 0


def test_paper_figure_1_numbers():
    # ZeRO paper, Figure 1: 7.5B parameters on 64 GPUs -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU
    gb = [memory.theory(7.5e9, 64, s)["total"] / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_fp32_variant_has_no_master_copy():
    t = memory.theory(PSI, 1, 0, precision="fp32")
    assert (t["params"], t["grads"], t["optimizer"]) == (4 * PSI, 4 * PSI, 8 * PSI)
    assert memory.theory(PSI, 4, 3, precision="fp32")["total"] == round(16 * PSI / 4)


def test_offload_moves_bytes_to_the_host():
    n = 4
    t = memory.theory(PSI, n, 2, offload_optimizer=True)
    assert (t["params"], t["grads"], t["optimizer"]) == (2 * PSI, 0, 0)
    assert t["offloaded"] == round((12 + memory.HOST_GRAD_BYTES) * PSI / n)  # states + fp32 gradient partition
    s1 = memory.theory(PSI, n, 1, offload_optimizer=True)
    assert s1["grads"] == 2 * PSI  # stage 1 keeps full 16-bit gradients on the device until the boundary
    both = memory.theory(PSI, n, 3, offload_optimizer=True, offload_param=True)
    assert both["total"] == 0 and both["offloaded"] == round((2 + 12 + memory.HOST_GRAD_BYTES) * PSI / n)


@pytest.mark.parametrize("kwargs, words", [
    (dict(zero_stage=4), "0, 1, 2 or 3"),
    (dict(zero_stage=2, offload_param=True), "stage 3"),
    (dict(zero_stage=0, offload_optimizer=True), "stage 1, 2 or 3"),
    (dict(zero_stage=1, world_size=0), "world_size"),
    (dict(zero_stage=1, precision="fp8"), "precision"),
])
def test_bad_setups_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        memory.theory(PSI, **{"world_size": 2, **kwargs})


def test_deepspeed_estimators_count_fp32_gradients_too():
    one = memory.deepspeed_estimate(PSI, world_size=1, zero_stage=2)
    assert one["device"] == 20 * PSI  # 2 + 18 on one GPU: the "20 bytes per parameter" quote
    eight = memory.deepspeed_estimate(8_000_000, world_size=8, zero_stage=2)
    assert eight["device"] == 2 * 8_000_000 + 18 * 8_000_000 // 8
    z3 = memory.deepspeed_estimate(8_000_000, world_size=8, zero_stage=3, largest_layer_params=1000)
    assert z3["device"] == 18 * 8_000_000 // 8 + 4 * 1000
    assert memory.deepspeed_estimate(PSI, 2, zero_stage=1) is None


def test_quoted_bytes_per_param_add_up_and_match_the_formulas():
    """Each quote's breakdown sums to its number; the paper's and DeepSpeed's are what our functions compute."""
    for quoted, why in memory.QUOTED_BYTES_PER_PARAM.items():
        breakdown = re.sub(r"\([^)]*\)", "", why.split(": ", 1)[1])  # "2 (16-bit weights) + ..." -> "2 + ..."
        assert sum(int(term) for term in breakdown.split("+")) == quoted, why
    assert memory.theory(PSI, 1, 0)["total"] == 16 * PSI  # mixed precision + Adam, one GPU, no ZeRO
    assert memory.deepspeed_estimate(PSI, world_size=1, zero_stage=2)["device"] == 20 * PSI


def test_traffic_volume_counts_like_the_paper():
    n, psi_bytes = 2, 2 * 1000  # bf16
    assert memory.traffic_volume({"all_reduce": {psi_bytes: 1}}, n) == 2 * psi_bytes
    assert memory.traffic_volume({"all_gather_into_tensor": {psi_bytes // n: 2},
                                  "reduce_scatter_tensor": {psi_bytes: 1}}, n) == 3 * psi_bytes
    assert memory.comm_volume(1000, 2) == 2 * psi_bytes and memory.comm_volume(1000, 3) == 3 * psi_bytes


def test_ladder_goes_down_until_offload():
    rows = memory.ladder(7e9, 8)
    totals = [r["total"] for r in rows]
    assert totals[0] == 16 * 7e9 and totals[-1] == 0
    assert rows[-1]["offloaded"] > 0 and totals == sorted(totals, reverse=True)


def test_estimate_cli_json(capsys):
    assert cli.main(["estimate", "--params", "1.5e9", "--world-size", "8", "--zero", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    psi = 1.5e9
    assert out["theory"]["total"] == 2 * psi + 14 * psi / 8
    assert (out["zero_stage"], out["world_size"], out["params"]) == (2, 8, 1_500_000_000)
    assert set(out["theory"]) == {"params", "grads", "optimizer", "total", "offloaded"}
    assert "measured" not in out


def test_estimate_cli_refuses_offload_param_below_stage_3(capsys):
    assert cli.main(["estimate", "--params", "1e9", "--zero", "2", "--offload-param"]) == 2
    assert "stage 3" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_keep_only_their_weights(stage):
    """LoRA: all Ψ weights stay (2 bytes each in bf16), gradients and optimizer states only for the T trainable
    ones, partitioned as the stage partitions them; T = Ψ is the plain formula, and leaving it out means T = Ψ."""
    psi, t, n = 8_000_000, 120_000, 4
    lora = memory.theory(psi, n, stage, trainable=t)
    assert lora["params"] == round(2 * psi / (n if stage == 3 else 1))
    assert lora["grads"] == round(2 * t / (n if stage >= 2 else 1))
    assert lora["optimizer"] == round(12 * t / (n if stage >= 1 else 1))
    assert memory.theory(psi, n, stage, trainable=psi) == memory.theory(psi, n, stage)
    offloaded = memory.theory(psi, n, max(stage, 1), offload_optimizer=True, trainable=t)["offloaded"]
    assert offloaded == round((12 + memory.HOST_GRAD_BYTES) * t / n)


def test_chapter_05_lora_run_is_what_trainable_predicts():
    """Chapter 05's LoRA run measured 10.89 MiB of weights and 1.04 MiB of optimizer states on a ZeRO-2 rank (2 ranks,
    5,525,760 base + 181,248 adapter parameters): --trainable gives both."""
    rep = memory.theory(5_525_760 + 181_248, 2, 2, trainable=181_248)
    assert (round(rep["params"] / 2**20, 2), round(rep["optimizer"] / 2**20, 2)) == (10.89, 1.04)


def test_estimate_cli_trainable(capsys):
    """Qwen2-1.5B-Instruct (1,543,714,304 weights) with LoRA r=16 on the MLP (14,106,624), ZeRO-2 on 2 GPUs."""
    t = 28 * 3 * 16 * (1536 + 8960)
    p = 1_543_714_304 + t
    assert cli.main(["estimate", "--params", str(p), "--trainable", str(t), "--zero", "2", "--world-size", "2",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["trainable"]) == (p, t) and out["theory"]["total"] == 2 * p + 14 * t // 2
    assert cli.main(["estimate", "--params", str(p), "--trainable", str(t), "--zero", "2", "--world-size", "2"]) == 0
    text = capsys.readouterr().out
    assert f"Ψ = {p:,} parameters ({t:,} trainable), bf16" in text and "2.994" in text.splitlines()[2]
    assert "it assumes every parameter trains" in text   # DeepSpeed's estimator takes one parameter count
    assert cli.main(["estimate", "--params", "1e9", "--zero", "2"]) == 0
    assert "every parameter trains" not in capsys.readouterr().out


def test_measure_cli_passes_the_shape(monkeypatch, capsys):
    seen = {}

    def fake_measure(zero_stage, world_size, offload_optimizer, offload_param, model=None, shape=None, **kw):
        seen.update(zero_stage=zero_stage, world_size=world_size, shape=shape, model=model)
        print("$ deepspeed --num_gpus 3 ...")  # what dslab.launch prints: must not land in the JSON
        return memory.bytes_per_rank(1000, world_size, zero_stage)

    monkeypatch.setattr(runner, "measure", fake_measure)
    assert cli.main(["measure", "--zero", "3", "--world-size", "3", "--hidden-size", "96", "--layers", "2",
                     "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["world_size"] == 3 and "$ deepspeed" in out.err
    assert seen == {"zero_stage": 3, "world_size": 3, "model": None,
                    "shape": {"hidden_size": 96, "num_hidden_layers": 2, "intermediate_size": 256}}
    assert cli.main(["measure", "--zero", "1", "--model", "some/dir", "--layers", "2"]) == 2


@pytest.mark.parametrize("shape", [{}, dict(hidden_size=128, intermediate_size=336, num_hidden_layers=2,
                                             tie_word_embeddings=False, vocab_size=4096),
                                   dict(hidden_size=96, vocab_size=1024, intermediate_size=256)])
def test_qwen2_params_counts_what_the_model_has(shape):
    import torch
    from transformers import AutoModelForCausalLM

    from dslab.models.loading import count_parameters, tiny_config

    with torch.device("meta"):  # shapes only, no memory
        built = count_parameters(AutoModelForCausalLM.from_config(tiny_config(**shape)))
    assert memory.qwen2_params(tiny_config(**shape)) == built


def test_shape_for_params_lands_near_the_target():
    from dslab.models.loading import tiny_config

    for target in (3e6, 2e7):
        shape = runner.shape_for_params(target, vocab_size=4096, num_hidden_layers=2)
        assert abs(memory.qwen2_params(tiny_config(**shape)) - target) / target < 0.1
        assert shape["vocab_size"] == 4096 and shape["hidden_size"] % 32 == 0


def test_fit_params_keeps_a_size_that_fits_and_shrinks_one_that_does_not():
    budget = 128 * 2**20
    assert runner.fit_params(1e6, 2, 2, budget=budget)[0] == 1_000_000
    fitted, need = runner.fit_params(7e9, 0, 2, budget=budget)
    assert need > budget and runner.fit_params(fitted, 0, 2, budget=budget)[1] <= budget
    assert runner.fit_params(fitted + 1000, 0, 2, budget=budget)[1] > budget  # the largest that fits
    assert runner.fit_params(7e9, 3, 2, budget=budget)[0] == 2 * fitted       # stage 3 at N = 2: half the bytes


@pytest.fixture(scope="module")
def three_ranks():
    """One real 3-rank run of a shape no notebook uses: stages 1-3 and stage 2 with offloaded optimizer."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < 3:
        pytest.skip("needs 3 ranks: 3 GPUs, or the CPU")
    setups = [{"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
              {"zero_stage": 2, "offload_optimizer": True}]
    shape = {"hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 1024}
    result = launch.run("zero_memory", world_size=3, stream=False, timeout=600, setups=setups, shape=shape,
                        steps=2, seq_len=16)
    return [memory.report_from_results(result.results, i) for i in range(len(setups))]


def test_measured_totals_match_theory_on_three_ranks(three_ranks):
    for rep in three_ranks:
        assert len(rep["measured"]) == 3 and [m["rank"] for m in rep["measured"]] == [0, 1, 2]
        for ratio in memory.ratios(rep):
            assert abs(ratio - 1) < 0.02, (rep["zero_stage"], ratio)
        for m in rep["measured"]:
            assert m["total"] == m["params"] + m["grads"] + m["optimizer"]


def test_stage2_gradients_are_partitioned_and_boundaries_reported_as_buffers(three_ranks):
    rep = three_ranks[1]
    psi = rep["params"]
    grads = [m["grads"] for m in rep["measured"]]
    assert abs(sum(grads) - 2 * psi) < 64  # the three partitions add up to one full 16-bit gradient
    # the embedding (1024 x 96) is larger than a third of the model: a neighbour keeps its whole gradient
    boundary = [m["detail"].get("gradients of boundary parameters, neighbour's part", 0) for m in rep["measured"]]
    assert max(boundary) > 0 and all(m["buffers"] >= b for m, b in zip(rep["measured"], boundary))


def test_stage1_keeps_full_gradients_stage3_partitions_parameters(three_ranks):
    s1, s3 = three_ranks[0], three_ranks[2]
    assert all(m["grads"] == 2 * s1["params"] for m in s1["measured"])
    assert all(abs(m["params"] - 2 * s3["params"] / 3) < 64 for m in s3["measured"])


def test_offload_optimizer_measured_on_the_host(three_ranks):
    rep = three_ranks[3]
    for m, ratio in zip(rep["measured"], memory.ratios(rep, "offloaded")):
        assert m["optimizer"] == 0 and m["grads"] == 0
        assert abs(ratio - 1) < 0.02
        assert m["host_buffers"] > 0  # staging copies the CPU optimizer uses, reported apart


def test_try_config_names_the_rank_error_quietly(tmp_path, monkeypatch, capsys):
    """A config DeepSpeed refuses only when it builds the optimizer: the rank's error line, nothing printed or left."""
    from dslab.config.build import make_config

    monkeypatch.chdir(tmp_path)
    cfg = make_config(zero_stage=1, micro_batch_size=2, world_size=1)
    cfg["optimizer"]["params"]["bogus"] = 1
    capsys.readouterr()  # DeepSpeed's import-time log line, from make_config's check in this process
    with pytest.raises(RuntimeError, match="unexpected keyword argument 'bogus'"):
        runner.try_config(cfg)
    assert capsys.readouterr().out == "" and list(tmp_path.iterdir()) == []
