"""The catalogue of bad inputs a learner meets, item by item: each fails early, says what is wrong and how to fix
it, and leaves what was on disk as it was. The list below is the catalogue (there is no other copy of it).

Where each item is tested (this file fills the gaps: the point of use in `dslab sft`, and disk safety):
- batch triple mismatch ........ test_config_check.py::test_batch_triple_mismatch_names_the_key_and_where_world_size_came_from;
                                 here: test_bad_deepspeed_file_is_refused_before_launch[batch-triple]
- "auto" outside the HF Trainer  test_config_check.py::test_auto_outside_the_hf_trainer; here: [auto]
- numbers written as strings ... test_config_check.py::test_numbers_and_booleans_written_as_strings;
                                 here: [number-as-string]
- fp16 and bf16 both on ........ test_config_check.py::test_fp16_and_bf16_both_enabled; here: [fp16-and-bf16]
- fp16 on CPU .................. test_config_check.py::test_fp16_on_a_cpu_accelerator,
                                 ::test_fp16_on_a_cpu_accelerator_that_says_yes_or_no; here: [fp16-on-cpu]
- bf16 on a GPU without support  test_config_check.py::test_bf16_on_a_gpu_without_bf16 (capability query mocked)
- unknown / typo'd keys ........ test_config_check.py::test_misspelled_keys_at_every_level_get_a_suggestion,
                                 test_sft.py::test_bad_deepspeed_file_is_refused_before_launch; here: [typo-key]
- offload_param without stage 3  test_config_check.py::test_offload_param_needs_stage_3; here: [offload-param-stage-2]
- stage not in 0-3 ............. test_config_check.py::test_stage_must_be_0_to_3; here: [stage-7]
- merge / state_dict under ZeRO-3 without gathering (size-0 weights)
                                 test_lora.py::test_save_refuses_size0_weights_and_keeps_the_previous_adapter,
                                 ::test_merge_refuses_bad_adapters_and_writes_nothing, test_sft.py (real ZeRO-3 run);
                                 here: test_full_model_save_refuses_size0_weights_and_keeps_the_old_model,
                                 test_merge_of_a_bad_adapter_leaves_an_existing_output_alone[size-0]
- saved adapter with empty tensors
                                 test_lora.py::test_check_adapter_state_refuses_bad_adapters;
                                 here: test_merge_of_a_bad_adapter_leaves_an_existing_output_alone[no-tensors]
- full state dict as an adapter  test_lora.py::test_merge_refuses_bad_adapters_and_writes_nothing,
                                 ::test_infer_cli_applies_an_adapter_and_refuses_a_bad_one;
                                 here: [full-state-dict], test_a_model_weights_file_given_as_the_adapter
- master port taken ............ test_launch.py::test_results_per_rank_and_a_taken_port_is_replaced;
                                 here: test_taken_preferred_port_is_replaced_by_a_free_one
- CUDA_VISIBLE_DEVICES with the deepspeed launcher
                                 here: test_cuda_visible_devices_*
- missing ninja/compiler/numactl before a JIT op build
                                 test_env.py::test_prepare_names_missing_tools_and_how_to_install (build_tools patched);
                                 here: test_prepare_with_no_compiler_on_path (real PATH stripped)
- different inputs on AutoTP ranks
                                 test_tp_infer.py::test_different_prompts_on_ranks_are_refused
- resume on another world size . test_sft.py::test_resume_on_another_world_size_needs_the_same_global_batch_and_zero
- malformed data lines ......... test_data.py::test_broken_line_is_named_with_file_and_line (and others there),
                                 test_infer.py::test_cli_bad_prompts_file_names_the_line;
                                 here: test_malformed_sft_data_is_refused_before_launch
- a model folder that does not exist, a pickle-only checkpoint, nonsensical numbers, for every dslab verb
                                 test_cli_inputs.py::test_a_model_folder_that_does_not_exist,
                                 ::test_a_pickle_only_checkpoint_is_refused_and_never_unpickled,
                                 ::test_estimate_refuses_a_negative_size (one test per bad input in that file)
"""
import ast
import fnmatch
import hashlib
import json
import re
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dslab import data, launch
from dslab.config import build, check
from dslab.models import loading, lora
from dslab.training import sft
from support import force_fp16_support


def _snapshot(folder):
    """{relative path: sha256} of every file under `folder` (to prove a failed call changed nothing)."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_launch(monkeypatch):
    """A tripwire: these inputs must be refused before any rank is started."""
    def launched(*args, **kwargs):
        raise AssertionError("ranks were launched before the bad input was found")

    monkeypatch.setattr(launch, "run", launched)


@pytest.fixture
def existing_output(tmp_path):
    """An output directory left by an earlier, successful run."""
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"earlier weights")
    (out / "loss_log.json").write_text("[]")
    return out


# --------------------------------------------------------------------------- config items, at the point of use

GOOD = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2}}
BAD_CONFIGS = {
    # name: (changes to GOOD, key the message must name, words of the problem, words of the fix)
    "batch-triple": ({"train_batch_size": 6}, "train_batch_size", "world", "fix"),
    "auto": ({"gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps", "auto", "Trainer"),
    "number-as-string": ({"train_micro_batch_size_per_gpu": "2"}, "train_micro_batch_size_per_gpu", "string",
                         "remove the quotes"),
    "fp16-and-bf16": ({"fp16": {"enabled": True}}, "fp16", "bf16", "fix"),
    "typo-key": ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com",
                 "unknown key", "overlap_comm"),
    "offload-param-stage-2": ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                              "offload_param", "stage 3", "fix"),
    "stage-7": ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage", "7", "fix"),
    "fp16-on-cpu": ({"bf16": {"enabled": False}, "fp16": {"enabled": True}}, "fp16", "GPU", "bf16"),
}


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_bad_deepspeed_file_is_refused_before_launch(name, tmp_path, monkeypatch, no_launch, existing_output):
    changes, key, problem, fix = BAD_CONFIGS[name]
    if name == "fp16-on-cpu":
        from dslab.machine import gpu_count

        if gpu_count():
            pytest.skip("fp16 is allowed on a GPU")
        force_fp16_support(monkeypatch, False)   # a CPU without AVX512-FP16 / AMX-FP16, whatever this one has
    monkeypatch.chdir(tmp_path)
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps(build.deep_merge(GOOD, changes)))
    before, ds_before = _snapshot(existing_output), ds_file.read_bytes()
    with pytest.raises(check.ConfigError) as info:
        sft.run(output=str(existing_output), deepspeed=str(ds_file), world_size=2)
    message = str(info.value)
    assert key in message and problem.lower() in message.lower() and fix.lower() in message.lower(), message
    assert "fix:" in message
    assert _snapshot(existing_output) == before and ds_file.read_bytes() == ds_before
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- ZeRO-3 placeholders, adapters

@pytest.fixture(scope="module")
def small_model():
    cfg = loading.tiny_config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
    return loading.build_model(cfg, seed=0)


def test_full_model_save_refuses_size0_weights_and_keeps_the_old_model(small_model, existing_output):
    """What a ZeRO-3 rank holds in p.data before gathering: a 0-element placeholder."""
    param = small_model.model.layers[0].mlp.up_proj.weight
    real = param.data
    before = _snapshot(existing_output)
    try:
        param.data = torch.empty(0)
        with pytest.raises(loading.AdapterError) as info:
            lora.save_full_model(small_model, tokenizer=None, output_dir=existing_output, rank=0)
    finally:
        param.data = real
    message = str(info.value)
    assert "size-0" in message and "up_proj" in message
    # the fix: say why (ZeRO-3 partitions) and what to do (gather, e.g. call it on every rank)
    assert "ZeRO-3" in message and "gather" in message.lower(), message
    assert _snapshot(existing_output) == before
    assert [p.name for p in existing_output.parent.iterdir()] == [existing_output.name]


def _adapter_dir(folder, tensors):
    folder.mkdir()
    (folder / loading.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}))
    save_file(tensors, str(folder / loading.ADAPTER_WEIGHTS))
    return folder


ADAPTER_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BAD_ADAPTERS = {
    "size-0": ({ADAPTER_KEY: torch.empty(0, 32)}, ("size-0", "gather")),
    "no-tensors": ({}, ("no tensors", "saved after training")),
    "full-state-dict": ({"model.embed_tokens.weight": torch.ones(64, 32), "model.norm.weight": torch.ones(32)},
                        ("full model", "--model")),
}


@pytest.mark.parametrize("name", BAD_ADAPTERS)
def test_merge_of_a_bad_adapter_leaves_an_existing_output_alone(name, tmp_path):
    tensors, words = BAD_ADAPTERS[name]
    adapter = _adapter_dir(tmp_path / "bad-adapter", tensors)
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "model.safetensors").write_bytes(b"an earlier merge")
    before, adapter_before = _snapshot(merged), _snapshot(adapter)
    with pytest.raises(loading.AdapterError) as info:
        lora.merge(loading.DEFAULT_MODEL_DIR, adapter, merged, verbose=False)
    assert all(w.lower() in str(info.value).lower() for w in words), str(info.value)
    assert _snapshot(merged) == before and _snapshot(adapter) == adapter_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad-adapter", "merged"]  # no temp dir left


def test_a_model_weights_file_given_as_the_adapter():
    weights = Path(loading.DEFAULT_MODEL_DIR) / "model.safetensors"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    with pytest.raises(loading.AdapterError, match="full model's state dict") as info:
        loading.read_adapter(weights)
    assert "--model" in str(info.value)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before


# --------------------------------------------------------------------------- launcher

def test_taken_preferred_port_is_replaced_by_a_free_one():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        port = launch.free_port(taken)
        assert port != taken and launch.port_is_free(port)


def test_cuda_visible_devices_with_the_launcher_says_use_include(tmp_path, monkeypatch):
    """The check fires only where GPUs exist (on CPU the variable is harmless), so the GPU count is patched."""
    monkeypatch.setattr(launch, "gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    runs = tmp_path / "runs"
    with pytest.raises(launch.LaunchError) as info:
        launch.run("zero_memory", world_size=1, run_dir=runs, stream=False)
    message = str(info.value)
    assert "CUDA_VISIBLE_DEVICES" in message and "include='localhost:0,1'" in message and "--include" in message
    assert not runs.exists()  # refused before the run folder (or any rank) was made
    launch.check_environment(1, include="localhost:1")  # the fix it names is accepted


def test_cuda_visible_devices_is_not_refused_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(launch, "gpu_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    launch.check_environment(2, include=None)  # nothing to choose between: no error


# --------------------------------------------------------------------------- JIT op build tools

def test_prepare_with_no_compiler_on_path(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CXX", raising=False)
    from dslab import env

    cache = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    with pytest.raises(RuntimeError) as info:
        env.prepare()
    message = str(info.value)
    assert "missing" in message and "c++" in message and "apt-get install g++" in message
    assert not cache.exists()  # nothing was built, or half-built


# --------------------------------------------------------------------------- data

@pytest.mark.parametrize("line, words", [
    ('{"query": "hi", "response": "hello"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
], ids=["broken-json", "not-an-object"])
def test_malformed_sft_data_is_refused_before_launch(line, words, tmp_path, monkeypatch, no_launch, existing_output):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "identity.jsonl"
    bad.write_text('{"query": "Who are you?", "response": "I am {name}."}\n\n' + line + "\n", encoding="utf-8")
    before = _snapshot(existing_output)
    with pytest.raises(data.DataError) as info:
        sft.run(output=str(existing_output), data=str(bad), world_size=2)
    assert f"{bad}:3" in str(info.value) and words in str(info.value)
    assert _snapshot(existing_output) == before
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- the catalogue above stays true

def _cited_tests(text=__doc__):
    """(test file, test function) for each test the catalogue cites: `test_x.py::test_a`, `::test_b` (same file as
    the citation before it), and a bare `test_c` (a test in this file)."""
    cited, last = [], None
    for m in re.finditer(r"(?:(test_\w+\.py))?::(test_\w+)|(?<![:\w])(test_\w+\*?)(?![\w.])", text):
        if m.group(2):
            last = m.group(1) or last
            cited.append((last, m.group(2)))
        else:
            cited.append((Path(__file__).name, m.group(3)))
    return cited


def test_every_test_the_catalogue_cites_exists():
    cited = _cited_tests()
    assert len(cited) > 20 and ("test_config_check.py", "test_fp16_on_a_cpu_accelerator_that_says_yes_or_no") in cited
    defined = {}
    for name in {f for f, _ in cited}:
        tree = ast.parse((Path(__file__).parent / name).read_text(encoding="utf-8"))
        defined[name] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = [f"{f}::{t}" for f, t in cited if not fnmatch.filter(defined[f], t)]  # test_x_* names a family
    assert not missing, "the catalogue cites tests that do not exist (renamed?): " + ", ".join(missing)
