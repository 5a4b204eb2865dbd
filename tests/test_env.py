"""dslab.env: the environment report, `dslab env [--json]` and `dslab prepare` (dslab.cli.preflight)."""
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from dslab import compat, env, machine
from dslab.cli import main
from support import FP16_REFUSAL, force_fp16_support

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ["bf16 training", "fp16 DeepSpeed optimizer", "ZeRO-Offload (cpu_adam)", "AutoTP inference",
            "kernel injection", "nccl"]


@pytest.fixture(scope="module")
def rep():
    return env.machine_facts()


def test_report_has_every_section(rep):
    assert set(rep) == {"versions", "platform", "accelerator", "build_tools", "cpu", "memory", "gpus", "topology",
                        "torch_extensions_dir", "ops", "async_io", "features"}
    assert set(rep["versions"]) == {"python", "torch", "deepspeed", "transformers", "peft", "accelerate"}
    assert rep["versions"]["deepspeed"] == metadata.version("deepspeed")
    assert rep["versions"]["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert set(rep["accelerator"]) == {"name", "communication_backend", "bf16_supported", "bf16_native",
                                       "fp16_supported"}
    assert set(rep["build_tools"]) == {"ninja", "c++", "g++", "numactl"}
    assert set(rep["ops"]) == {"shm_comm", "cpu_adam", "fused_adam"}
    assert set(rep["async_io"]) == {"op", "compatible", "purpose"} and isinstance(rep["async_io"]["compatible"], bool)
    assert [f["name"] for f in rep["features"]] == FEATURES
    for feature in rep["features"]:
        assert isinstance(feature["available"], bool) and feature["reason"]


def test_report_matches_deepspeeds_view(rep):
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    assert rep["accelerator"]["name"] == accel.device_name()
    assert rep["accelerator"]["communication_backend"] == accel.communication_backend_name()
    assert rep["accelerator"]["fp16_supported"] == bool(accel.is_fp16_supported())
    feature = {f["name"]: f["available"] for f in rep["features"]}
    assert feature["nccl"] == (accel.communication_backend_name() == "nccl")
    assert feature["fp16 DeepSpeed optimizer"] == bool(accel.is_fp16_supported())


def test_cpu_only_machine(rep):
    if machine.gpu_count():
        pytest.skip("this machine has a GPU")
    assert rep["accelerator"]["name"] == "cpu" and rep["accelerator"]["communication_backend"] == "gloo"
    assert rep["gpus"] == [] and rep["topology"] is None
    feature = {f["name"]: f for f in rep["features"]}
    assert not feature["kernel injection"]["available"] and "GPU" in feature["kernel injection"]["reason"]
    assert not feature["nccl"]["available"]
    fp16 = feature["fp16 DeepSpeed optimizer"]   # what DeepSpeed's CPU accelerator answers here, not assumed
    assert fp16["available"] == rep["accelerator"]["fp16_supported"]
    assert (FP16_REFUSAL in fp16["reason"]) == (not fp16["available"])


@pytest.mark.parametrize("supported", [True, False])
def test_fp16_feature_follows_the_cpu_accelerators_answer(supported, monkeypatch):
    """Both answers, whatever this CPU is: AVX512-FP16 / AMX-FP16 Xeons say yes, most other CPUs no."""
    from deepspeed.accelerator import get_accelerator

    if machine.gpu_count():
        pytest.skip("this machine has a GPU")
    force_fp16_support(monkeypatch, supported)
    accel = env.accelerator_info()
    assert accel["fp16_supported"] is supported and accel["name"] == get_accelerator().device_name() == "cpu"
    cpu = {"flags": {f: False for f in machine.BF16_CPU_FLAGS + machine.FP16_CPU_FLAGS}}
    ops = {"cpu_adam": {"compatible": True, "built": True}, "shm_comm": {"compatible": True, "built": True}}
    tools = {"ninja": "/usr/bin/ninja", "c++": "/usr/bin/c++", "g++": None, "numactl": None}
    fp16 = {f["name"]: f for f in env.features(accel, cpu, ops, tools)}["fp16 DeepSpeed optimizer"]
    assert fp16["available"] is supported
    assert ("AVX512-FP16" in fp16["reason"]) and (("refuses" in fp16["reason"]) is not supported)


def test_cpu_and_memory(rep):
    cpu = rep["cpu"]
    assert cpu["cores_usable"] == machine.usable_cores() <= cpu["cores_affinity"] <= cpu["cores_total"]
    assert set(rep["cpu"]["flags"]) == set(machine.BF16_CPU_FLAGS + machine.FP16_CPU_FLAGS)
    assert all(isinstance(v, bool) for v in rep["cpu"]["flags"].values())
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    assert rep["cpu"]["flags"]["avx512_bf16"] == ("avx512_bf16" in flags)
    assert 0 < rep["memory"]["available_gib"] <= rep["memory"]["total_gib"]


def test_gpu_count_agrees_with_the_report(rep):
    assert (machine.gpu_count() > 0) == (len(rep["gpus"]) > 0)  # what chapter 00 asserts on every machine


def test_gpu_count_is_0_when_the_gpus_are_hidden_and_imports_no_deepspeed():
    """GPUs hidden with CUDA_VISIBLE_DEVICES="" are none for torch: gpu_count says so, without importing DeepSpeed."""
    code = "import sys; from dslab import machine; print(machine.gpu_count(), 'deepspeed' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "False"]


def test_features_on_a_gpu_machine():
    """The feature list follows the accelerator: kernel injection and nccl on CUDA, fp16 when supported."""
    accel = {"name": "cuda", "communication_backend": "nccl", "bf16_supported": False, "fp16_supported": True}
    cpu = {"flags": {f: False for f in machine.BF16_CPU_FLAGS}}
    ops = {"cpu_adam": {"compatible": True, "built": False}, "shm_comm": {"compatible": False, "built": False}}
    tools = {"ninja": "/usr/bin/ninja", "c++": "/usr/bin/c++", "g++": None, "numactl": None}
    feature = {f["name"]: f for f in env.features(accel, cpu, ops, tools)}
    assert feature["kernel injection"]["available"] and feature["nccl"]["available"]
    assert feature["fp16 DeepSpeed optimizer"]["available"]
    assert not feature["bf16 training"]["available"] and "fp16" in feature["bf16 training"]["reason"]
    assert feature["ZeRO-Offload (cpu_adam)"]["available"]
    assert "dslab prepare" in feature["ZeRO-Offload (cpu_adam)"]["reason"]
    tools["ninja"] = None
    feature = {f["name"]: f for f in env.features(accel, cpu, ops, tools)}
    assert not feature["ZeRO-Offload (cpu_adam)"]["available"]
    assert "missing ninja" in feature["ZeRO-Offload (cpu_adam)"]["reason"]


def test_op_cache_location_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert machine.extensions_dir() == tmp_path
    status = env.op_status()
    assert not status["shm_comm"]["built"] and not status["cpu_adam"]["built"]  # nothing built there
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    status = env.op_status()
    assert status["cpu_adam"]["built"] and status["cpu_adam"]["path"] == str(tmp_path / "cpu_adam" / "cpu_adam.so")
    assert list(tmp_path.iterdir()) == [tmp_path / "cpu_adam"]  # the report created nothing


def test_extensions_dir_is_the_one_torch_uses(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch creates the folder it returns: keep it here
    assert machine.extensions_dir() / "some_op" == Path(compat.torch_extension_dir("some_op"))
    assert str(machine.extensions_dir()).startswith(str(tmp_path))


def test_ninja_from_the_venv_is_put_on_path(monkeypatch, tmp_path):
    """DeepSpeed wants `ninja` on PATH even to load a cached op; pip's ninja is found when PATH lacks it."""
    try:
        import ninja  # noqa: F401
    except ImportError:
        pytest.skip("the ninja Python package is not installed")
    monkeypatch.setenv("PATH", str(tmp_path))
    found = machine.ensure_build_tools_on_path()
    assert found and Path(found).name == "ninja"
    assert os.environ["PATH"].split(os.pathsep)[0] == str(Path(found).parent)


def test_the_ninja_installed_with_dslab_comes_before_another_on_path(monkeypatch, tmp_path):
    """A system ninja first on PATH would alternate with pip's between processes and rebuild every JIT op."""
    try:
        import ninja  # noqa: F401
    except ImportError:
        pytest.skip("the ninja Python package is not installed")
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.11.1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path), "/usr/bin"]))
    found = machine.ensure_build_tools_on_path()
    assert found != str(other) and shutil.which("ninja") == found
    assert os.environ["PATH"].split(os.pathsep)[1:] == [str(tmp_path), "/usr/bin"]


def test_format_report_has_every_section(rep):
    text = env.format_report(rep)
    for heading in ("versions", "accelerator", "cpu", "gpus", "build tools", "JIT ops", "what runs here"):
        assert f"\n{heading}\n" in f"\n{text}\n"
    for name in FEATURES:
        assert name in text


def test_async_io_is_probed_without_compiler_output():
    """The libaio link test runs with file descriptors 1 and 2 silenced: no "cannot find -laio" on screen."""
    code = ("from dslab import env, this_rank; this_rank.quiet(); import deepspeed; "
            "a = env.aio_status(); print('compatible' if a['compatible'] else 'absent')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() in ("compatible", "absent")
    assert "cannot find" not in run.stdout + run.stderr and "collect2" not in run.stdout + run.stderr
    line = next(line for line in env.format_report(env.machine_facts()).splitlines() if line.strip().startswith("async_io"))
    assert ("needs libaio" in line) == (run.stdout.strip() == "absent")


def test_cli_env_json_parses_and_text_prints():
    run = subprocess.run([sys.executable, "-m", "dslab.cli", "env", "--json"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)  # DeepSpeed's own log lines must not leak into stdout
    assert [f["name"] for f in data["features"]] == FEATURES


def test_cli_env_text(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "what runs here" in out and "communication backend" in out


def test_prepare_names_missing_tools_and_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(machine, "build_tools",
                        lambda: {"ninja": None, "c++": None, "g++": None, "numactl": "/usr/bin/numactl"})
    with pytest.raises(RuntimeError) as info:
        env.prepare()
    msg = str(info.value)
    assert "missing ninja, c++" in msg and "pip install ninja" in msg and "apt-get install g++" in msg
    assert main(["prepare"]) == 1
    assert "missing ninja, c++" in capsys.readouterr().out


def test_prepare_is_fast_when_cached():
    status = env.op_status()
    if not all(op["built"] for op in status.values() if op["compatible"]):
        pytest.skip("the course's ops are not built yet: run `dslab prepare` (takes minutes)")
    run = subprocess.run([sys.executable, "-m", "dslab.cli", "prepare"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for name, op in status.items():
        if op["compatible"]:
            assert f"{name}: loading cached build" in run.stdout and f"{name}: ready in" in run.stdout
    assert "building" not in run.stdout


def test_prepare_reports_a_failed_build_and_tries_the_rest(monkeypatch):
    """A compiler error names the op and points at --verbose; the other ops are still built."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    real = accel.create_op_builder
    if not all(op["compatible"] for op in env.op_status().values()):
        pytest.skip("every course op must be compatible here")

    class Broken:
        name = "cpu_adam"

        def is_compatible(self, verbose=False):
            return True

        def load(self, verbose=False):
            raise RuntimeError("Error building extension 'cpu_adam'")

    monkeypatch.setattr(accel, "create_op_builder",
                        lambda name: Broken() if name == "CPUAdamBuilder" else real(name))
    lines = []

    class Stream:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    with pytest.raises(RuntimeError) as info:
        env.prepare(stream=Stream())
    assert "cpu_adam: RuntimeError: Error building extension 'cpu_adam'" in str(info.value)
    assert "--verbose" in str(info.value)
    out = "".join(lines)
    assert "shm_comm: ready in" in out and "cpu_adam: build FAILED" in out


def test_importing_dslab_leaves_path_alone():
    """PATH changes where processes start (dslab.launch, dslab.live, dslab.this_rank.init), never at import."""
    code = "import os, sys; before = os.environ['PATH']; import dslab, dslab.env, dslab.live, dslab.this_rank; " \
           "sys.exit(os.environ['PATH'] != before)"
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PATH="/usr/bin:/bin")).returncode == 0


def test_bf16_is_native_only_where_the_cpu_has_bf16_instructions_and_onednn_may_use_them(monkeypatch):
    """The flags say what the CPU has; ONEDNN_MAX_CPU_ISA says what oneDNN may use: below AVX512_CORE_BF16 a bf16
    matmul runs without bf16 instructions (the portable test run caps it so), and the report says why."""
    epyc, amx, avx2 = {"avx512_bf16": True}, {"avx512_bf16": True, "amx_bf16": True}, {"avx512_bf16": False}
    assert machine.bf16_native(epyc, None) and machine.bf16_native(amx, "AVX512_CORE_BF16")
    assert machine.bf16_native(amx, None)
    assert not machine.bf16_native(epyc, "AVX512_CORE") and not machine.bf16_native(amx, "AVX2")
    assert not machine.bf16_native(avx2, None)
    for cap, expected in (("avx512_core", "AVX512_CORE"), ("all", None), ("", None)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert machine.onednn_cap() == expected
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu = machine.cpu_info()
    assert cpu["onednn_cap"] == "AVX2" and cpu["bf16_native"] is False
    assert env.accelerator_info()["bf16_native"] is False
    accel = {"name": "cpu", "communication_backend": "gloo", "bf16_supported": True, "fp16_supported": False}
    ops = {"cpu_adam": {"compatible": True, "built": True}, "shm_comm": {"compatible": True, "built": True}}
    tools = {"ninja": "/usr/bin/ninja", "c++": "/usr/bin/c++", "g++": None, "numactl": None}
    capped = {**cpu, "flags": {**cpu["flags"], "avx512_bf16": True}}
    reason = {f["name"]: f for f in env.features(accel, capped, ops, tools)}["bf16 training"]["reason"]
    assert "capped at AVX2 (ONEDNN_MAX_CPU_ISA)" in reason and "natively" not in reason
    native = {**capped, "bf16_native": True}
    assert "natively" in {f["name"]: f for f in env.features(accel, native, ops, tools)}["bf16 training"]["reason"]
