"""Helpers for code that runs on a rank: init (a world of N, or this process alone), rank-0 printing, results, quiet logs."""
import atexit
import contextlib
import io
import logging
import os
import random
import sys
import warnings
from pathlib import Path

from dslab import files
from dslab.launch.supervise import RESULT_DIR_ENV  # noqa: F401 (also read as this_rank.RESULT_DIR_ENV)
from dslab.machine import ensure_build_tools_on_path



def _errors_only(record):
    return record.levelno >= logging.ERROR


def quiet():
    """Silence DeepSpeed, transformers and torch chatter so notebook output stays readable and stable."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    # DeepSpeed resets its logger's level when it is imported, but keeps filters: a filter set
    # before the import also hides the "Setting accelerator to CPU" line printed at import time.
    for name in ("DeepSpeed", "torch.distributed", "transformers", "accelerate", "peft"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        if _errors_only not in logger.filters:
            logger.addFilter(_errors_only)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass


def seed_all(seed=0):
    """Seed python, numpy and torch so every rank (and every re-run) draws the same numbers."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def init(backend=None):
    """Join the process group the launcher prepared; returns (rank, world_size)."""
    ensure_build_tools_on_path()  # before DeepSpeed loads a JIT op in this process
    quiet()
    import deepspeed
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        # backend=None lets DeepSpeed's accelerator choose: gloo on CPU, nccl on NVIDIA GPUs.
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        # Leave the group before the interpreter tears itself down: a group destroyed along with the process
        # can abort it ("terminate called without an active exception") while its threads still run.
        atexit.register(_leave_group)
    return torch_dist.get_rank(), torch_dist.get_world_size()

@contextlib.contextmanager
def silenced():
    """Discard what the block prints, Python's and child processes' alike (file descriptors 1 and 2).

    The first deepspeed.init_distributed probes which C++ ops can build (a failed `-laio` link test on
    machines without libaio) and prints "... built successfully": noise that differs between machines.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = (os.dup(1), os.dup(2)), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def init_single_process(quiet=False):
    """Make this process rank 0 of a world of 1, so deepspeed.initialize works in a notebook kernel or CLI.

    quiet: discard the C++ op probe's output (see `silenced`).
    """
    import torch.distributed as tdist
    from dslab.launch.ports import free_port, port_is_free
    if tdist.is_available() and tdist.is_initialized():
        return
    # The variables the deepspeed launcher would set for a single rank; existing values win.
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    # A MASTER_PORT inherited from a parent that ran this too may be in use by now; alone in its world, this
    # process is the rendezvous server itself, so any free port serves.
    if os.environ["WORLD_SIZE"] == "1" and not port_is_free(int(os.environ["MASTER_PORT"]), os.environ["MASTER_ADDR"]):
        os.environ["MASTER_PORT"] = str(free_port())
    with silenced() if quiet else contextlib.nullcontext():
        init()


def _leave_group():
    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def rank():
    """This process's global rank (0 when not distributed)."""
    return int(os.environ.get("RANK", "0"))


def world_size():
    """Number of ranks in the job (1 when not distributed)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def print0(*args, **kwargs):
    """print() on rank 0 only, so a 2-rank job does not print everything twice."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def save_rank_result(obj):
    """Write this rank's result as JSON (atomically) for dslab.launch to collect."""
    directory = os.environ.get(RESULT_DIR_ENV)
    if not directory:
        return  # run by hand, outside dslab.launch: nothing collects results
    files.atomic_write_json(Path(directory) / f"rank{rank()}.json", obj)


def send_deepspeed_logs_to_stderr():
    """For commands whose stdout is data (JSON): DeepSpeed's logger writes to stdout, so import it with
    stdout pointing at stderr; its handler keeps that stream for the rest of the process."""
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # noqa: F401
