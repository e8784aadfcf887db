"""Testees the harness tests share: P nodes that stop serving on a malformed pull."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conformance import ports, testees
from mutants import preload


@pytest.fixture
def crashing_p() -> Iterator[testees.Testee]:
    p = testees.start_node("prefill", env=preload.environ("crash-on-malformed"))
    try:
        yield p
    finally:
        p.stop()


#: A P's API and bootstrap URLs, and the shell command that (re)starts it.
Restartable = tuple[str, str, str]


@pytest.fixture
def restartable_p(tmp_path: Path) -> Iterator[Restartable]:
    """A crash-on-malformed P started, as a user starts a server, by a shell command that puts
    it in the background (``setsid``) and records its pid; the same command restarts it on the
    same ports."""
    api, boot = ports.free_port(), ports.free_port()
    node = testees.node_command("prefill", api, bootstrap_port=boot)
    env = [f"{k}={v}" for k, v in preload.environ("crash-on-malformed").items()]
    pid, log = tmp_path / "p.pid", tmp_path / "p.log"
    start = f"setsid env {shlex.join([*env, *node])} >> {log} 2>&1 < /dev/null & echo $! > {pid}"
    subprocess.run(start, shell=True, check=True, timeout=10)
    try:
        url = f"http://127.0.0.1:{api}"
        _wait_healthy(url)
        yield url, f"http://127.0.0.1:{boot}", start
    finally:
        _stop_group(int(pid.read_text()))


def _wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not healthy after {timeout}s"
        time.sleep(0.2)


def _stop_group(pid: int, timeout: float = 15.0) -> None:
    """SIGTERM to the process group ``setsid`` made, then SIGKILL; bounded."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
