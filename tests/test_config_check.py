"""dslab.config.check: check_config names the key, the problem and the fix for each bad input; `dslab config check`."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest

from dslab.config import build as C
from dslab.config import check as CC
from dslab.config import keys
from dslab.cli import main
from support import FP16_REFUSAL, force_fp16_support, valid_config

ROOT = Path(__file__).resolve().parents[1]


# A WORLD_SIZE set by whoever runs the tests would change what the checks expect.
pytestmark = pytest.mark.usefixtures("no_world_size_env")
good = valid_config


def with_value(cfg, key, value):
    """`cfg` with the dotted `key` (zero_optimization.stage) set to `value`."""
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[last] = value
    return cfg


def keys_of(problems):
    return [p.key for p in problems]


def only_problem(problems, key):
    """The problem naming `key`; fails listing everything found otherwise."""
    found = [p for p in problems if p.key == key]
    assert found, f"no problem names {key!r}; got: {[str(p) for p in problems]}"
    return found[0]


# --------------------------------------------------------------------------- the bad-input catalogue

def test_batch_triple_mismatch_names_the_key_and_where_world_size_came_from(monkeypatch):
    cfg = good(train_batch_size=32)  # micro 4 x accum 2 x world 2 = 16
    p = only_problem(CC.check_config(cfg, world_size=2), "train_batch_size")
    assert "32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world_size 2 = 16" in p.problem
    assert "world_size argument" in p.problem and "32 would fit world_size 4" in p.problem
    assert "set train_batch_size to 16" in p.fix
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "WORLD_SIZE environment variable" in only_problem(CC.check_config(cfg), "train_batch_size").problem
    monkeypatch.delenv("WORLD_SIZE")
    p = only_problem(CC.check_config(cfg), "train_batch_size")
    assert "world_size 1" in p.problem and "default" in p.problem
    assert CC.check_config(cfg, world_size=4) == []


def test_batch_partial_triples_follow_deepspeed_rules():
    base = C.make_config(train_batch_size=None)
    assert CC.check_config(base, world_size=8) == []  # DeepSpeed computes train_batch_size
    only_tbs = {k: v for k, v in base.items() if k not in ("train_micro_batch_size_per_gpu",
                                                              "gradient_accumulation_steps")}
    assert CC.check_config({**only_tbs, "train_batch_size": 8}, world_size=2) == []
    assert "train_batch_size" in keys_of(CC.check_config({**only_tbs, "train_batch_size": 9}, world_size=2))
    none = {k: v for k, v in only_tbs.items()}
    assert "train_micro_batch_size_per_gpu" in keys_of(CC.check_config(none))
    bad = good(train_micro_batch_size_per_gpu=0)
    assert "must be at least 1" in only_problem(CC.check_config(bad, world_size=2),
                                                "train_micro_batch_size_per_gpu").problem


def test_auto_outside_the_hf_trainer():
    cfg = good(train_micro_batch_size_per_gpu="auto", optimizer={"params": {"lr": "auto"}})
    problems = CC.check_config(cfg, world_size=2)
    for key in ("train_micro_batch_size_per_gpu", "optimizer.params.lr"):
        p = only_problem(problems, key)
        assert '"auto"' in p.problem and "Trainer" in p.fix and "number" in p.fix
    assert CC.check_config(cfg, world_size=2, allow_auto=True) == []


@pytest.mark.parametrize("key,value,fixed", [
    ("optimizer.params.lr", "3e-4", "3e-4"),
    ("gradient_accumulation_steps", "2", "2"),
    ("zero_optimization.reduce_bucket_size", "5e8", "5e8"),
    ("zero_optimization.overlap_comm", "true", "true"),
])
def test_numbers_and_booleans_written_as_strings(key, value, fixed):
    cfg = with_value(good(), key, value)
    p = only_problem(CC.check_config(cfg, world_size=2), key)
    assert "written as a string" in p.problem and f"remove the quotes: {fixed}" == p.fix


def test_fp16_and_bf16_both_enabled():
    cfg = good(fp16={"enabled": True})
    p = only_problem(CC.check_config(cfg, world_size=2, device="any"), "fp16.enabled")
    assert "bf16.enabled" in p.problem and "both" in p.problem and "keep one" in p.fix


def test_fp16_on_a_cpu_accelerator(monkeypatch):
    force_fp16_support(monkeypatch, False)   # most CPUs (an AVX512-FP16 Xeon says yes: the test below)
    cfg = good(precision="fp16")
    p = only_problem(CC.check_config(cfg, world_size=2, device="cpu"), "fp16.enabled")
    assert FP16_REFUSAL in p.problem and "bf16" in p.fix
    assert CC.check_config(cfg, world_size=2, device="cuda") == []
    assert CC.check_config(cfg, world_size=2, device="any") == []


def test_fp16_on_this_machine_follows_what_the_accelerator_says():
    """No device named: the check asks DeepSpeed's accelerator, as deepspeed.initialize will (fp16 is allowed on an
    AVX512-FP16 / AMX-FP16 Xeon's CPU accelerator, refused on most CPUs): the same verdict here as DeepSpeed's."""
    from deepspeed.accelerator import get_accelerator

    refused = "fp16.enabled" in keys_of(CC.check_config(good(precision="fp16"), world_size=2))
    assert refused == (not get_accelerator().is_fp16_supported())


@pytest.mark.parametrize("supported", [True, False])
def test_fp16_on_a_cpu_accelerator_that_says_yes_or_no(supported, monkeypatch):
    from dslab.machine import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    force_fp16_support(monkeypatch, supported)
    problems = CC.check_config(good(precision="fp16"), world_size=2)
    if supported:
        assert problems == []
    else:
        p = only_problem(problems, "fp16.enabled")
        assert "AVX512-FP16" in p.problem and FP16_REFUSAL in p.problem and "bf16" in p.fix


def test_bf16_on_a_gpu_without_bf16(monkeypatch):
    monkeypatch.setattr(CC, "device_support",
                        lambda device: ("cuda", True, False, "Tesla V100-SXM2-16GB, compute capability 7.0"))
    p = only_problem(CC.check_config(good(), world_size=2), "bf16.enabled")
    assert "V100" in p.problem and "fp16" in p.fix
    assert CC.check_config(good(precision="fp16"), world_size=2) == []


@pytest.mark.parametrize("path,typo,meant", [
    ("", "zero_optimisation", "zero_optimization"),
    ("", "gradient_clippng", "gradient_clipping"),
    ("", "train_micro_batch_size_per_gp", "train_micro_batch_size_per_gpu"),
    ("zero_optimization", "stage3_prefetch_bucket_sise", "stage3_prefetch_bucket_size"),
    ("zero_optimization", "overlap_com", "overlap_comm"),
    ("zero_optimization.offload_optimizer", "pin_memroy", "pin_memory"),
    ("fp16", "loss_scale_windw", "loss_scale_window"),
    ("bf16", "enable", "enabled"),
    ("optimizer", "parms", "params"),
    ("scheduler", "tipe", "type"),
    ("activation_checkpointing", "partition_activation", "partition_activations"),
    ("optimizer.params", "weight_decy", "weight_decay"),
    ("scheduler.params", "warmup_num_step", "warmup_num_steps"),
])
def test_misspelled_keys_at_every_level_get_a_suggestion(path, typo, meant):
    cfg = C.make_config(zero_stage=2, offload_optimizer=True, world_size=1,
                        scheduler={"type": "WarmupLR", "params": {}}, activation_checkpointing={})
    node = cfg
    for part in [p for p in path.split(".") if p]:
        node = node[part]
    node[typo] = node.pop(meant) if meant in node else 1
    key = f"{path}.{typo}" if path else typo
    p = only_problem(CC.check_config(cfg, world_size=1, device="any"), key)
    assert "unknown" in p.problem
    assert p.fix == f"did you mean {(path + '.' + meant) if path else meant!r}?"


@pytest.mark.parametrize("path,typo", [("", "zero_optimisation"), ("zero_optimization", "overlap_com"),
                                       ("zero_optimization.offload_optimizer", "pin_memroy"), ("bf16", "enable")])
def test_an_unknown_key_is_said_to_be_ignored_or_refused_as_deepspeed_itself_does(path, typo):
    """DeepSpeed skips a top-level key it does not read, but its pydantic sections forbid extra keys: there the
    typo fails deepspeed.initialize on every rank. The message says which, checked against DeepSpeedConfig."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    key = f"{path}.{typo}" if path else typo
    cfg = with_value(C.make_config(zero_stage=2, offload_optimizer=True, world_size=1), key, 1)
    p = only_problem(CC.check_config(cfg, world_size=1, device="any"), key)
    try:
        DeepSpeedConfig(copy.deepcopy(cfg))
        refused = False
    except ValidationError as err:
        assert typo in str(err) and "Extra inputs are not permitted" in str(err)
        refused = True
    assert refused == (path != "")
    assert ("DeepSpeed refuses it" in p.problem) == refused and ("silently ignores" in p.problem) == (not refused)


def test_unknown_key_without_a_close_match_lists_the_known_ones():
    p = only_problem(CC.check_config(good(zero_optimization={"xyz": 1}), world_size=2), "zero_optimization.xyz")
    assert "stage" in p.fix and "offload_optimizer" in p.fix


@pytest.mark.parametrize("stage", [2, 1, 0])
def test_offload_param_needs_stage_3(stage):
    cfg = good(zero_optimization={"stage": stage, "offload_param": {"device": "cpu"}})
    p = only_problem(CC.check_config(cfg, world_size=2), "zero_optimization.offload_param")
    assert f"stage is {stage}" in p.problem and "stage to 3" in p.fix
    off = good(zero_optimization={"stage": stage, "offload_param": {"device": "none"}})
    assert CC.check_config(off, world_size=2) == []  # "none" means no offload


def test_offload_optimizer_needs_a_zero_stage():
    cfg = good(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}})
    assert "stage to 1, 2 or 3" in only_problem(CC.check_config(cfg, world_size=2),
                                                "zero_optimization.offload_optimizer").fix


@pytest.mark.parametrize("stage", [4, -1, True, 2.5])
def test_stage_must_be_0_to_3(stage):
    p = only_problem(CC.check_config(good(zero_optimization={"stage": stage}), world_size=2),
                     "zero_optimization.stage")
    assert "0, 1, 2 or 3" in p.problem


def test_offload_devices():
    cfg = good(zero_optimization={"offload_optimizer": {"device": "gpu"}})
    p = only_problem(CC.check_config(cfg, world_size=2), "zero_optimization.offload_optimizer.device")
    assert '"cpu"' in p.fix and '"nvme"' in p.fix
    nvme = good(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}})
    p = only_problem(CC.check_config(nvme, world_size=2), "zero_optimization.offload_param.nvme_path")
    assert "nvme_path" in p.fix
    nvme["zero_optimization"]["offload_param"]["nvme_path"] = "/local_nvme"
    assert CC.check_config(nvme, world_size=2) == []


@pytest.mark.parametrize("key,value,words", [
    ("wall_clock_breakdown", 1, "true or false"),
    ("bf16.enabled", "yes", "true or false"),
    ("zero_optimization.contiguous_gradients", 0, "true or false"),
    ("zero_optimization.reduce_bucket_size", 0.5, "whole number"),
    ("steps_per_print", 0, "at least 1"),
    ("gradient_clipping", [1], "a number"),
    ("zero_optimization.reduce_bucket_size", 0, "greater than 0"),  # DeepSpeed's own pydantic rule
    ("zero_optimization", [2], "JSON object"),
])
def test_value_types(key, value, words):
    cfg = with_value(good(), key, value)
    p = only_problem(CC.check_config(cfg, world_size=2), key)
    assert words in p.problem


def test_integral_floats_are_whole_numbers():
    # "reduce_bucket_size": 5e8 is common in DeepSpeed configs; JSON reads it as a float and DeepSpeed accepts it
    assert CC.check_config(good(zero_optimization={"reduce_bucket_size": 5e8}), world_size=2) == []


def test_removed_and_deprecated_options():
    p = only_problem(CC.check_config(good(amp={"enabled": True}), world_size=2), "amp")
    assert "removed" in p.problem and "delete" in p.fix
    p = only_problem(CC.check_config(good(zero_optimization={"cpu_offload": True}), world_size=2),
                     "zero_optimization.cpu_offload")
    assert "deprecated" in p.problem and "offload_optimizer" in p.fix
    old_form = good()
    old_form["zero_optimization"] = True
    p = only_problem(CC.check_config(old_form, world_size=2), "zero_optimization")
    assert '{"stage": 1}' in p.fix


def test_optimizer_and_scheduler_types():
    p = only_problem(CC.check_config(good(optimizer={"type": "AdamWW"}), world_size=2), "optimizer.type")
    assert p.fix == "did you mean 'AdamW'?"
    sgd = good()
    sgd["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    assert CC.check_config(sgd, world_size=2) == []
    sgd["optimizer"]["params"]["betas"] = [0.9, 0.99]  # an Adam parameter: torch.optim.SGD would refuse it
    assert "momentum" in only_problem(CC.check_config(sgd, world_size=2), "optimizer.params.betas").fix
    p = only_problem(CC.check_config(good(optimizer={"params": {"max_grad_norm": 1.0}}), world_size=2),
                     "optimizer.params.max_grad_norm")
    assert "gradient_clipping" in p.fix
    p = only_problem(CC.check_config(good(scheduler={"type": "WarmupLr"}), world_size=2), "scheduler.type")
    assert p.fix == "did you mean 'WarmupLR'?"
    ok = good(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 10}})
    assert CC.check_config(ok, world_size=2) == []


def test_optimizer_params_are_checked_only_where_their_keys_are_known():
    """DeepSpeed's mu*/muon optimizers take parameters from optional packages: none of them is reported."""
    muon = good()
    muon["optimizer"] = {"type": "Muon", "params": {"lr": 1e-3, "momentum": 0.95}}
    assert CC.check_config(muon, world_size=2, device="any") == []
    assert keys.optimizer_param_keys("Muon") == set()
    assert {"lr", "betas", "weight_decay", "torch_adam"} <= keys.optimizer_param_keys("AdamW")
    assert {"lr", "momentum"} <= keys.optimizer_param_keys("SGD")  # a torch.optim class


def test_not_a_dict():
    assert "dict" in CC.check_config([1, 2])[0].problem


def test_validate_lists_every_problem_at_once():
    bad = good(train_batch_size=32, fp16={"enabled": True}, zero_optimization={"stage": 4})
    bad["zero_optimisation"] = {}
    with pytest.raises(CC.ConfigError) as info:
        CC.validate(bad, world_size=2, device="any")
    err = info.value
    assert {"train_batch_size", "fp16.enabled", "zero_optimization.stage", "zero_optimisation"} <= set(
        keys_of(err.problems))
    assert str(err).startswith(f"{len(err.problems)} problems")
    for p in err.problems:
        assert p.key in str(err) and p.fix in str(err)
    assert CC.validate(good(), world_size=2) == good()


def test_check_config_does_not_modify_its_input():
    cfg = good(train_batch_size="32", zero_optimization={"offload_param": {"device": "cpu"}})
    before = copy.deepcopy(cfg)
    CC.check_config(cfg, world_size=2)
    assert cfg == before


# --------------------------------------------------------------------------- the schema comes from DeepSpeed

def test_known_keys_are_read_from_deepspeed():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    top = set(keys.known_keys())
    assert {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "gradient_clipping",
            "steps_per_print", "wall_clock_breakdown", "activation_checkpointing", "flops_profiler",
            "tensorboard", "checkpoint", "data_types", "communication_data_type"} <= top
    assert "zero_optimisation" not in top and "amp" not in top
    zero = set(keys.known_keys("zero_optimization"))
    # every pydantic field, under its name and its JSON alias
    assert set(DeepSpeedZeroConfig.model_fields) <= zero
    assert {"stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold"} <= zero
    assert {"device", "nvme_path", "pin_memory", "buffer_count"} <= set(
        keys.known_keys("zero_optimization.offload_param"))
    assert {"partition_activations", "cpu_checkpointing"} <= set(keys.known_keys("activation_checkpointing"))
    assert {"enabled", "loss_scale", "initial_scale_power"} <= set(keys.known_keys("fp16"))


# --------------------------------------------------------------------------- command line

ACCEPTANCE = {
    "batch triple": (good(train_batch_size=32), "train_batch_size"),
    "fp16 on CPU": (good(precision="fp16"), "fp16.enabled"),
    "misspelled section": ({**good(zero_optimization=None), "zero_optimisation": {"stage": 2}},
                           "zero_optimisation"),
    "offload_param on stage 2": (good(zero_optimization={"offload_param": {"device": "cpu"}}),
                                 "zero_optimization.offload_param"),
    "stage 4": (good(zero_optimization={"stage": 4}), "zero_optimization.stage"),
    "fp16 and bf16": (good(fp16={"enabled": True}), "fp16.enabled"),
    "number as string": (good(optimizer={"params": {"lr": "3e-4"}}), "optimizer.params.lr"),
    "auto": (good(gradient_accumulation_steps="auto"), "gradient_accumulation_steps"),
}


@pytest.mark.parametrize("case", sorted(ACCEPTANCE))
def test_cli_check_rejects(case, tmp_path, capsys, monkeypatch):
    force_fp16_support(monkeypatch, False)   # "fp16 on CPU": a CPU whose accelerator refuses fp16, like most
    cfg, key = ACCEPTANCE[case]
    path = C.save_config(cfg, tmp_path / "c.json")
    assert main(["config", "check", str(path), "--world-size", "2", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert f"  {key}: " in out and "fix:" in out


def test_cli_check_accepts_zero3_offload(tmp_path, capsys):
    path = C.save_config(C.make_config(zero_stage=3, offload_optimizer=True, offload_param=True,
                                       micro_batch_size=4, grad_accum_steps=2, world_size=2), tmp_path / "z3.json")
    assert main(["config", "check", str(path), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "ZeRO stage 3, bf16, offload optimizer -> cpu, offload param -> cpu" in out
    assert "train_batch_size 16 = micro 4 x accum 2 x world 2" in out
    assert main(["config", "check", "zero3_offload"]) == 0  # a ready-made config by name


def test_cli_check_bad_json_and_missing_file(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text('{"train_batch_size": 8,}')
    assert main(["config", "check", str(path)]) == 1
    assert "line 1, column" in capsys.readouterr().out
    assert main(["config", "check", str(tmp_path / "nope.json")]) == 1
    assert "no such file" in capsys.readouterr().out


def test_cli_as_a_module_in_a_fresh_process(tmp_path):
    """`python -m dslab.cli config check` exits 1 naming the key; only the report on stdout."""
    bad = C.save_config(good(train_batch_size=32), tmp_path / "bad.json")
    run = subprocess.run([sys.executable, "-m", "dslab.cli", "config", "check", str(bad), "--world-size", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 1, run.stderr
    assert run.stdout.startswith(f"{bad}: 1 problem\n  train_batch_size: ")
    assert "[WARNING]" not in run.stdout  # DeepSpeed's logs go to stderr

