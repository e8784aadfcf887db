"""``Testee.print_stacks``: a reference node and each of its workers print their threads' stacks
to the node's log on SIGUSR1 (``pdwire node``), and serve on; nothing else under the node is
sent the signal."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from conformance import testees, warm_start

#: How long the stacks may take to reach the log on a busy machine, in seconds.
WAIT_S = 10.0


def _frames(text: str, file: str, function: str) -> int:
    """How many printed stacks have a frame of ``function`` in ``file``."""
    return len(re.findall(rf'File "[^"]*{re.escape(file)}", line \d+ in {function}\n', text))


@pytest.mark.parametrize("warm", [True, False], ids=["forked", "command"])
def test_a_node_and_its_workers_print_their_stacks_and_serve_on(
    warm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not warm:  # the workers come from a forkserver, which does not handle the signal
        monkeypatch.setenv(warm_start.ENV, "0")
    node = testees.start_node("prefill", tp=2)
    try:
        before = len(node.log_path.read_text())
        assert node.print_stacks() == 3  # the front and its two workers
        deadline = time.monotonic() + WAIT_S
        while True:
            printed = node.log_path.read_text()[before:]
            workers = _frames(printed, "reference_connector/worker_process.py", "serve")
            # A worker forked from the front has the front's frames under its own.
            front = _frames(printed, "reference_connector/cli_common.py", "serve") - warm * workers
            if (front, workers) == (1, 2) or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # a busy machine's workers print later: polling their log
        assert (front, workers) == (1, 2), printed
        assert httpx.get(f"{node.url}/health", timeout=5.0).status_code == 200
        assert node.alive()
    finally:
        node.stop()
    assert node.process.returncode == 0  # every process under it outlived the signal
