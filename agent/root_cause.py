"""The root cause of a failed rank, read from the tail of its output (a few KB up to 64 KB).

In order of preference:

1. A Python exception: the exception line after the last traceback frame in the tail, with the
   innermost frame of that traceback outside the Python installation, its packages and trainerd's own
   (the user's code), or the innermost frame when all are library code. trainerd's own code counts as
   a library's wherever it is installed: from a checkout (`pip install -e`, as `make` does) its files
   are not under site-packages, and a user's misuse of `trainerd_dataset` was located at trainerd's
   line instead of the user's call. The example jobs it ships (`trainer/examples/`) are jobs. Taking
   the last frame picks the last block of a chain ("During handling of the above exception…", "The
   above exception was the direct cause…"), and the user's own exception when MindSpore's dataset
   pipeline quotes it under "- Python Call Stack:" inside its RuntimeError. An exception line whose message is
   empty (MindSpore's `RuntimeError: ` followed by "- Kernel error:" sections) takes the first
   line of text below it, and one that refers to a section (the dataset pipeline's "Refer to 'Dataset
   Pipeline Error Message'") the first line of that section. What follows the first line ("- C++ Call
   Stack:", "- The Traceback of Net Construct Code:" sections) is never the message.
   A crash in native code reported after it (see 2) replaces it when the crashing thread was running
   Python code: the exception was handled and printed, and training went on. One with no Python frame
   after an exception is the interpreter's teardown after that exception, which stays the cause.
2. The interpreter's own report of a crash in native code (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL),
   which its fault handler prints (the agent runs every training process with `PYTHONFAULTHANDLER=1`):
   `Fatal Python error: Segmentation fault`, located at the innermost frame of the crashing thread that
   is the user's code (else its innermost frame; none when that thread ran no Python). A rank that
   crashes in a MindSpore kernel or a C extension then reads as its Python line, and the same crash
   on every rank as one error.
3. The last ERROR or CRITICAL line in MindSpore's log format, from C++
   `[ERROR] DISTRIBUTED(18267,7f49e4f9e6c0,python):2026-11-23-09:15:36.390.257
   [mindspore/ccsrc/cluster/topology/meta_server_node.cc:548] UpdateTopoState] The node: 1 is…`
   or from Python (mindspore/log.py) `[ERROR] ME(12345:139872,MainProcess):2026-11-23-09:00:00.123.456
   [mindspore/train/model.py:123] message`: its message, and its `file:line` as the location.
4. The last line with text (a log line's message when it is in MindSpore's format), passing over
   MindSpore's DEBUG and INFO lines: a process that printed why it exits logs its teardown after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from proto.vocabulary import CauseKind

MAX_MESSAGE_CHARS = 300

_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in .*)?$')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::(?P<text>.*))?$")
_MINDSPORE_LOG = re.compile(
    r"^\[(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\] \w+\(\d+[,:][^)]*\):"
    r"\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d\.\d+(?:\.\d*)? \[(?P<file>[^\]\s]+):(?P<line>\d+)\] "
    r"(?:[^\s\]]+\] )?(?P<message>.*)$")
_SECTION_LINE = re.compile(r"^-+$|^- .*:\s*$")  # MindSpore's "-----" rules and "- Kernel error:" titles
_LIBRARY_PATH = re.compile(r"/(?:site|dist)-packages/|/lib/python\d+\.\d+/|^<frozen ")
_TRAINERD_ROOT = Path(__file__).resolve().parents[1]
_TRAINERD_PACKAGES = tuple(f"{_TRAINERD_ROOT / package}/"
                           for package in ("agent", "common", "daemon", "proto", "trainer"))
_TRAINERD_EXAMPLES = f"{_TRAINERD_ROOT / 'trainer' / 'examples'}/"
_MESSAGE_BELOW_LINES = 10  # how far below an empty `RuntimeError: ` (or a section title) its text is looked for
_REFER_TO = re.compile(r"Refer to '(?P<section>[^']+)'")  # MindSpore naming the section that holds its error
_SECTION_SEARCH_LINES = 40  # how far below such an exception line the section is looked for
# The fault handler's report (Python's faulthandler module): its first line, then every Python thread's
# stack, most recent call first, the crashing thread's under its own header.
_FATAL_ERROR = re.compile(r"^Fatal Python error: \S")
_CURRENT_THREAD = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):$")
_FAULT_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+) in ')


@dataclass(frozen=True)
class RootCauseInLog:
    """The root cause read from a failed rank's log tail; the coordinator receives it as
    `daemon.job.observation.RootCause`."""

    kind: CauseKind
    message: str  # one line, at most MAX_MESSAGE_CHARS
    location: str | None  # "file:line"


def extract_root_cause(tail: str, work_dir: str | None = None) -> RootCauseInLog | None:
    """The root cause in a failed rank's output tail; None when the tail has no text at all.

    A location under `work_dir` is given relative to it (`train.py:42`), so the same script's
    error reads the same on every node.
    """
    lines = tail.splitlines()
    exception, crash = _python_exception(lines, work_dir), _fatal_error(lines, work_dir)
    if crash is not None and (exception is None or crash[0] > _last_frame(lines) and crash[1].location):
        return crash[1]
    return exception or _mindspore_error(lines) or _last_line(lines)


def _last_frame(lines: list[str]) -> int:
    """The index of the last line of a Python traceback in `lines`; -1 without one."""
    return next((index for index in range(len(lines) - 1, -1, -1) if _FRAME.match(lines[index])), -1)


def _python_exception(lines: list[str], work_dir: str | None) -> RootCauseInLog | None:
    last_frame = _last_frame(lines)
    if last_frame < 0:
        return None
    exception_at = next((index for index in range(last_frame + 1, len(lines))
                         if lines[index].strip() and not lines[index][0].isspace()
                         and not _MINDSPORE_LOG.match(lines[index])), None)
    if exception_at is None:
        return None
    exception = _EXCEPTION.match(lines[exception_at])
    if exception is None:
        return None
    message = lines[exception_at].rstrip()
    referred = _REFER_TO.search(exception["text"] or "")
    if referred is not None:
        # MindSpore's dataset pipeline: "Exception thrown from dataset pipeline. Refer to 'Dataset Pipeline
        # Error Message'." and the error itself under that section's title.
        title = f"- {referred['section']}:"
        below = lines[exception_at + 1:exception_at + 1 + _SECTION_SEARCH_LINES]
        at = next((index for index, line in enumerate(below) if line.strip() == title), None)
        text = None if at is None else _first_text(below[at + 1:at + 1 + _MESSAGE_BELOW_LINES])
        if text is not None:
            message = f"{exception['type']}: {text.removeprefix('[ERROR] ')}"
    elif exception["text"] is not None and not exception["text"].strip():
        text = _first_text(lines[exception_at + 1:exception_at + 1 + _MESSAGE_BELOW_LINES])
        if text is not None:
            message = f"{exception['type']}: {text}"
    frames = [_FRAME.match(line) for line in lines[_block_start(lines, last_frame):last_frame + 1]]
    paths = [(frame["path"], frame["line"]) for frame in frames if frame is not None]
    user = [frame for frame in paths if not _is_library(frame[0])]
    path, line = (user or paths)[-1]
    return RootCauseInLog(CauseKind.PYTHON_EXCEPTION, _one_line(message), f"{_relative(path, work_dir)}:{line}")


def _fatal_error(lines: list[str], work_dir: str | None) -> tuple[int, RootCauseInLog] | None:
    """The fault handler's last report in `lines`: where it starts, and the cause it gives (see the
    module docstring, 2)."""
    start = next((index for index in range(len(lines) - 1, -1, -1) if _FATAL_ERROR.match(lines[index])), None)
    if start is None:
        return None
    current = next((index for index in range(start + 1, len(lines)) if _CURRENT_THREAD.match(lines[index])), None)
    frames = []
    for line in [] if current is None else lines[current + 1:]:
        frame = _FAULT_FRAME.match(line)
        if frame is None:
            break
        frames.append((frame["path"], frame["line"]))
    user = [frame for frame in frames if not _is_library(frame[0])]
    innermost = (user or frames)[:1]  # the fault handler lists the most recent call first
    location = "".join(f"{_relative(path, work_dir)}:{line}" for path, line in innermost) or None
    return start, RootCauseInLog(CauseKind.FATAL_ERROR, _one_line(lines[start]), location)


def _first_text(lines: list[str]) -> str | None:
    """The first line of text that is not one of MindSpore's section rules or titles."""
    return next((line.strip() for line in lines if line.strip() and not _SECTION_LINE.match(line.strip())), None)


def _is_library(path: str) -> bool:
    if _LIBRARY_PATH.search(path):
        return True
    return path.startswith(_TRAINERD_PACKAGES) and not path.startswith(_TRAINERD_EXAMPLES)


def _block_start(lines: list[str], last_frame: int) -> int:
    """Where the traceback holding `last_frame` starts: after its header, or where the tail starts."""
    for index in range(last_frame, -1, -1):
        if lines[index].startswith("Traceback (most recent call last):"):
            return index + 1
    return 0


def _mindspore_error(lines: list[str]) -> RootCauseInLog | None:
    for line in reversed(lines):
        logged = _MINDSPORE_LOG.match(line)
        if logged is not None and logged["level"] in ("ERROR", "CRITICAL"):
            return RootCauseInLog(CauseKind.MINDSPORE_ERROR, _one_line(logged["message"]),
                                f"{logged['file']}:{logged['line']}")
    return None


def _last_line(lines: list[str]) -> RootCauseInLog | None:
    """The last line with text that is not MindSpore's DEBUG or INFO logging (what a process logs as it
    exits, after the line that said why); the last such log line when there is nothing else."""
    chatter = None
    for line in reversed(lines):
        text = line.strip()
        if not text or _SECTION_LINE.match(text):
            continue
        logged = _MINDSPORE_LOG.match(text)
        if logged is None:
            return RootCauseInLog(CauseKind.LAST_LINE, _one_line(text), None)
        cause = RootCauseInLog(CauseKind.LAST_LINE, _one_line(logged["message"]), f"{logged['file']}:{logged['line']}")
        if logged["level"] not in ("DEBUG", "INFO"):
            return cause
        chatter = chatter or cause
    return chatter


def _relative(path: str, work_dir: str | None) -> str:
    if work_dir:
        prefix = work_dir.rstrip("/") + "/"
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 1] + "…"
