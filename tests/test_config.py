"""dslab.config.build: make_config builds configs DeepSpeed accepts and trains with; reading, writing, the bundled files."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dslab.config import build as C
from dslab.config import check as CC
from dslab.cli import main
from support import valid_config

ROOT = Path(__file__).resolve().parents[1]


# A WORLD_SIZE set by whoever runs the tests would change what the checks expect.
pytestmark = pytest.mark.usefixtures("no_world_size_env")
good = valid_config


# --------------------------------------------------------------------------- make_config

def test_make_config_spells_deepspeed_keys_and_the_batch_triple():
    cfg = C.make_config(zero_stage=2, micro_batch_size=4, grad_accum_steps=2, world_size=2, lr=3e-4)
    assert cfg["train_batch_size"] == 16
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["lr"] == 3e-4
    assert cfg["wall_clock_breakdown"] is False and cfg["steps_per_print"] >= 10**5
    # buckets sized for small models, not DeepSpeed's 5e8-element defaults (about 1 GB of buffers)
    assert cfg["zero_optimization"]["reduce_bucket_size"] < 10**8


def test_make_config_zero3_offload_and_buckets():
    cfg = C.make_config(zero_stage=3, offload_optimizer=True, offload_param=True, world_size=1)
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["stage3_prefetch_bucket_size"] == C.BUCKET_SIZE < 10**8
    assert zero["stage3_param_persistence_threshold"] == 0
    # with offload DeepSpeed must use DeepSpeedCPUAdam, so the torch AdamW switch is off
    assert "torch_adam" not in cfg["optimizer"]["params"]
    assert C.make_config(zero_stage=2)["optimizer"]["params"]["torch_adam"] is True


def test_make_config_precisions():
    assert C.make_config(precision="fp32")["bf16"]["enabled"] is False
    fp16 = C.make_config(precision="fp16")
    assert fp16["fp16"]["enabled"] is True and fp16["fp16"]["loss_scale"] == 0
    assert fp16["bf16"]["enabled"] is False
    with pytest.raises(ValueError, match="did you mean 'bf16'"):
        C.make_config(precision="bf61")


def test_make_config_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert C.make_config(micro_batch_size=2)["train_batch_size"] == 6
    assert C.make_config(micro_batch_size=2, world_size=1)["train_batch_size"] == 2


def test_make_config_extra_deep_merges_and_none_deletes():
    cfg = C.make_config(zero_stage=3, zero_optimization={"stage3_param_persistence_threshold": 100},
                        optimizer={"params": {"weight_decay": 0.1}}, train_batch_size=None,
                        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 100
    assert cfg["zero_optimization"]["stage"] == 3  # kept
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.1 and cfg["optimizer"]["params"]["lr"] == 1e-3
    assert "train_batch_size" not in cfg
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 10


def test_make_config_refuses_what_check_config_refuses():
    with pytest.raises(CC.ConfigError, match="zero_optimization.offload_param"):
        C.make_config(zero_stage=2, offload_param=True)
    with pytest.raises(CC.ConfigError, match="zero_optimization.stage"):
        C.make_config(zero_stage=4)
    with pytest.raises(CC.ConfigError, match="did you mean 'zero_optimization.reduce_bucket_size'"):
        C.make_config(zero_stage=2, zero_optimization={"reduce_bucket_sise": 10})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp16"])
def test_every_make_config_output_passes_check(stage, precision):
    for offload_optimizer in ([False, True] if stage else [False]):
        for offload_param in ([False, True] if stage == 3 else [False]):
            cfg = C.make_config(zero_stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
                                precision=precision, micro_batch_size=2, grad_accum_steps=3, world_size=2)
            assert cfg["train_batch_size"] == 12
            device = "cuda" if precision == "fp16" else "cpu"  # fp16 configs are for GPUs
            assert CC.check_config(cfg, world_size=2, device=device) == []


# --------------------------------------------------------------------------- files

def test_load_config_reports_malformed_json_with_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,},\n}\n')
    with pytest.raises(CC.ConfigError) as info:
        C.load_config(path)
    msg = str(info.value)
    assert str(path) in msg and "line 3, column" in msg and "trailing commas" in msg
    path.write_text('{"fp16": {}, "fp16": {}}')
    with pytest.raises(CC.ConfigError, match="'fp16' appears twice"):
        C.load_config(path)
    path.write_text("[1]")
    with pytest.raises(CC.ConfigError, match="JSON object"):
        C.load_config(path)


def test_save_config_is_sorted_atomic_and_round_trips(tmp_path):
    cfg = good()
    path = C.save_config(cfg, tmp_path / "sub" / "c.json")
    text = path.read_text()
    assert json.loads(text) == cfg and text == json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    assert [p.name for p in path.parent.iterdir()] == ["c.json"]  # no temporary file left
    assert C.load_config(path) == cfg


@pytest.mark.parametrize("name", sorted(C.BUNDLED))
def test_bundled_files_equal_make_config_and_pass(name):
    path = C.config_path(name)
    assert C.load_config(path) == C.bundled_config(name), (
        f"{path} is stale: regenerate with python -c 'from dslab.config.build import write_bundled; write_bundled()'")
    for world_size in (1, 2, 8):
        assert CC.check_config(C.load_config(path), world_size=world_size) == []
    assert C.config_path(f"{name}.json") == path


def test_config_path_suggests():
    with pytest.raises(FileNotFoundError, match="did you mean 'zero3_offload'"):
        C.config_path("zero3_ofload")


# --------------------------------------------------------------------------- command line

def test_cli_new_prints_and_writes(tmp_path, capsys):
    argv = ["config", "new", "--zero", "3", "--offload-optimizer", "--offload-param", "--precision", "bf16",
            "--micro-batch-size", "2", "--grad-accum-steps", "4", "--world-size", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    expected = C.make_config(zero_stage=3, offload_optimizer=True, offload_param=True, micro_batch_size=2,
                             grad_accum_steps=4, world_size=2)
    assert json.loads(printed) == expected and printed == C.to_json(expected)
    out = tmp_path / "z.json"
    assert main(argv + ["-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert C.load_config(out) == expected
    assert main(["config", "new", "--zero", "2"]) == 0
    assert "train_batch_size" not in json.loads(capsys.readouterr().out)  # left to DeepSpeed
    assert main(["config", "new", "--zero", "2", "--offload-param"]) == 1
    assert "zero_optimization.offload_param" in capsys.readouterr().out


# --------------------------------------------------------------------------- the configs really train

TRAIN_SCRIPT = textwrap.dedent("""
    import json, os, socket, sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_SIZE="1")
    import torch, deepspeed
    from dslab.config.build import make_config
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, kwargs in json.loads(sys.argv[1]).items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        cfg = make_config(micro_batch_size=4, grad_accum_steps=2, world_size=1, lr=1e-2, **kwargs)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        dtype = torch.bfloat16 if cfg["bf16"]["enabled"] else torch.float32
        x = torch.randn(4, 16)
        y = x.sum(1, keepdim=True)
        losses = []
        for _ in range(6):  # 3 optimizer steps of 2 micro-batches
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[name] = {"stage": engine.zero_optimization_stage(), "steps": engine.global_steps,
                         "optimizer": type(engine.basic_optimizer).__name__, "losses": losses}
        engine.destroy()
    print("RESULT " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train every setup in one fresh process (DeepSpeed is imported once)."""
    from dslab.env import op_status

    setups = {f"zero{s}": {"zero_stage": s} for s in range(4)}
    setups["zero2_fp32"] = {"zero_stage": 2, "precision": "fp32"}
    if op_status()["cpu_adam"]["built"]:  # otherwise the first use would build it: minutes
        setups.update(zero2_offload=C.BUNDLED["zero2_offload"], zero3_offload=C.BUNDLED["zero3_offload"])
    script = tmp_path_factory.mktemp("train") / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, str(script), json.dumps(setups)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def assert_trained(result, stage, optimizer):
    assert result["stage"] == stage and result["optimizer"] == optimizer
    assert result["steps"] == 3  # gradient_accumulation_steps=2: one optimizer step per 2 micro-batches
    losses = result["losses"]
    assert all(x == x for x in losses) and losses[-1] < losses[0]


def test_each_stage_trains_with_deepspeed_initialize(trained):
    for s in range(4):
        assert_trained(trained[f"zero{s}"], s, "AdamW")
    assert_trained(trained["zero2_fp32"], 2, "AdamW")


def test_offload_configs_train_with_cpu_adam(trained):
    if "zero2_offload" not in trained:
        pytest.skip("cpu_adam is not built yet (building takes minutes): run `dslab prepare`")
    assert_trained(trained["zero2_offload"], 2, "DeepSpeedCPUAdam")
    assert_trained(trained["zero3_offload"], 3, "DeepSpeedCPUAdam")
    # the offloaded optimizer (DeepSpeedCPUAdam) takes the same steps as torch's AdamW
    assert trained["zero2_offload"]["losses"] == pytest.approx(trained["zero2"]["losses"], rel=1e-3)
