"""AutoTP inference: same output as Hugging Face at tp=1 and tp=2, prompts enforced equal, kernel injection refused on CPU."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dslab import launch
from dslab.models import infer, loading
from dslab.parallel import tp_infer

# Not used anywhere in the notebooks.
PROMPTS = ["A quiet harbour at dawn", "我们明天去", "List three colours:"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_completions():
    model, tokenizer = loading.load_model(), loading.load_tokenizer()
    return infer.generate(model, tokenizer, PROMPTS, 16)


def test_policy_marks_the_closing_linears():
    assert tp_infer.autotp_policy(loading.load_model()) == {"Qwen2DecoderLayer": ["mlp.down_proj", "self_attn.o_proj"]}


def test_tp2_equals_hf_and_shards_layers(tmp_path, monkeypatch, hf_completions):
    import torch

    monkeypatch.setenv("DSLAB_RUNS_DIR", str(tmp_path))
    result = tp_infer.generate_tensor_parallel(PROMPTS, tp=2, max_new_tokens=16, stream=False, logits=True)
    assert result["completions"] == hf_completions
    assert result["config"] == {"tensor_parallel": {"tp_size": 2}, "dtype": "float32", "replace_with_kernel_inject": False}
    hf = tp_infer.generate_with_logits(loading.load_model(), loading.load_tokenizer(), PROMPTS, 16)
    tp2_logits = torch.load(result["logits_file"])
    assert hf["new_tokens"] == result["new_tokens"]
    assert max((a - b).abs().max().item() for a, b in zip(hf["logits"], tp2_logits)) <= 1e-4
    rows = {r["name"]: r for r in result["layers"]}
    assert rows["self_attn.q_proj"]["weight"] == [128, 256] and rows["self_attn.o_proj"]["class"] == "LinearAllreduce"


def test_cli_tp2_equals_tp1(tmp_path, hf_completions):
    base = [sys.executable, "-m", "dslab.cli", "infer", "--max-new-tokens", "16", "--json"]
    for p in PROMPTS:
        base += ["--prompt", p]
    env = {"DSLAB_RUNS_DIR": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    one = subprocess.run(base, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    two = subprocess.run(base + ["--tp", "2"], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert one.stdout == two.stdout
    assert [r["completion"] for r in json.loads(two.stdout)] == hf_completions


def test_different_prompts_on_ranks_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DSLAB_RUNS_DIR", str(tmp_path))
    script = tmp_path / "mismatch.py"
    script.write_text(textwrap.dedent("""
        from dslab import this_rank
        from dslab.parallel import tp_infer
        rank, _ = this_rank.init()
        tp_infer.same_prompts_on_every_rank(["same", f"rank {rank} differs"])
    """))
    with pytest.raises(launch.LaunchError, match=r"ranks \[1\] were given other prompts than rank 0 \(prompt 1"):
        launch.run(str(script), world_size=2, stream=False)


@pytest.mark.skipif(tp_infer.accelerator_is_cuda(), reason="CPU-only message")
def test_kernel_inject_refused_on_cpu(capsys):
    from dslab import cli

    assert cli.main(["infer", "--prompt", "hi", "--kernel-inject"]) == 2
    assert "kernel injection needs a CUDA GPU" in capsys.readouterr().err
    assert "LlamaDecoderLayer" in tp_infer.kernel_inject_families()


def test_generate_with_logits_counts_text_tokens_and_matches_generate():
    model, tokenizer = loading.load_model(), loading.load_tokenizer()
    out = tp_infer.generate_with_logits(model, tokenizer, ["Hello!"], 40, chat=True)
    assert out["completions"] == infer.generate(model, tokenizer, ["Hello!"], 40, chat=True)
    prompt_len = len(tokenizer(infer.prompt_text(tokenizer, "Hello!", chat=True), add_special_tokens=False)["input_ids"])
    assert 0 < out["new_tokens"][0] < 40  # stopped early, at <|im_end|>, which is not text and not counted
    # one logit row per token of prompt + answer + the <|im_end|> that ended it
    assert tuple(out["logits"][0].shape) == (prompt_len + out["new_tokens"][0] + 1, model.config.vocab_size)


def test_kernel_injection_is_not_refused_by_dtype():
    """The injected kernels exist for float16, bfloat16 and float32: only the device and the model family count."""
    for dtype in ("fp16", "bf16", "fp32"):
        assert tp_infer.kernel_inject_problem(None, dtype) == tp_infer.kernel_inject_problem(None, "fp16")


def test_digest_sees_order_and_text():
    assert tp_infer.prompts_digest(["a", "b"]) != tp_infer.prompts_digest(["b", "a"])
    assert tp_infer.prompts_digest(["a"]) == tp_infer.prompts_digest(("a",))


def test_dtype_names_are_checked_before_any_rank_starts():
    with pytest.raises(tp_infer.TPInferenceError, match="'fp32', 'bf16', 'fp16'"):
        tp_infer.generate_tensor_parallel(PROMPTS, tp=2, dtype="float32")
    if not tp_infer.accelerator_is_cuda():
        with pytest.raises(tp_infer.TPInferenceError, match="needs a GPU"):
            tp_infer.generate_tensor_parallel(PROMPTS, tp=2, dtype="fp16")
