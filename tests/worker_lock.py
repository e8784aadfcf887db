"""A lock that the pytest-xdist workers of one run share: a module that must not run beside
another holds it for its whole run (``tests/conftest.py`` says which modules take it)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

#: The release tier's vLLM nodes and the vLLM servers of tests/vllm_connector/test_e2e.py.
VLLM: Final = "vllm"
WAIT_S: Final = 1200.0
_POLL_S: Final = 0.2


@contextlib.contextmanager
def held(factory: pytest.TempPathFactory, name: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold the run's lock ``name``, waiting for the worker that holds it at most ``wait_s``.
    Without xdist a run has one process and no lock is taken."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    # the workers' base folders (popen-gwN) share the run's own folder
    with hold(factory.getbasetemp().parent / f"{name}.lock", wait_s):
        yield


@contextlib.contextmanager
def hold(path: Path, wait_s: float) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path``, waiting for its holder at most ``wait_s``."""
    deadline = time.monotonic() + wait_s
    with path.open("a") as file:
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process held the lock {path} for {wait_s:g}s"
                    ) from None
                time.sleep(_POLL_S)  # another process's lock: nothing to await
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)
