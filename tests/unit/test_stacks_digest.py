"""``conformance.stacks.digest``: a process's stacks, as ``faulthandler`` prints them, read
back as a line per thread."""

from __future__ import annotations

import faulthandler
import tempfile
import threading
from pathlib import Path

from conformance import stacks


def _parked(entered: threading.Event, release: threading.Event) -> None:
    entered.set()
    release.wait(10.0)


def test_a_line_per_process_then_per_thread_with_its_own_frames() -> None:
    entered, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_parked, args=(entered, release))
    worker.start()
    try:
        assert entered.wait(10.0)
        with tempfile.TemporaryDirectory() as folder:
            log = Path(folder) / "node.log"
            log.write_text("a line of the node's own\n")
            stacks.mark(log, 4242)
            with log.open("a") as out:
                faulthandler.dump_traceback(out, all_threads=True)
            out_text = log.read_text()
    finally:
        release.set()
        worker.join(10.0)
    lines = stacks.digest(out_text, own=("/tests/unit/",))
    assert lines[0] == "process 4242:"
    # a line for each thread faulthandler printed (pytest-xdist's own threads among them)
    threads = sum(1 for x in out_text.splitlines() if x.startswith(("Thread 0x", "Current thread")))
    assert threads >= 2 and len(lines) == 1 + threads, lines
    parked = [line for line in lines if "_parked" in line]
    assert len(parked) == 1, lines
    # its innermost frame is the wait; then this module's frame that parked it
    assert parked[0].split(": ", 1)[1].startswith("threading.py:"), parked
    waits_at = _parked.__code__.co_firstlineno + 2
    assert parked[0].endswith(f"< test_stacks_digest.py:{waits_at} _parked"), parked
    main = [line for line in lines if line.startswith("  main: ")]
    assert len(main) == 1 and "test_stacks_digest.py:" in main[0], lines


def test_lines_that_are_not_stacks_end_a_thread_and_are_left_out() -> None:
    text = "\n".join(
        [
            f"{stacks.MARK} 7",
            "Thread 0x00007f00 (most recent call first):",
            '  File "/x/reference_connector/agent.py", line 3 in run',
            "",
            "INFO something else",
            '  File "/x/pdwire/a.py", line 9 in f',
        ]
    )
    assert stacks.digest(text) == ["process 7:", "  0x00007f00: agent.py:3 run"]
