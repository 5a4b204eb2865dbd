"""File-system safety in one place: writes that are complete or absent, and early checks of where output goes.

A reader (another rank, a resumed job, the learner's next cell) never sees half a file: everything is written
beside its target and renamed onto it in one step. Checks run before a long job starts, so a read-only
directory or a full disk is reported with its fix instead of after an hour of training.
"""
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from dslab.messages import say


def _umask():
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _default_permissions(root):
    # mkstemp/mkdtemp create owner-only files; give the result the usual umask permissions.
    umask = _umask()
    os.chmod(root, (0o777 if root.is_dir() else 0o666) & ~umask)
    if root.is_dir():
        for path in root.rglob("*"):
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def atomic_write_bytes(path, data):
    """Write `data` to `path` through a temp file renamed onto it; returns the Path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        _default_permissions(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path, text):
    """Write `text` to `path` (UTF-8), atomically (see atomic_write_bytes)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, obj, **dumps_kwargs):
    """`obj` as JSON, written atomically (see atomic_write_text)."""
    return atomic_write_text(path, json.dumps(obj, **dumps_kwargs))


@contextlib.contextmanager
def atomic_dir(target):
    """Yield a fresh temp dir beside `target`; on success it replaces `target` in one rename, else vanishes."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _default_permissions(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():  # a directory cannot be renamed onto a non-empty one: move the old one aside first
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "x")
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _existing_parent(path):
    parent = Path(path).resolve()
    while not parent.exists():
        parent = parent.parent
    return parent


def check_writable(directory, option="--output"):
    """Raise PermissionError (with the fix) unless files can be created where `directory` will be written."""
    path = Path(directory).resolve()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(say("files.is_a_file", option=option, directory=str(directory)))
    parent = _existing_parent(path)
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise PermissionError(say("files.not_writable", parent=str(parent), why=exc.strerror, option=option)) from None


def check_file_writable(path, option="--output"):
    """Raise IsADirectoryError or PermissionError (with the fix) unless a file can be written at `path`."""
    if Path(path).is_dir():
        raise IsADirectoryError(say("files.is_a_dir", option=option, path=str(path)))
    check_writable(Path(path).parent, option)


def check_free_space(directory, needed_bytes, option="--output"):
    """Raise OSError (with the fix) unless the file system that will hold `directory` has `needed_bytes` free."""
    free = shutil.disk_usage(_existing_parent(directory)).free
    if free < needed_bytes:
        raise OSError(say("files.no_space", option=option, directory=str(directory), free=free / 2**20,
                          needed=needed_bytes / 2**20))
