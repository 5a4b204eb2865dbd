"""Resumable training checkpoints: saved complete or not at all, found from the run's --output, re-cut for
another number of ranks.

A checkpoint directory (by default OUTPUT-checkpoints, beside the run's --output) holds one folder per saved
step, `step{N}`, with every rank's DeepSpeed shards and this kit's state file, plus a `latest` file naming the
newest complete folder. A job killed at any moment leaves `latest` naming a checkpoint that is whole.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dslab import files
from dslab.messages import say

STATE_FILE = "dslab_state.json"  # written into each checkpoint: step, world size, zero stage, global batch
LATEST = "latest"  # the name DeepSpeed's own loaders and zero_to_fp32.py look for
UNIVERSAL_SUFFIX = "_universal"  # step{N}_universal: the same checkpoint re-cut for any number of ranks


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed as asked; the message says where it looked and how to fix it."""


def default_dir(output):
    """Where a run writing `output` keeps its checkpoints unless told otherwise: OUTPUT-checkpoints, beside it."""
    return Path(f"{str(output).rstrip('/')}-checkpoints")


def find_checkpoints(path):
    """The checkpoint directory `path` means: `path` itself when it holds `latest`, else the checkpoints of a
    run whose --output was `path` (path-checkpoints). CheckpointError naming both places if neither has one."""
    path = Path(path)
    for directory in (path, default_dir(path)):
        if (directory / LATEST).is_file():
            return directory
    raise CheckpointError(say("resume.none", path=path, latest=LATEST, default=default_dir(path)))


def latest_checkpoint(path):
    """(tag dir, state dict) of the newest complete checkpoint `path` holds (see find_checkpoints)."""
    directory = find_checkpoints(path)
    tag_dir = directory / (directory / LATEST).read_text().strip()
    return tag_dir, json.loads((tag_dir / STATE_FILE).read_text())


def unsealed_tag(step):
    """The tag every rank first writes step `step`'s checkpoint under (engine.save_checkpoint(directory,
    tag=unsealed_tag(step), save_latest=False)), until seal_checkpoint renames it: a job killed in between leaves
    this hidden folder, never a `latest` that names a half-written checkpoint."""
    return f".tmp-step{step}"


def seal_checkpoint(engine, directory, step, world_size, zero_stage):
    """After every rank's engine.save_checkpoint(directory, tag=unsealed_tag(step), save_latest=False): rank 0 adds
    this kit's state file, renames the folder to step{N} and records it in `latest`. Every rank must call it."""
    import torch.distributed as tdist

    directory = Path(directory)
    tag, tmp_tag = f"step{step}", unsealed_tag(step)
    tdist.barrier()  # every rank has written its shards
    if tdist.get_rank() == 0:
        state = {"step": step, "world_size": world_size, "zero_stage": zero_stage,
                 "global_batch": engine.train_batch_size()}  # ranks x micro-batch x accumulation
        files.atomic_write_json(directory / tmp_tag / STATE_FILE, state)
        # The folder was written by every rank under a name all of them know, so files.atomic_dir (one writer,
        # a random temp name) does not fit; renaming it whole gives the same all-or-nothing result.
        shutil.rmtree(directory / tag, ignore_errors=True)
        os.replace(directory / tmp_tag, directory / tag)
        files.atomic_write_text(directory / LATEST, tag)  # a crash before this leaves the previous `latest`
    tdist.barrier()


def resume_point(path, world_size, zero_stage):
    """(directory, tag, step) of the newest complete checkpoint `path` holds, for engine.load_checkpoint(directory,
    tag=tag): written by another number of ranks, the tag is the universal copy `check_resume` made before launch
    (the engine must then have been built with `"checkpoint": {"load_universal": true}`)."""
    tag_dir, state = latest_checkpoint(path)
    if state["zero_stage"] != zero_stage:
        raise CheckpointError(say("resume.zero_stage", what=f"checkpoint {tag_dir}", stage=state["zero_stage"]))
    tag = tag_dir.name if state["world_size"] == world_size else tag_dir.name + UNIVERSAL_SUFFIX
    return str(tag_dir.parent), tag, state["step"]


def needs_universal(path, world_size):
    """True when the newest checkpoint in `path` was written by another number of ranks than `world_size`."""
    return latest_checkpoint(path)[1]["world_size"] != world_size


def check_resume(path, world_size, zero_stage, global_batch):
    """Before launch: is the newest checkpoint `path` holds resumable with this setup? Returns True when it
    was written by another number of ranks, after making its universal copy (once).

    The same world size reloads the ZeRO shards as they are and continues exactly. Another world size needs
    each parameter's fp32 weights and Adam moments re-cut into new shards: DeepSpeed's universal checkpoint
    (deepspeed.checkpoint.ds_to_universal). Two limits: the global batch (ranks x micro-batch x accumulation)
    must stay the same, so a step means the same number of examples and the learning-rate schedule still fits;
    and each rank's slice of the data changes, so the losses follow the same trend, not the same values.
    """
    tag_dir, state = latest_checkpoint(path)
    if state["zero_stage"] != zero_stage:
        raise CheckpointError(say("resume.zero_stage", what=f"--resume {path}", stage=state["zero_stage"]))
    if state["world_size"] == world_size:
        return False
    if zero_stage == 0:
        raise CheckpointError(say("resume.zero0_world", path=path, saved=state["world_size"], world_size=world_size))
    if global_batch != state["global_batch"]:
        wanted = state["global_batch"]
        fix = (say("resume.batch.fix", world_size=world_size, per_rank=wanted // world_size)
               if wanted % world_size == 0 else say("resume.batch.divide", wanted=wanted))
        raise CheckpointError(say("resume.batch", path=path, wanted=wanted, global_batch=global_batch, fix=fix))
    universal = tag_dir.with_name(tag_dir.name + UNIVERSAL_SUFFIX)
    if not universal.exists():
        with files.atomic_dir(universal) as tmp:  # complete or absent, like the checkpoints themselves
            # A converter run, not ranks: its own interpreter keeps its worker pool and prints out of this process.
            done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                   str(tag_dir), "--output_folder", str(tmp), "--inject_missing_state"],
                                  capture_output=True, text=True)
            if done.returncode:
                raise CheckpointError(f"converting {tag_dir} to a universal checkpoint failed:\n{done.stderr[-2000:]}")
            shutil.copy(tag_dir / STATE_FILE, tmp / STATE_FILE)
    return True
