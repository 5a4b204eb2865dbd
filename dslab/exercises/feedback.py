"""What a learner sees when their own code raises: the frames of their code (their notebook cell, their function),
trimmed of dslab's, torch's and DeepSpeed's, the exception, and a line on what that kind of error usually means.

A wrong answer is said by a checker (`Not quite: ...`); an exception in the learner's code is not a wrong answer, and
is shown as the traceback IPython would show, cut down to the lines the learner wrote.
"""
import os
import sysconfig
import traceback
from pathlib import Path

PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)          # dslab/
LIBRARY_DIRS = tuple(sorted({str(Path(sysconfig.get_paths()[key]).resolve())
                             for key in ("purelib", "platlib", "stdlib", "platstdlib")}))
HEADER = "Your code raised an error: this is an error in your code, not a wrong answer."
# What an exception of each type usually means in these exercises (the message itself says which name or value).
MEANINGS = {
    "NameError": "a name is used that is not defined where the code runs. Check the spelling; a function the checker "
                 "runs on ranks gets your cell's imports and definitions, so define or import what it uses there.",
    "UnboundLocalError": "a variable is read before the line that assigns it has run in this function.",
    "AttributeError": "the object before the dot has no such attribute: check the spelling, and what the object is "
                      "(deepspeed.initialize returns a tuple: engine, optimizer, dataloader, scheduler).",
    "TypeError": "a function got the wrong number or kind of arguments, or a value of the wrong type: compare the call "
                 "with the function's signature (help(function) shows it).",
    "ValueError": "a function got a value it refuses: the message above says which one.",
    "AssertionError": "an assert failed, yours or the library's: the message above says what it checked. DeepSpeed "
                      "asserts its batch sizes (train_batch_size = micro batch x accumulation x world size).",
    "IndexError": "an index past the end of a list or tensor: check the lengths you assume.",
    "KeyError": "a dictionary has no such key: check the spelling of the key.",
    "ZeroDivisionError": "a division by zero: a count or a size is 0 where you divide by it.",
    "RuntimeError": "torch or DeepSpeed refused the operation (shapes that do not match, a tensor on the wrong device, "
                    "a call in the wrong order): the message above says which.",
    "ModuleNotFoundError": "the module is not installed in this Python: check its name.",
    "ImportError": "the module has no such name: check what you import from it.",
    "SyntaxError": "Python cannot read the code: the caret marks where it stopped.",
    "RecursionError": "a function calls itself without end.",
}
GENERIC_MEANING = "the last line names the error; the lines above show where in your code it happened."


def is_library_file(filename):
    """True for dslab's own files and installed or standard-library modules: the frames a learner did not write."""
    if not filename or filename.startswith("<frozen "):
        return True
    path = os.path.realpath(filename) if os.path.isabs(filename) else filename
    return path.startswith(PACKAGE_DIR + os.sep) or any(path.startswith(d + os.sep) for d in LIBRARY_DIRS)


def label(filename):
    """How a file is named to the learner: `Cell In[7]` for a notebook cell, a path relative to the working
    directory for a file."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        named = shell.compile.format_code_name(filename) if shell is not None else None
        if named:
            return " ".join(named)
    except (ImportError, AttributeError):
        pass
    if os.path.isabs(filename):
        relative = os.path.relpath(filename)
        return filename if relative.startswith("..") else relative
    return filename


def learner_frames(tb, learner_files=None):
    """The traceback's frames in the learner's code: in `learner_files` if given, else any file that is not a
    library's (see is_library_file)."""
    frames = traceback.extract_tb(tb)
    if learner_files is not None:
        return [f for f in frames if f.filename in learner_files]
    return [f for f in frames if not is_library_file(f.filename)]


def explain(exc, learner_files=None, where=""):
    """The report of an exception raised by the learner's code, or None if none of its frames is the learner's.

    `where` (e.g. " on rank 1 of 3") is said after the header's first words."""
    frames = learner_frames(exc.__traceback__, learner_files)
    if not frames and not isinstance(exc, SyntaxError):
        return None
    lines = [HEADER if not where else HEADER.replace("Your code raised an error", f"Your code raised an error{where}")]
    for frame in frames:
        lines.append(f"  {label(frame.filename)}, line {frame.lineno}, in {frame.name}")
        if frame.line:
            lines.append(f"    {frame.line.strip()}")
    lines.extend(line.rstrip("\n") for line in traceback.format_exception_only(type(exc), exc))
    lines.append(f"What it means: {meaning(exc)}")
    return "\n".join(lines)


def meaning(exc):
    """What an exception of this type usually means, for the learner (its own message says the particulars)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in MEANINGS:
            return MEANINGS[cls.__name__]
    return GENERIC_MEANING


def exception_line(report):
    """The exception's own line in a report from `explain` (the line before "What it means"), else its last line."""
    lines = [line for line in report.splitlines() if line.strip()]
    for before, line in zip(lines, lines[1:]):
        if line.startswith("What it means:"):
            return before.strip()
    return lines[-1].strip() if lines else ""
