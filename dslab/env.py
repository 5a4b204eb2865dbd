"""What this machine offers DeepSpeed: the accelerator it picks, its JIT ops, which course features run, and all of it
with the machine's facts (dslab.machine) as `dslab env`'s report; `dslab prepare` builds the ops."""
import platform
import sys
import time
import unicodedata

from dslab import machine
from dslab.messages import say

# JIT ops the course uses: (name in reports, DeepSpeed op-builder class, what needs it).
COURSE_OPS = (
    ("shm_comm", "ShareMemCommBuilder", "the CPU accelerator's shared-memory all-reduce (init_distributed, AutoTP)"),
    ("cpu_adam", "CPUAdamBuilder", "ZeRO-Offload: DeepSpeedCPUAdam updates the offloaded optimizer states"),
    # engine.py picks FusedAdam for a ds_config's "Adam"/"AdamW" unless the optimizer is offloaded or torch_adam is
    # set (chapters 02-03, and Muon's Adam half in 13): without this, a learner's first such engine builds it
    ("fused_adam", "FusedAdamBuilder", "FusedAdam: a ds_config's Adam/AdamW when not offloaded (no torch_adam)"),
)
# Probed and reported, never built by the course: the async I/O op links against libaio, and only NVMe offload
# (ZeRO-Infinity's parameter/optimizer swapping) and DeepSpeed's fast checkpoint writer use it.
AIO_OP = ("async_io", "AsyncIOBuilder", "NVMe offload (ZeRO-Infinity swapping) and the fast checkpoint writer")
INSTALL_HINTS = {
    "ninja": "pip install ninja (inside the course's venv), or: apt-get install ninja-build",
    "c++": "apt-get install g++ (Debian/Ubuntu: build-essential; Fedora: dnf install gcc-c++; "
           "macOS: xcode-select --install)",
    "numactl": "apt-get install numactl (only needed for the launcher's --bind_cores_to_rank)",
}
AIO_INSTALL_HINT = "apt-get install libaio-dev"


def _is_compatible(builder):
    """builder.is_compatible(), with the compiler's output discarded.

    DeepSpeed probes some ops by compiling and linking a test program (async_io: `-laio`); on a machine
    without the library the linker writes "cannot find -laio" straight to file descriptor 2, which neither
    DeepSpeed's own redirection nor a notebook's capture of sys.stderr stops. The answer is what matters.
    """
    from dslab.this_rank import silenced

    with silenced():
        return bool(builder.is_compatible(False))


def op_status():
    """For each course op: compatible here, already built (and where), the builder's op name."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    cache = machine.extensions_dir()
    status = {}
    for name, builder_name, purpose in COURSE_OPS:
        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None:
            status[name] = {"op": None, "compatible": False, "built": False, "path": None, "purpose": purpose,
                            "note": f"the {get_accelerator().device_name()} accelerator does not use it"}
            continue
        library = cache / builder.name / f"{builder.name}.so"
        prebuilt = bool(installed_ops.get(builder.name))
        status[name] = {
            "op": builder.name,
            # is_compatible asks this machine (compiler, libraries), not the prebuilt-ops table: no probe of every op
            "compatible": prebuilt or _is_compatible(builder),
            "built": prebuilt or library.exists(),
            "path": "installed with deepspeed" if prebuilt else (str(library) if library.exists() else None),
            "purpose": purpose,
        }
    return status


def aio_status():
    """The async I/O op (libaio): {"op", "compatible", "purpose"}; probed quietly, never built by the course."""
    from deepspeed.accelerator import get_accelerator

    name, builder_name, purpose = AIO_OP
    builder = get_accelerator().create_op_builder(builder_name)
    return {"op": name, "compatible": builder is not None and _is_compatible(builder), "purpose": purpose}


def _feature(name, available, reason):
    return {"name": name, "available": bool(available), "reason": reason}


def features(accel, cpu, ops, tools):
    """Which course features run here, each with the reason."""
    device, backend = accel["name"], accel["communication_backend"]
    fast = [flag for flag in ("avx512_bf16", "amx_bf16") if cpu["flags"].get(flag)]
    if device == "cpu":
        if not fast:
            bf16_reason = ("CPU accelerator; no avx512_bf16/amx_bf16: bf16 works but may be slower than fp32 "
                           "(measure it)")
        elif cpu["bf16_native"]:
            bf16_reason = f"CPU accelerator; this CPU has {' and '.join(fast)}: bf16 matmuls run natively"
        else:
            bf16_reason = (f"CPU accelerator; this CPU has {' and '.join(fast)}, but oneDNN is capped at "
                           f"{cpu['onednn_cap']} (ONEDNN_MAX_CPU_ISA): bf16 matmuls run without bf16 instructions, "
                           "maybe slower than fp32 (measure it)")
        # DeepSpeed asks oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported): yes on CPUs with AVX512-FP16 or AMX-FP16
        fp16_reason = ("DeepSpeed's CPU accelerator refuses fp16 on this CPU ('Type fp16 is not supported on your "
                       "device'; it needs AVX512-FP16 or AMX-FP16); torch.autocast(float16) and GradScaler on CPU "
                       "still show loss scaling" if not accel["fp16_supported"] else
                       "this CPU has oneDNN fp16 (AVX512-FP16 / AMX-FP16): DeepSpeed's fp16 optimizer runs here")
    else:
        bf16_reason = ("the GPU supports bf16" if accel["bf16_supported"]
                       else "this GPU has no native bf16 (needs Ampere or newer): use fp16")
        fp16_reason = "the GPU supports fp16" if accel["fp16_supported"] else "this GPU has no usable fp16"
    adam = ops["cpu_adam"]
    can_build = not machine.missing_build_tools(tools)
    if not adam["compatible"]:
        adam_reason = "the cpu_adam op is not compatible with this machine"
    elif adam["built"]:
        adam_reason = "the cpu_adam op is built (cached)"
    elif can_build:
        adam_reason = "cpu_adam will be JIT-built on first use (minutes); `dslab prepare` builds it now"
    else:
        adam_reason = f"cpu_adam cannot be built: missing {', '.join(machine.missing_build_tools(tools))}"
    shm = ops["shm_comm"]
    if device == "cpu":
        tp_reason = ("tensor_parallel with replace_with_kernel_inject=False on CPU ranks; all-reduce through "
                     + ("the shm op" if shm["compatible"] else "gloo")
                     + " (start ranks with the deepspeed launcher: it sets LOCAL_SIZE, which the shm op needs)")
    else:
        tp_reason = f"tensor_parallel with replace_with_kernel_inject=False; all-reduce through {backend}"
    inject = device == "cuda"
    return [
        _feature("bf16 training", accel["bf16_supported"], bf16_reason),
        _feature("fp16 DeepSpeed optimizer", accel["fp16_supported"], fp16_reason),
        _feature("ZeRO-Offload (cpu_adam)", adam["compatible"] and (adam["built"] or can_build), adam_reason),
        _feature("AutoTP inference", True, tp_reason),
        _feature("kernel injection", inject,
                 "replace_with_kernel_inject=True uses DeepSpeed's CUDA inference kernels" if inject else
                 "replace_with_kernel_inject=True needs CUDA kernels (a GPU); on CPU use AutoTP instead"),
        _feature("nccl", backend == "nccl",
                 "collectives run on NVIDIA GPUs through nccl" if backend == "nccl" else
                 f"the communication backend here is {backend}; nccl needs NVIDIA GPUs"),
    ]


def accelerator_info():
    """The accelerator DeepSpeed picks, its communication backend and 16-bit support (bf16_native: with bf16
    instructions, as bf16_native says on a CPU)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    name = accel.device_name()
    bf16 = bool(accel.is_bf16_supported())
    if name == "cuda":
        import torch

        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)  # emulated bf16 is slow
    native = bf16 if name != "cpu" else machine.cpu_info()["bf16_native"]
    return {"name": name, "communication_backend": accel.communication_backend_name(),
            "bf16_supported": bf16, "bf16_native": native, "fp16_supported": bool(accel.is_fp16_supported())}


def machine_facts():
    """Everything above as one dict (same keys on every machine; values that vary sit in fixed places)."""
    tools = machine.build_tools()
    accel = accelerator_info()
    cpu = machine.cpu_info()
    ops = op_status()
    return {
        "versions": machine.versions(),
        "platform": f"{platform.system()} {platform.machine()}",
        "accelerator": accel,
        "build_tools": tools,
        "cpu": cpu,
        "memory": machine.memory_info(),
        **machine.gpu_info(),
        "torch_extensions_dir": str(machine.extensions_dir()),
        "ops": ops,
        "async_io": aio_status(),
        "features": features(accel, cpu, ops, tools),
    }


def _quota_rows(c, row):
    """The report's row on the cgroup's CPU quota, when there is one (most laptops have none: no row, the report
    reads as before): the quota, the threads it allows, the affinity's cores, and which of the two wins."""
    if c.get("cpu_quota") is None:
        return []
    wins = say("env.quota_wins") if c["cores_limited_by"] == "quota" else say("env.affinity_wins")
    return [row(say("env.quota"), say("env.quota_value", quota=f"{c['cpu_quota']:g}", cores=c["cores_quota"],
                                      affinity=c["cores_affinity"], wins=wins))]


def format_report(rep):
    """The report as aligned text, in the learner's language (dslab.messages)."""
    def row(label, value):  # padded by display width: a Chinese character takes two columns
        width = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in label)
        return f"  {label}{' ' * max(1, 22 - width)}{value}"

    yes_no = {True: say("env.yes"), False: say("env.no")}
    a, c = rep["accelerator"], rep["cpu"]
    lines = [say("env.versions")] + [row(k, v or say("env.not_installed")) for k, v in rep["versions"].items()]
    lines += [say("env.accelerator"),
              row(say("env.device"), f"{a['name']} ({rep['platform']})"),
              row(say("env.backend"), a["communication_backend"]),
              row("bf16 / fp16", f"{yes_no[bool(a['bf16_supported'])]} / {yes_no[bool(a['fp16_supported'])]}")]
    flags = ", ".join(f for f, on in c["flags"].items() if on) or say("env.none")
    lines += [say("env.cpu"),
              row(say("env.model"), c["model"]),
              row(say("env.cores"), f"{c['cores_usable']} / {c['cores_total']}"),
              *_quota_rows(c, row),
              row(say("env.flags"), flags),
              row(say("env.memory"), say("env.memory_value", total=rep["memory"]["total_gib"],
                                         available=rep["memory"]["available_gib"]))]
    lines += [say("env.gpus")] + ([f"  {g['index']}: {g['name']}, {g['memory_gib']} GiB, sm {g['compute_capability']}"
                                   for g in rep["gpus"]] or [f"  {say('env.none')}"])
    if rep["topology"]:
        lines += [f"  {say('env.topology')}"] + [f"    {line}" for line in rep["topology"].splitlines()]
    lines += [say("env.build_tools")] + [row(k, v or say("env.missing", hint=INSTALL_HINTS.get(k, "")))
                                         for k, v in rep["build_tools"].items()]
    lines += [say("env.jit_ops"), row(say("env.cache"), rep["torch_extensions_dir"])]
    for name, op in rep["ops"].items():
        state = (say("env.built") if op["built"] else say("env.not_built")) if op["compatible"] \
            else say("env.not_compatible")
        lines.append(row(name, state + (f" ({op['path']})" if op["path"] else "")))
    aio = rep["async_io"]
    lines.append(row(aio["op"], (say("env.aio_ok") if aio["compatible"] else
                                 say("env.aio_missing", hint=AIO_INSTALL_HINT)) + say("env.aio_use")))
    lines += [say("env.what_runs")]
    lines += [f"  [{'x' if f['available'] else ' '}] {f['name']:<26}{f['reason']}" for f in rep["features"]]
    return "\n".join(lines)


def prepare(only=None, stream=None, verbose=False):
    """Build the course's JIT ops now (cached afterwards); returns {op: seconds}.

    Raises RuntimeError naming what is missing and how to install it when ninja or the C++ compiler is
    absent, and after trying every op when a build fails. verbose=True shows the compiler's output.
    """
    stream = stream or sys.stdout
    tools = machine.build_tools()
    missing = machine.missing_build_tools(tools)
    if missing:
        raise RuntimeError("cannot build DeepSpeed's JIT ops: missing " + ", ".join(missing) + "\n"
                           + "\n".join(f"  {name}: {INSTALL_HINTS[name]}" for name in missing))
    if not tools["numactl"]:
        print(f"note: numactl not found; {INSTALL_HINTS['numactl']}", file=stream)
    from deepspeed.accelerator import get_accelerator

    timings, failed = {}, []
    for name, builder_name, purpose in COURSE_OPS:
        if only and name not in only:
            continue
        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None or not builder.is_compatible(False):
            print(f"{name}: skipped (not used or not compatible on the "
                  f"{get_accelerator().device_name()} accelerator)", file=stream)
            continue
        cached = op_status()[name]["built"]
        print(f"{name}: {'loading cached build' if cached else 'building (one to several minutes)'} ...",
              file=stream, flush=True)
        start = time.perf_counter()
        try:
            builder.load(verbose=verbose)
        except Exception as exc:  # a compiler error: report it, try the other ops, fail at the end
            failed.append(f"{name}: {type(exc).__name__}: {exc}".strip())
            print(f"{name}: build FAILED after {time.perf_counter() - start:.1f} s", file=stream, flush=True)
            continue
        timings[name] = time.perf_counter() - start
        print(f"{name}: ready in {timings[name]:.1f} s ({purpose})", file=stream, flush=True)
    if failed:
        raise RuntimeError("could not build " + "; ".join(failed) + f"\n  build folders: {machine.extensions_dir()}; "
                           "`dslab prepare --verbose` shows the compiler's output")
    return timings


def import_deepspeed():
    """Import DeepSpeed (importing it picks the accelerator) and return [(level, message)] its logger emitted meanwhile.

    The messages are kept instead of printed, so a notebook can show them as plain text. Empty when DeepSpeed was
    already imported in this process (it logs the accelerator choice once).
    """
    import logging

    logged = []

    def keep(record):
        logged.append((record.levelname, record.getMessage()))
        return False  # kept here, not printed by DeepSpeed's handler

    logger = logging.getLogger("DeepSpeed")  # DeepSpeed's logger; it keeps filters set before its import
    logger.addFilter(keep)
    try:
        import deepspeed  # noqa: F401
        from deepspeed.accelerator import get_accelerator

        get_accelerator()
    finally:
        logger.removeFilter(keep)
    return logged

