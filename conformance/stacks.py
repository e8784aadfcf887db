"""The stacks a testee's processes print to its log (``ChildProcess.print_stacks``), read back
short: a failed test's report shows first, in a few lines per process, where each thread waits,
as CI keeps only part of a long report."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Final

#: The line the harness appends to a log before a process's stacks: ``MARK PID``.
MARK: Final = "== stacks of process"
#: Folders of the code a digest names besides each thread's innermost frame.
OWN_CODE: Final = ("/pdwire/", "/reference_connector/", "/conformance/", "/vllm/")

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^  File "(?P<path>.+)", line (?P<line>\d+) in (?P<func>.+)$')


def mark(log: Path, pid: int) -> None:
    """Append the line that heads the stacks of process ``pid`` to ``log``."""
    with log.open("a") as out:
        out.write(f"{MARK} {pid}\n")


def _frame(match: re.Match[str]) -> str:
    return f"{Path(match['path']).name}:{match['line']} {match['func']}"


def digest(text: str, own: Sequence[str] = OWN_CODE, frames: int = 2) -> list[str]:
    """A line per process whose stacks ``text`` holds (after its ``MARK`` line), then a line
    per thread: its innermost frame and the innermost ``frames`` frames of code under ``own``."""
    lines: list[str] = []
    thread: list[str] = []
    inner: str | None = None

    def end_thread() -> None:
        nonlocal inner
        if thread:
            lines.append(f"  {thread[0]}: {inner or '?'}" + "".join(f" < {f}" for f in thread[1:]))
        thread.clear()
        inner = None

    for line in text.splitlines():
        if line.startswith(MARK):
            end_thread()
            lines.append(f"process {line[len(MARK) :].strip()}:")
        elif found := _THREAD.match(line):
            end_thread()
            thread.append("main" if found[1] == "Current thread" else found[2])
        elif thread and (frame := _FRAME.match(line)):
            if inner is None:
                inner = _frame(frame)
            elif len(thread) <= frames and any(folder in frame["path"] for folder in own):
                thread.append(_frame(frame))
        else:
            end_thread()
    end_thread()
    return lines
