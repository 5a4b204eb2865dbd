"""dslab.training.accumulation: micro-batches vs big batch, the summing mistake, token normalisation, activation memory."""
import pytest

from dslab.training import accumulation as acc
from dslab import plots

K = 4


@pytest.fixture(scope="module")
def batch():
    return acc.token_batch(8, 16, seed=1)


def model_fn():
    return acc.small_lm(seed=0)


def test_split_makes_separate_equal_micro_batches(batch):
    parts = acc.split(batch, K)
    assert len(parts) == K and all(p["input_ids"].shape == (2, 16) for p in parts)
    assert parts[0]["input_ids"].untyped_storage().data_ptr() != batch["input_ids"].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="does not split"):
        acc.split(batch, 3)


def test_mean_accumulation_equals_the_big_batch(batch):
    big = acc.one_step(model_fn, batch, k=1)
    mean = acc.one_step(model_fn, batch, k=K, mode="mean")
    assert acc.equivalent(mean["grads"], big["grads"])
    assert acc.equivalent(mean["weights"], big["weights"])
    assert acc.compare(mean["update"], big["update"])["rel_diff"] < 1e-5


def test_summing_makes_the_sgd_step_k_times_larger(batch):
    big = acc.one_step(model_fn, batch, k=1)
    summed = acc.one_step(model_fn, batch, k=K, mode="sum")
    assert not acc.equivalent(summed["grads"], big["grads"])
    assert acc.norm(summed["update"]) / acc.norm(big["update"]) == pytest.approx(K, rel=1e-4)
    assert acc.norm(summed["grads"]) / acc.norm(big["grads"]) == pytest.approx(K, rel=1e-4)


def test_adam_hides_the_summing_mistake_in_the_step(batch):
    big = acc.one_step(model_fn, batch, k=1, optimizer="adamw", lr=1e-3)
    summed = acc.one_step(model_fn, batch, k=K, mode="sum", optimizer="adamw", lr=1e-3)
    assert acc.norm(summed["update"]) / acc.norm(big["update"]) == pytest.approx(1.0, abs=0.01)


def test_padding_needs_token_normalisation():
    padded = acc.token_batch(8, 16, lengths=[16, 3, 16, 9, 5, 16, 12, 7], seed=2)
    big = acc.one_step(model_fn, padded, k=1)
    mean = acc.one_step(model_fn, padded, k=K, mode="mean")
    tokens = acc.one_step(model_fn, padded, k=K, mode="tokens")
    assert acc.compare(mean["grads"], big["grads"])["rel_diff"] > 1e-2
    assert acc.equivalent(tokens["grads"], big["grads"])
    with pytest.raises(ValueError, match="mode"):
        acc.accumulate_backward(model_fn(), acc.split(padded, K), mode="average")


def test_count_targets_skips_padding_and_the_first_token():
    b = acc.token_batch(2, 10, lengths=[10, 4])
    assert acc.count_targets(b) == 9 + 3


def test_activation_meter_counts_and_releases():
    model = model_fn()
    b = acc.token_batch(2, 16)
    with acc.ActivationMeter(model) as meter:
        loss = model(**b).loss
        held = meter.current_bytes
        loss.backward()
    assert held > 0 and meter.peak_bytes == held and meter.current_bytes == 0


def test_activations_grow_with_micro_batch_not_accumulation_steps():
    model = model_fn()
    sweep = acc.activation_sweep(model, micro_batch_sizes=(1, 4), accum_steps=(1, 4), seq_len=16)
    (m1, b1), (m4, b4) = sweep["micro"]
    assert 3.0 < b4 / b1 <= 4.0                                         # about linear in the micro batch
    assert sweep["accum"][0][1] == sweep["accum"][1][1]                 # flat in accumulation steps
    one = dict(sweep["accum_one_backward"])
    assert one[4] / one[1] == pytest.approx(4.0, rel=1e-6)              # one backward keeps every graph
    fig, data = plots.activation_memory(sweep)
    assert data["accum"][0][1] == data["accum"][1][1]


def test_accumulation_driver_on_two_ranks(tmp_path):
    from dslab import launch

    r = launch.run("accumulation", world_size=2, run_dir=tmp_path, stream=False).rank0
    runs = r["runs"]
    for name in ("accumulate", "big_micro_batch", "accumulate_zero1"):
        assert runs[name]["vs_reference"]["rel_diff"] < 1e-5, name
        assert runs[name]["train_batch_size"] == 16
    assert runs["divided_twice"]["step_ratio"] == pytest.approx(0.25, rel=1e-4)
    steps = runs["accumulate"]["micro_steps"]
    assert [s["boundary"] for s in steps] == [False, False, False, True]
    assert [s["weights_changed"] for s in steps] == [False, False, False, True]
    assert steps[0]["grad_over_plain_grad"] == pytest.approx(0.25, rel=1e-5)
    assert r["hf_filled"] == {"world_size": 2, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                              "gradient_accumulation_steps": 4}
    assert all(d["train_batch_size"] == 16 and d["gradient_accumulation_steps"] == 4 for d in r["triples"]["derived"])
    assert "16 != 2 * 5 * 2" in r["triples"]["refused"]


def test_gradient_reductions_skip_scalars_and_gathers():
    # DeepSpeed's comms log: {op: {message bytes: [count, latencies, algbw, busbw]}}
    log = {"all_reduce": {251008: [2, [], [], []], 4: [1, [], [], []], 1: [1, [], [], []]},
           "reduce_scatter_tensor": {251008: [1, [], [], []]},
           "all_gather_into_tensor": {125504: [3, [], [], []]}}
    assert acc.logged_gradient_reductions(log) == (3, 3 * 251008)
    assert acc.logged_gradient_reductions({}) == (0, 0)


def test_window_setups_keep_the_global_batch():
    for name, (zero_stage, micro, accum, mode) in acc.window_setups(micro=2, accum=4).items():
        cfg = acc.window_config(zero_stage, micro, accum, world_size=2)
        assert cfg["train_batch_size"] == 16 and cfg["gradient_clipping"] == 0.0 and "optimizer" not in cfg, name
        assert cfg["zero_allow_untested_optimizer"] == (zero_stage > 0)
        assert mode in ("engine", "divided_twice", "no_gas_scaling")
