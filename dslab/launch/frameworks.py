"""The training frameworks that live in venvs of their own (chapter 14): ms-swift's `swift` and LLaMA-Factory's
`llamafactory-cli`, built by `make swift` / `make llamafactory` beside dslab's .venv. Their command lines run as
typed, with the framework's venv first on PATH; several lines are the nodes of one job, started together on this
machine. Each node's whole output goes to a log file; the cell shows the command and where the log is."""
import json
import os
import re
import shlex
import subprocess
import time
import uuid
from pathlib import Path

from dslab.launch.guard import JOB_ENV, parent_death_signal, processes_with_env, start_guard, stop_processes
from dslab.launch.supervise import LaunchError
from dslab.machine import threads_per_rank
from dslab.messages import say

ROOT = Path(__file__).resolve().parent.parent.parent
# command -> (venv folder beside .venv, make target that builds it)
VENVS = {"swift": (".venv-swift", "swift"), "llamafactory-cli": (".venv-llamafactory", "llamafactory")}
PINS = {"dslab": "pyproject.toml", "ms-swift": "frameworks/ms-swift.txt", "LLaMA-Factory": "frameworks/llamafactory.txt"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def venv_bin(command):
    """The bin folder of the venv that holds `command` ("swift" or "llamafactory-cli"), or None if not built."""
    folder, _ = VENVS[command]
    bin_dir = ROOT / folder / "bin"
    return bin_dir if (bin_dir / command).exists() and (ROOT / folder / ".installed").exists() else None


def built(command):
    """True if `make` has built the venv of `command`."""
    return venv_bin(command) is not None


def not_built_note(command):
    """The one line a cell prints instead of running `command` when its venv is not there."""
    return say("frameworks.not_built", command=command, target=VENVS[command][1])


def _pins(path):
    """{package: version} of every `name==version` in a requirements file or pyproject.toml's dependency list."""
    pins = {}
    for line in (ROOT / path).read_text(encoding="utf-8").splitlines():
        line = line.strip().strip('",')
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def version_table(packages=("torch", "deepspeed", "transformers", "peft", "accelerate", "trl", "datasets",
                            "ms-swift", "llamafactory")):
    """One row per package: the version dslab pins (pyproject.toml) and each framework's venv (frameworks/*.txt),
    "-" where one does not install it."""
    pins = {env: _pins(path) for env, path in PINS.items()}
    return [{"package": package, **{env: pins[env].get(package, "-") for env in PINS}} for package in packages]


def split_framework_command(line):
    """(env assignments, argv) of "NPROC_PER_NODE=2 swift sft ..."; LaunchError unless it runs a known framework."""
    argv = shlex.split(line)
    env = {}
    while argv and _ASSIGNMENT.fullmatch(argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    if not argv or argv[0] not in VENVS:
        raise LaunchError(say("frameworks.unknown", line=line, frameworks=", ".join(VENVS)))
    return env, argv


def ranks_here(parsed):
    """How many ranks the parsed framework lines start on this machine: each line is a node, with NPROC_PER_NODE ranks
    (the frameworks' torchrun setting; 1 where the line does not set it)."""
    counts = [env.get("NPROC_PER_NODE", "1") for env, _ in parsed]
    return sum(int(n) if n.isdigit() else 1 for n in counts)


def framework_environment(env, bin_dir, ranks):
    """The environment a framework's command line runs with: this one, the line's own assignments (`env`), its venv
    (`bin_dir`) first on PATH, and OMP_NUM_THREADS for `ranks` ranks sharing this machine's usable cores (affinity or
    CPU quota: dslab.machine.threads_per_rank) unless the line sets it. Without it, torchrun gives each of
    several ranks 1 thread and a lone rank starts one thread per core of the server, however small its quota."""
    full = dict(os.environ, **env)
    full["PATH"] = f"{bin_dir}{os.pathsep}{full.get('PATH', '')}"
    full["VIRTUAL_ENV"] = str(bin_dir.parent)
    full.pop("PYTHONPATH", None)           # dslab's packages must not leak into the framework's venv
    full.pop("MPLBACKEND", None)           # a notebook's inline backend: matplotlib elsewhere refuses it
    full.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: every model and dataset is local
    full["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", str(threads_per_rank(ranks)))
    full.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the ranks share the cores
    return full


def run_framework(lines, log_dir, timeout=3600, show=True):
    """Run framework command lines as typed (one per node, started together) and wait for all of them.

    Each node's output goes to log_dir/node{i}.log. If a node fails, the others are stopped and LaunchError
    quotes the end of the failed node's log. Returns the log paths."""
    lines = [lines] if isinstance(lines, str) else list(lines)
    parsed = [split_framework_command(line) for line in lines]
    for _, argv in parsed:
        if not built(argv[0]):
            raise LaunchError(not_built_note(argv[0]))
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # The frameworks start torchrun and their ranks themselves: every process of the job carries JOB_ENV=job, so the
    # guard stops them all if this process dies (a restarted kernel), and so does the end of this function.
    job = f"framework-{uuid.uuid4().hex[:12]}"
    guard = start_guard(marker=(JOB_ENV, job))
    procs, logs = [], []
    ranks = ranks_here(parsed)
    for node, (env, argv) in enumerate(parsed):
        bin_dir = venv_bin(argv[0])
        full = dict(framework_environment(env, bin_dir, ranks), **{JOB_ENV: job})
        if show:
            print(("# node %d: " % node if len(lines) > 1 else "") + "$ " + lines[node], flush=True)
        log = log_dir / f"node{node}.log"
        logs.append(log)
        with open(log, "w", encoding="utf-8") as out:
            procs.append(subprocess.Popen([str(bin_dir / argv[0])] + argv[1:], env=full, stdout=out,
                                          stderr=subprocess.STDOUT, preexec_fn=parent_death_signal()))
    deadline = time.monotonic() + timeout
    failed = None
    while failed is None and any(p.poll() is None for p in procs):
        failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if time.monotonic() > deadline:
            failed = next(i for i, p in enumerate(procs) if p.poll() is None)
        time.sleep(0.5)
    failed = failed if failed is not None else next((i for i, p in enumerate(procs) if p.returncode != 0), None)
    stop_processes(procs=processes_with_env(JOB_ENV, job))  # the nodes still running and all they started
    for p in procs:
        p.wait()
    guard.kill()
    if failed is not None:
        tail = "\n".join(logs[failed].read_text(encoding="utf-8", errors="replace").splitlines()[-30:])
        raise LaunchError(say("frameworks.failed", node=failed, line=lines[failed], code=procs[failed].returncode,
                              log=logs[failed], tail=tail))
    if show:
        print(f"exit 0; output in {', '.join(str(log) for log in logs)}", flush=True)
    return logs


# A log line's own prefix, left out when it is shown: "[INFO|2026-12-06 10:04:53] llamafactory.model.loader:144 >> ",
# "[INFO|trainer.py:1478] 2026-12-06 10:04:55,220 >> ", "[INFO:swift] "
_LOG_PREFIX = re.compile(r"^\[(INFO|WARNING)[^\]]*\]\s*(\S+ \S+ )?(\S+ )?>>\s*|^\[(INFO|WARNING):\w+\]\s*")


def log_lines(log, patterns, width=150):
    """The first line of a framework's log that matches each regex in `patterns`, in the log's order: without its
    logging prefix, paths under the kit shown relative to it (the same on every machine), cut at `width` characters."""
    text = Path(log).read_text(encoding="utf-8", errors="replace")
    found = {}
    for number, line in enumerate(text.splitlines()):
        for pattern in patterns:
            if pattern not in found and re.search(pattern, line):
                found[pattern] = (number, line)
    shown = []
    for _, line in sorted(found.values()):
        line = _LOG_PREFIX.sub("", line.strip()).replace(f"{ROOT}{os.sep}", "")
        line = re.sub(r"\.venv-\w+/lib/python[\d.]+/site-packages/", "", line)
        line = re.sub(r"bin/python[\d.]*\b", "bin/python", line)   # whichever Python the venv was made from
        shown.append(line if len(line) <= width else line[:width - 4] + " ...")
    return shown


# Run by a framework venv's own Python: the defaults of the TrainingArguments installed there, as JSON.
_TRAINER_DEFAULTS = """
import dataclasses, enum, json, sys
import transformers
found = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
print(json.dumps({n: found[n].value if isinstance(found[n], enum.Enum) else found[n] for n in sys.argv[1:]}))
"""


def trainer_defaults(command, names):
    """{name: default} of the Hugging Face TrainingArguments in the venv of `command` (the Trainer that the
    framework runs, at the framework's own transformers pin), read by that venv's Python: what a framework's run uses
    for each setting its command line or YAML leaves out."""
    bin_dir = venv_bin(command)
    if bin_dir is None:
        raise LaunchError(not_built_note(command))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the framework's packages, not dslab's
    done = subprocess.run([str(bin_dir / "python"), "-c", _TRAINER_DEFAULTS, *names], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def venv_facts():
    """Which framework venvs this machine has, as recorded notebooks keep it (tools/record.py): chapter 14's framework
    cells depend on it ("dslab": {"depends_on": ["swift_venv"]}) and are compared only where it matches."""
    return {"swift_venv": built("swift"), "llamafactory_venv": built("llamafactory-cli")}
