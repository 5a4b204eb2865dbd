"""dslab.models.lora and adapter loading (dslab.models.loading): adapters count, save (atomically, never empty), load in plain PEFT, merge verified."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dslab import files
from dslab.models import loading, lora
from dslab.tiny.tokenizer import train_tokenizer

TARGETS_QV = ["q_proj", "v_proj"]
WITH_HEAD = lora.DEFAULT_TARGETS + ("lm_head",)  # the hardest case: the output head is tied to the embeddings


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A random-init model of the dslab-tiny architecture (smaller), with a tokenizer, saved in HF format."""
    out = tmp_path_factory.mktemp("base")
    texts = [json.dumps(r, ensure_ascii=False) for r in
             [json.loads(line) for line in (Path(loading.DEFAULT_MODEL_DIR).parent / "general_sft.jsonl").open()]]
    tok = train_tokenizer(texts, vocab_size=1536, gb2312=False)  # room for the corpus's Chinese characters
    config = loading.tiny_config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    loading.save_pretrained(loading.build_model(config, seed=0), tok, out)
    return out


def _trained_adapter(base_dir, targets=WITH_HEAD, seed=1):
    """The base with LoRA attached and B made non-zero (as if trained), so the adapter changes the output."""
    model = lora.attach_lora(loading.load_model(base_dir), r=4, alpha=8, target_modules=targets)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def test_attach_counts_exactly_r_times_in_plus_out(base_dir):
    base = loading.load_model(base_dir)
    n_base = loading.count_parameters(base)
    cfg = base.config
    model = lora.attach_lora(base, r=4, alpha=8, target_modules=TARGETS_QV)
    counts = lora.trainable_summary(model)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 4 * (cfg.hidden_size + cfg.hidden_size) + 4 * (cfg.hidden_size + cfg.num_key_value_heads * head_dim)
    assert counts["trainable"] == cfg.num_hidden_layers * per_layer
    assert counts["frozen"] == n_base  # the base is all frozen, tied head counted once
    assert set(lora.lora_layers(model)) == {f"base_model.model.model.layers.{i}.self_attn.{t}"
                                            for i in range(cfg.num_hidden_layers) for t in TARGETS_QV}


def test_lora_layer_computes_w_plus_scaled_ba(base_dir):
    model = _trained_adapter(base_dir, targets=TARGETS_QV)
    layer = lora.lora_layers(model)["base_model.model.model.layers.0.self_attn.q_proj"]
    x = torch.randn(3, model.config.hidden_size)
    W, A, B = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = x @ (W + (8 / 4) * B @ A).T + layer.base_layer.bias
    with torch.no_grad():
        assert torch.allclose(layer(x), expected, atol=1e-5)


@pytest.mark.parametrize("state, message", [
    ({}, "no tensors"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.empty(0)}, "size-0"),
    ({"model.embed_tokens.weight": torch.ones(4, 2), "lm_head.weight": torch.ones(4, 2)}, "full model"),
])
def test_check_adapter_state_refuses_bad_adapters(state, message):
    with pytest.raises(loading.AdapterError, match=message):
        loading.check_adapter_state(state)


def test_saved_adapter_loads_in_plain_peft_with_same_logits(base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _trained_adapter(base_dir)
    n = lora.save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [loading.ADAPTER_CONFIG, loading.ADAPTER_WEIGHTS]
    assert n == lora.trainable_summary(model)["trainable"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter").eval()
    ids = lora.probe_ids(model.config.vocab_size)
    assert lora.max_logit_diff(plain, model, ids) < 1e-5


def test_save_refuses_size0_weights_and_keeps_the_previous_adapter(base_dir, tmp_path):
    good = _trained_adapter(base_dir)
    lora.save_adapter(good, tmp_path / "adapter")
    before = load_file(str(tmp_path / "adapter" / loading.ADAPTER_WEIGHTS))
    broken = _trained_adapter(base_dir, seed=2)
    param = next(p for n, p in broken.named_parameters() if "lora_A" in n)
    param.data = torch.empty(0)  # what ZeRO-3 leaves in p.data on every rank
    with pytest.raises(loading.AdapterError, match="ZeRO-3"):
        lora.save_adapter(broken, tmp_path / "adapter")
    after = load_file(str(tmp_path / "adapter" / loading.ADAPTER_WEIGHTS))
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_atomic_dir_replaces_on_success_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with files.atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("first")
    with pytest.raises(RuntimeError):
        with files.atomic_dir(target) as tmp:
            (tmp / "a.txt").write_text("half-written")
            raise RuntimeError("crash while writing")
    assert (target / "a.txt").read_text() == "first"
    with files.atomic_dir(target) as tmp:
        (tmp / "b.txt").write_text("second")
    assert [p.name for p in target.iterdir()] == ["b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_naive_merge_of_a_tied_head_changes_the_embeddings(base_dir):
    """Why merge unties first: merging into a shared lm_head/embedding matrix changes the inputs too."""
    model = _trained_adapter(base_dir)
    ids = lora.probe_ids(model.config.vocab_size)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    naive = model.merge_and_unload()
    with torch.no_grad():
        assert (naive(input_ids=ids).logits - reference).abs().max() > 1e-3


def test_merge_matches_adapter_and_loads_in_plain_transformers(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    lora.save_adapter(_trained_adapter(base_dir), tmp_path / "adapter")
    report = lora.merge(base_dir, tmp_path / "adapter", tmp_path / "merged", dtype="fp32", verbose=False)
    assert report["max_abs_diff"] <= 1e-4 and report["saved_dtype"] == "float32"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with_adapter = loading.load_model(base_dir, adapter=tmp_path / "adapter")
    assert lora.max_logit_diff(merged, with_adapter, lora.probe_ids(merged.config.vocab_size)) <= 1e-4
    assert merged.config.tie_word_embeddings is False
    assert not any(n.startswith("base_model") or "lora_" in n for n, _ in merged.named_parameters())


def test_merge_refuses_bad_adapters_and_writes_nothing(base_dir, tmp_path):
    lora.save_adapter(_trained_adapter(base_dir), tmp_path / "adapter")
    weights = tmp_path / "adapter" / loading.ADAPTER_WEIGHTS
    state = load_file(str(weights))
    # size-0 weights, as a ZeRO-3 rank would save them without gathering
    save_file({k: torch.empty(0) for k in state}, str(weights))
    with pytest.raises(loading.AdapterError, match="size-0"):
        lora.merge(base_dir, tmp_path / "adapter", tmp_path / "merged", verbose=False)
    # a full state dict where the adapter weights should be
    save_file({k: v.clone() for k, v in loading.load_model(base_dir).state_dict().items()}, str(weights))
    with pytest.raises(loading.AdapterError, match="full model"):
        lora.merge(base_dir, tmp_path / "adapter", tmp_path / "merged", verbose=False)
    # a model directory passed as the adapter
    with pytest.raises(loading.AdapterError, match="full model"):
        lora.merge(base_dir, base_dir, tmp_path / "merged", verbose=False)
    assert not (tmp_path / "merged").exists()


def test_merge_that_does_not_reproduce_the_adapter_writes_nothing(base_dir, tmp_path):
    lora.save_adapter(_trained_adapter(base_dir), tmp_path / "adapter")
    with pytest.raises(lora.MergeError, match="nothing written"):
        lora.merge(base_dir, tmp_path / "adapter", tmp_path / "merged", tolerance=0.0, verbose=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_merge_cli_reports_a_clear_error(base_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "dslab.cli", "merge", "--model", str(base_dir), "--adapter",
                          str(base_dir), "--output", str(tmp_path / "m")], capture_output=True, text=True)
    assert out.returncode == 1
    assert "is a full model" in out.stderr and "Traceback" not in out.stderr


def test_unwritable_output_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError):
        files.check_writable(blocker)
    with pytest.raises(PermissionError, match="--output"):
        files.check_writable("/proc/dslab-cannot-write-here/out")


def _reentrant_checkpointing_without_input_grads(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.disable_input_require_grads()  # what a bare training loop (or older transformers) does


def test_gradient_checkpointing_with_lora_needs_input_grads(base_dir):
    ids = lora.probe_ids(400)
    model = lora.attach_lora(loading.load_model(base_dir), r=4, alpha=8, target_modules=TARGETS_QV).train()
    _reentrant_checkpointing_without_input_grads(model)
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(input_ids=ids, labels=ids).loss.backward()
    model = lora.attach_lora(loading.load_model(base_dir), r=4, alpha=8, target_modules=TARGETS_QV).train()
    lora.enable_gradient_checkpointing(model)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}
    assert len(grads) == 2 * model.config.num_hidden_layers
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_an_adapter_saved_by_plain_peft_is_accepted(base_dir, tmp_path):
    """PEFT's own save_pretrained also stores the frozen lm_head when it is a target: still an adapter."""
    model = _trained_adapter(base_dir)
    model.save_pretrained(tmp_path / "peft-saved")
    _, state = loading.read_adapter(tmp_path / "peft-saved")
    assert any(k.endswith("lm_head.base_layer.weight") for k in state)
    report = lora.merge(base_dir, tmp_path / "peft-saved", tmp_path / "merged", verbose=False)
    assert report["max_abs_diff"] <= 1e-4


def test_merge_saves_in_the_requested_dtype_and_reads_back_exactly(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    lora.save_adapter(_trained_adapter(base_dir), tmp_path / "adapter")
    report = lora.merge(base_dir, tmp_path / "adapter", tmp_path / "merged", dtype="bf16", verbose=False)
    assert report["saved_dtype"] == "bfloat16" and report["max_abs_diff"] <= 1e-4
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == torch.bfloat16


def test_bf16_merge_rounding_is_measured_apart_from_bf16_arithmetic(base_dir, tmp_path):
    """dtype_rounding runs the saved weights in float32; update_error sees how much of B·A each merge kept."""
    from transformers import AutoModelForCausalLM

    adapted = _trained_adapter(base_dir, targets=lora.DEFAULT_TARGETS)
    lora.save_adapter(adapted, tmp_path / "adapter")
    reports = {dtype: lora.merge(base_dir, tmp_path / "adapter", tmp_path / dtype, dtype=dtype, verbose=False)
               for dtype in ("fp32", "bf16")}
    with_adapter = loading.load_model(base_dir, adapter=tmp_path / "adapter")
    up = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    ids = lora.probe_ids(up.config.vocab_size)
    assert reports["bf16"]["dtype_rounding"] == pytest.approx(lora.max_logit_diff(up, with_adapter, ids), abs=1e-6)
    merged32 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    assert lora.update_error(with_adapter, merged32) < 1e-4 < lora.update_error(with_adapter, up) < 1.0
    assert lora.update_error(with_adapter, with_adapter.get_base_model()) == pytest.approx(1.0)  # nothing merged


def test_infer_cli_applies_an_adapter_and_refuses_a_bad_one(base_dir, tmp_path):
    from dslab.models import infer

    model = _trained_adapter(base_dir)
    lora.save_adapter(model, tmp_path / "adapter")
    tok = loading.load_tokenizer(base_dir)
    (expected,) = infer.generate(loading.load_model(base_dir, adapter=tmp_path / "adapter"), tok, ["Who are you?"],
                                 max_new_tokens=6, chat=True)
    cmd = [sys.executable, "-m", "dslab.cli", "infer", "--model", str(base_dir), "--chat", "--prompt", "Who are you?",
           "--max-new-tokens", "6", "--json"]
    out = subprocess.run(cmd + ["--adapter", str(tmp_path / "adapter")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["completion"] == expected
    bad = subprocess.run(cmd + ["--adapter", str(base_dir)], capture_output=True, text=True)
    assert bad.returncode != 0 and "is a full model" in bad.stderr and "Traceback" not in bad.stderr


def test_an_adapter_without_the_head_keeps_the_merged_model_tied(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    lora.save_adapter(_trained_adapter(base_dir, targets=lora.DEFAULT_TARGETS), tmp_path / "adapter")
    report = lora.merge(base_dir, tmp_path / "adapter", tmp_path / "merged", verbose=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert report["max_abs_diff"] <= 1e-4
    assert merged.config.tie_word_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight


def test_load_model_merges_an_adapter_when_asked_and_knows_one_dtype_vocabulary(base_dir, tmp_path):
    """One loader: the adapter on top (a PeftModel) or folded in (a plain model, what AutoTP splits); same logits."""
    from peft import PeftModel

    lora.save_adapter(_trained_adapter(base_dir), tmp_path / "adapter")
    with_adapter = loading.load_model(base_dir, adapter=tmp_path / "adapter")
    merged = loading.load_model(base_dir, adapter=tmp_path / "adapter", merge_adapter=True)
    assert isinstance(with_adapter, PeftModel) and not isinstance(merged, PeftModel)
    assert lora.max_logit_diff(merged, with_adapter, lora.probe_ids(merged.config.vocab_size)) <= 1e-4
    assert loading.load_model(base_dir, dtype="bf16").dtype == torch.bfloat16
    for wrong in ("bfloat16", torch.bfloat16):
        with pytest.raises(ValueError, match="not one of fp32, bf16, fp16"):
            loading.load_model(base_dir, dtype=wrong)
    # the adapter records its base directory: that is what loads when no path is given
    assert loading.resolve_model(adapter=tmp_path / "adapter") == str(base_dir)
