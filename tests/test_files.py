"""dslab.files: a write is complete or absent, whatever fails half-way; nothing temporary is left beside it."""
import os
import stat

import pytest

from dslab import files


def _leftovers(folder, keep):
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "report.json"
    files.atomic_write_json(target, {"step": 1})
    with pytest.raises(TypeError):
        files.atomic_write_bytes(target, "text where bytes belong")  # fails inside the write, after the temp file
    assert target.read_text() == '{"step": 1}'
    assert _leftovers(tmp_path, {"report.json"}) == []


def test_bytes_and_text_replace_the_target_with_the_usual_permissions(tmp_path):
    target = tmp_path / "sub" / "logits.safetensors"
    files.atomic_write_bytes(target, b"\x00\x01")
    files.atomic_write_bytes(target, b"\x02")
    assert target.read_bytes() == b"\x02"
    files.atomic_write_text(tmp_path / "zh.txt", "小海")
    assert (tmp_path / "zh.txt").read_bytes() == "小海".encode("utf-8")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # not mkstemp's owner-only 0o600


def test_a_failed_directory_keeps_the_old_one_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "adapter"
    with files.atomic_dir(target) as tmp:
        (tmp / "adapter_model.safetensors").write_bytes(b"old")
    with pytest.raises(RuntimeError), files.atomic_dir(target) as tmp:
        (tmp / "adapter_model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed while saving")
    assert (target / "adapter_model.safetensors").read_bytes() == b"old"
    assert _leftovers(tmp_path, {"adapter"}) == []
