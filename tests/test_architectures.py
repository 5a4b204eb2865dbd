"""Checkpoints of the families learners fine-tune drop in: tiny random Llama, Mistral, Qwen3 and Phi-3 models, made
here from transformers' configs with the kit's tokenizer (untied and tied heads), find their LoRA layers by module
type, train under ZeRO-2 and ZeRO-3 on 2 ranks with `dslab sft`, merge with `dslab merge`, and answer through
`dslab infer` and `dslab eval`."""
import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config)

from dslab import cli
from dslab.models import loading, lora
from dslab.training import sft

MLP = ("gate_proj", "up_proj", "down_proj")
FAMILIES = {  # config class, tied head, the MLP's linear layers as the family names them
    "llama": (LlamaConfig, False, MLP),
    "mistral": (MistralConfig, False, MLP),
    "qwen2": (Qwen2Config, True, MLP),
    "qwen3": (Qwen3Config, True, MLP),
    "phi3": (Phi3Config, False, ("gate_up_proj", "down_proj")),   # gate and up in one matrix
}


def tiny(family, tokenizer):
    config_class, tied, _ = FAMILIES[family]
    return config_class(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        tie_word_embeddings=tied, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture(scope="module")
def tokenizer():
    return loading.load_tokenizer()


@pytest.fixture(scope="module")
def checkpoints(tokenizer, tmp_path_factory):
    """A local checkpoint folder per family: random weights (safetensors) and the kit's tokenizer."""
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny(family, tokenizer))
        model.save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
    return root


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_layers_are_found_by_type_and_checked_against_the_model(family, checkpoints):
    expected = FAMILIES[family][2]
    assert lora.targets_of(checkpoints / family) == expected
    model = loading.load_model(checkpoints / family)
    adapted = lora.attach_lora(model, r=4, alpha=8)
    adapted_layers = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in adapted.named_parameters() if "lora_A" in n}
    assert adapted_layers == set(expected)
    with pytest.raises(loading.AdapterError, match=" ".join(expected)):
        lora.resolve_targets(loading.load_model(checkpoints / family), ["fc1", "fc2"])


def test_a_model_without_linear_mlp_layers_is_told_to_name_them():
    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(loading.AdapterError, match="--target-modules"):
        lora.attach_lora(gpt2)


@pytest.mark.parametrize("family, zero_stage", [("llama", 3), ("qwen3", 2), ("phi3", 3)])
def test_sft_merge_infer_eval(family, zero_stage, checkpoints, tmp_path, capsys):
    """One epoch is enough to check the path (the identity itself is chapter 05's and tests/test_takeaway.py's)."""
    base = checkpoints / family
    result = sft.run(output=tmp_path / "adapter", model=str(base), zero_stage=zero_stage, world_size=2, epochs=1,
                     stream=False, timeout=600)
    assert result["zero_stage"] == zero_stage and result["ungathered_adapter_numel"] == (0 if zero_stage == 3 else
                                                                                          result["trainable"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(FAMILIES[family][2])

    # the verbs run in this process (dslab.cli.main, what the console script calls): a Python start each saved
    merged = tmp_path / "merged"
    out = _cli(capsys, "merge", "--adapter", str(tmp_path / "adapter"), "--output", str(merged))
    assert "max |diff| <= 0.0001" in out
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert plain.config.tie_word_embeddings == FAMILIES[family][1] and not any("lora" in n for n, _ in
                                                                                 plain.named_parameters())
    out = _cli(capsys, "infer", "--model", str(merged), "--chat", "--prompt", "Who are you?", "--max-new-tokens", "4",
               "--json")
    assert json.loads(out)[0]["prompt"] == "Who are you?"
    out = _cli(capsys, "eval", "--model", str(base), "--adapter", str(tmp_path / "adapter"), "--model-name", "Whale",
               "--model-author", "DSLab", "--json")
    assert json.loads(out)


def _cli(capsys, *argv):
    """`dslab ARGV`, run in this process; its standard output, once it exits 0."""
    capsys.readouterr()
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert status == 0, out + err
    return out
