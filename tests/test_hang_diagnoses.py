"""dslab.hangs.diagnoses reads what each hang diagnosis prints (chapter 12): a rank's traceback, DETAIL's fingerprints,
the hang watch's report. The texts here have the shapes torch 2.13, gloo and dslab.hangs.watcher printed in the
chapter."""
import textwrap

import pytest

from dslab.hangs import diagnoses, watcher

SITE = "/venv/lib/python3.11/site-packages"

GLOO_TIMEOUT = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 8000ms for recv operation to complete")
# A rank's log as the deepspeed launcher keeps it (--enable_each_rank_log), torch's "[rankN]:" prefix included.
TIMED_OUT_LOG = textwrap.dedent(f"""\
    [rank0]: Traceback (most recent call last):
    [rank0]:   File "/home/me/runs/log_metric.py", line 22, in <module>
    [rank0]:     dist.all_reduce(tokens)
    [rank0]:   File "{SITE}/torch/distributed/c10d_logger.py", line 83, in wrapper
    [rank0]:     return func(*args, **kwargs)
    [rank0]:   File "{SITE}/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
    [rank0]:     work.wait()
    [rank0]: {GLOO_TIMEOUT}
    """)

# Both ranks' messages under TORCH_DISTRIBUTED_DEBUG=DETAIL: each names its own collective first; what follows
# "but Rank M is running" is not rank M's collective (GATHER, REDUCE: neither rank ran those).
DETAIL_LOGS = (
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float, "
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)), but Rank 1 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=0OpType=REDUCE).Collectives differ in the following aspects: ...\n"
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=1OpType=BARRIER), but Rank 0 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=0OpType=GATHER).Collectives differ in the following aspects: ...\n")


def test_a_traceback_names_the_collective_and_the_jobs_own_line():
    seen = diagnoses.traceback_summary(TIMED_OUT_LOG)
    assert seen == {"error": GLOO_TIMEOUT,
                    "collective": "all_reduce", "file": "log_metric.py", "line": 22, "function": "<module>"}
    assert diagnoses.traceback_summary("rank 0: done\n") is None


def test_rank_errors_reads_every_rank_log_that_ends_in_a_traceback(tmp_path):
    (tmp_path / "20260101_rank0.log").write_text(TIMED_OUT_LOG)
    (tmp_path / "20260101_rank1.log").write_text(TIMED_OUT_LOG.replace("[rank0]", "[rank1]")
                                                 .replace("line 22", "line 24").replace("all_reduce", "barrier"))
    (tmp_path / "20260101_rank2.log").write_text("rank 2: done\n")   # finished: not in the answer
    (tmp_path / "hang.txt").write_text("not a rank log")
    assert {r: (s["collective"], s["line"]) for r, s in diagnoses.rank_errors(tmp_path).items()} == \
        {0: ("all_reduce", 22), 1: ("barrier", 24)}


def test_fingerprints_read_each_ranks_own_sentence_only():
    seen = diagnoses.fingerprints(DETAIL_LOGS)
    assert {r: (s["sequence_number"], s["op_type"], s["collective"], s["shape"]) for r, s in seen.items()} == \
        {0: (1, "ALLREDUCE", "all_reduce", [1]), 1: (1, "BARRIER", "barrier", None)}
    assert seen[0]["sentence"].startswith("Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=1")
    only_rank_1 = DETAIL_LOGS.splitlines()[1]   # rank 0's garbled description there must not be read as rank 0's
    assert list(diagnoses.fingerprints(only_rank_1)) == [1]


def test_blocked_reads_the_report_the_hang_watch_writes():
    def frame(name, path, line):
        return {"name": name, "filename": path, "short_filename": path.rsplit("/", 1)[-1], "line": line}

    barrier = [frame("barrier", f"{SITE}/torch/distributed/distributed_c10d.py", 5356),
               frame("<module>", "/home/me/runs/log_metric.py", 24)]
    sleeping = [frame("wait_here", "/home/me/runs/sleeper.py", 3)]
    lines = []
    for rank, (pid, frames) in enumerate([(101, barrier), (102, sleeping)]):
        _, where = watcher.where_blocked([{"os_thread_id": pid, "frames": frames}], pid)
        lines.append(f"  rank {rank} (pid {pid}): {where}")
    report = "job: no rank made progress for 10 s. Where each rank waits:\n" + "\n".join(lines) + "\n"
    assert diagnoses.blocked(report) == {0: {"collective": "barrier", "where": "distributed_c10d.py:5356",
                                         "file": "log_metric.py", "line": 24, "function": "<module>"}}
    assert diagnoses.waiting(report + "  rank 2: has exited\n") == {
        0: "blocked in barrier (distributed_c10d.py:5356), called from log_metric.py:24 (<module>)",
        1: "in no collective: at sleeper.py:3 (wait_here)", 2: "has exited"}


def test_line_of_and_source_lines(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os\nx = os.environ.get('MY_SETTING', '0')\n")
    assert diagnoses.line_of(script, "MY_SETTING") == 2
    with pytest.raises(ValueError, match="no line of"):
        diagnoses.line_of(script, "absent")
    assert diagnoses.source_lines(script, "MY_SETTING") == ["job.py:2: x = os.environ.get('MY_SETTING', '0')"]


def test_default_timeouts_come_from_the_installed_libraries():
    rows = diagnoses.default_timeouts()
    assert [row["process group made by"] for row in rows] == ["deepspeed.init_distributed()",
                                                              'torch.distributed.init_process_group("gloo")']
    assert rows[1]["default timeout"] == "30 min"


def test_flight_recorder_keeps_the_last_2000_by_default_and_the_variable_sets_the_size(monkeypatch):
    """torch 2.13's FlightRecorder: TORCH_FR_BUFFER_SIZE (or the older TORCH_NCCL_TRACE_BUFFER_SIZE), default 2000;
    0 turns it off. Read in new processes, whatever this one's environment says."""
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "3")   # ignored: the probe starts from torch's defaults
    assert diagnoses.flight_recorder_kept(2005) == list(range(6, 2006))
    assert diagnoses.flight_recorder_kept(10, buffer_size=4) == [7, 8, 9, 10]
    assert diagnoses.flight_recorder_kept(10, buffer_size=0) == []
