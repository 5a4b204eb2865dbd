"""Chapter 12 (jobs that hang): what each diagnosis says about every rank, read back as data.

A job hangs when its ranks disagree on the next collective. Three diagnoses name the rank, the collective and the
line, each in its own words; the functions here read those words so that a notebook can assert them:

- the process-group timeout: each rank's traceback ends in the collective it waited in, with gloo's
  "Timed out waiting Tms" (`rank_errors` reads the per-rank logs the deepspeed launcher writes);
- TORCH_DISTRIBUTED_DEBUG=DETAIL: "Rank N is running collective: CollectiveFingerPrint(SequenceNumber=S,
  OpType=OP, TensorShape=[...], ...)" (`fingerprints`);
- dslab's hang watch (py-spy): "rank N (pid P): blocked in COLLECTIVE (...), called from FILE:LINE (FUNCTION)"
  (`blocked`, reading what dslab.hangs.watcher.where_blocked writes).

`flight_recorder_kept` shows what torch's flight recorder keeps under a given TORCH_FR_BUFFER_SIZE, in a new process.
"""
import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from dslab.hangs import watcher

TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.M)  # torch prefixes an uncaught traceback's lines itself
# `  File "/path/to/train.py", line 21, in <module>`: one frame of a Python traceback
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.MULTILINE)
# the exception that ended the rank, e.g. `RuntimeError: [...] Timed out waiting 8000ms for recv operation ...`
_EXCEPTION = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception): .*$", re.MULTILINE)
# TORCH_DISTRIBUTED_DEBUG=DETAIL's first sentence, about the rank that raised. What follows ("but Rank M is running
# collective: ...") is not rank M's collective (rank M's own first sentence says what it ran), so it is not read.
_FINGERPRINT = re.compile(r"(?<=collectives on ranks\. )Rank (\d+) is running collective: "
                          r"CollectiveFingerPrint\(SequenceNumber=(\d+),? ?"
                          r"OpType=(\w+)(?:, TensorShape=\[([\d, ]*)\])?")
_BLOCKED = re.compile(r"^\s*rank (\d+) \(pid \d+\): blocked in (\w+) \(([^)]*)\)"
                      r"(?:, called from (.+):(\d+) \((.+)\))?$", re.MULTILINE)
_WAITING = re.compile(r"^  rank (\d+)(?: \(pid \d+\))?: (.+)$", re.MULTILINE)
_OP_TYPES = {"ALLREDUCE": "all_reduce", "BARRIER": "barrier", "ALLGATHER": "all_gather", "BROADCAST": "broadcast",
             "REDUCE_SCATTER": "reduce_scatter", "_REDUCE_SCATTER_BASE": "reduce_scatter",
             "_ALLGATHER_BASE": "all_gather", "ALLTOALL": "all_to_all", "REDUCE": "reduce", "GATHER": "gather",
             "SCATTER": "scatter", "SEND": "send", "RECV": "recv"}


def line_of(path, text):
    """The 1-based number of the first line of file `path` that contains `text` (ValueError if none does)."""
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if text in line:
            return number
    raise ValueError(f"no line of {path} contains {text!r}")


def traceback_summary(log_text):
    """What one rank's log says about how it ended: {"error": the exception line, "collective": the collective
    its traceback ends in (or None), "file": the job's own file, "line": its line, "function": ...}, or None when the
    log holds no traceback. The job's own frame is the innermost one outside Python and the installed packages."""
    text = TORCH_PREFIX.sub("", log_text)  # torch prefixes an uncaught traceback's lines with [rankN]:
    start = text.rfind("Traceback (most recent call last)")
    if start < 0:
        return None
    tail = text[start:]
    frames = [{"filename": path, "line": int(line), "name": name} for path, line, name in _FRAME.findall(tail)]
    errors = _EXCEPTION.findall(tail)
    own = [f for f in frames if watcher.is_user_frame(f)]
    collective = next((c for c in map(watcher.collective_of, reversed(frames)) if c), None)
    return {"error": errors[-1] if errors else None, "collective": collective,
            "file": Path(own[-1]["filename"]).name if own else None,
            "line": own[-1]["line"] if own else None, "function": own[-1]["name"] if own else None}


def rank_errors(log_dir):
    """{rank: traceback_summary} for every per-rank log (`*_rankN.log`, as `deepspeed --enable_each_rank_log`
    writes them) in `log_dir` that ends in a traceback."""
    found = {}
    for path in sorted(Path(log_dir).glob("*_rank*.log")):
        rank = int(re.search(r"_rank(\d+)\.log$", path.name).group(1))
        summary = traceback_summary(path.read_text(encoding="utf-8", errors="replace"))
        if summary:
            found[rank] = summary
    return dict(sorted(found.items()))


def fingerprints(text):
    """{rank: {"sequence_number", "op_type", "collective", "shape", "sentence"}} from TORCH_DISTRIBUTED_DEBUG=DETAIL's
    mismatch errors in `text`: each rank's sentence about its own collective (shape None for ops without tensors;
    sentence: the words read, up to the shape)."""
    found = {}
    for match in _FINGERPRINT.finditer(text):
        rank, seq, op_type, shape = match.groups()
        found[int(rank)] = {"sequence_number": int(seq), "op_type": op_type,
                            "collective": _OP_TYPES.get(op_type, op_type.lower()),
                            "shape": [int(n) for n in shape.replace(" ", "").split(",") if n] if shape else None,
                            "sentence": match.group(0)}
    return dict(sorted(found.items()))


def blocked(report):
    """{rank: {"collective", "where", "file", "line", "function"}} for every rank that a hang report
    (dslab.hangs.watcher.hang_report) shows blocked in a collective; file/line/function: the job's own call."""
    found = {}
    for rank, collective, where, file, line, function in _BLOCKED.findall(report):
        found[int(rank)] = {"collective": collective, "where": where, "file": file or None,
                            "line": int(line) if line else None, "function": function or None}
    return dict(sorted(found.items()))


def waiting(report):
    """{rank: where it waits} for every rank a hang report shows, in the report's words ("blocked in all_reduce
    (...)", "in no collective: at train.py:12 (<module>)", "has exited")."""
    return {int(rank): where for rank, where in _WAITING.findall(report)}


def source_lines(module, *names):
    """["file.py:LINE: code"] for each line of `module`'s source file (or of the file at path `module`) that
    mentions one of `names`: where an installed library reads an environment variable, shown from its own code."""
    import inspect

    path = Path(module) if isinstance(module, (str, Path)) else Path(inspect.getsourcefile(module))
    return [f"{path.name}:{number}: {line.strip()}" for number, line in
            enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if any(name in line for name in names)]


def default_timeouts():
    """How long a rank waits in a collective before its process group gives up, by who created the group:
    [{"process group made by", "default timeout", "changed with"}], read from the installed torch and DeepSpeed."""
    from deepspeed.constants import default_pg_timeout as deepspeed_default
    from torch.distributed.constants import default_pg_timeout as torch_default

    def minutes(delta):
        return f"{delta / timedelta(minutes=1):g} min"

    return [{"process group made by": "deepspeed.init_distributed()", "default timeout": minutes(deepspeed_default),
             "changed with": "timeout=timedelta(...), or DEEPSPEED_TIMEOUT=<minutes>"},
            {"process group made by": 'torch.distributed.init_process_group("gloo")',
             "default timeout": minutes(torch_default), "changed with": "timeout=timedelta(...)"}]


# Rank 0 of a world of one (gloo, an in-process store): N all-reduces, then the sequence numbers of the collectives
# torch's flight recorder kept (read through private torch API: dslab.compat.flight_recorder_dump).
_RECORDER_PROBE = """
import json, sys
import torch
import torch.distributed as dist
from dslab.compat import flight_recorder_dump
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
x = torch.ones(1)
for _ in range(int(sys.argv[1])):
    dist.all_reduce(x)
record = flight_recorder_dump()
print(json.dumps([entry["collective_seq_id"] for entry in record.get("entries", [])]))
dist.destroy_process_group()
"""
RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")   # the name, and its older one


def flight_recorder_kept(collectives, buffer_size=None):
    """The sequence numbers of the collectives torch's flight recorder keeps after `collectives` all-reduces, run in
    a new process (rank 0 of a world of one, gloo) with TORCH_FR_BUFFER_SIZE=buffer_size (None: unset, torch's
    default). The recorder reads the variable once per process, so each setting needs a process of its own."""
    env = {name: value for name, value in os.environ.items() if name not in RECORDER_VARIABLES}
    if buffer_size is not None:
        env["TORCH_FR_BUFFER_SIZE"] = str(buffer_size)
    done = subprocess.run([sys.executable, "-c", _RECORDER_PROBE, str(int(collectives))], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the flight-recorder probe failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
