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
    same ports. Started once more on new ports when one of its ports was taken while it started
    (``testees.start_node`` does the same)."""
    pid, log = tmp_path / "p.pid", tmp_path / "p.log"
    env = [f"{k}={v}" for k, v in preload.environ("crash-on-malformed").items()]
    for attempt in (1, 2):
        api, boot = ports.free_port(), ports.free_port()
        node = testees.node_command("prefill", api, bootstrap_port=boot)
        start = (
            f"setsid env {shlex.join([*env, *node])} >> {log} 2>&1 < /dev/null & echo $! > {pid}"
        )
        log.write_text("")
        subprocess.run(start, shell=True, check=True, timeout=10)
        url = f"http://127.0.0.1:{api}"
        try:
            _wait_healthy(url, int(pid.read_text()), log)
            break
        except AssertionError:
            _stop_group(int(pid.read_text()))
            if attempt == 2 or testees.PORT_TAKEN not in log.read_text(errors="replace"):
                raise
    try:
        yield url, f"http://127.0.0.1:{boot}", start
    finally:
        _stop_group(int(pid.read_text()))


def _wait_healthy(url: str, pid: int, log: Path, timeout: float = 60.0) -> None:
    """Until the node at ``url`` answers ``/health``; fails at once, with its log, if its
    process group ``pid`` is gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        alive = _alive(pid)
        if not alive or time.monotonic() >= deadline:
            why = f"did not answer /health within {timeout}s" if alive else "exited"
            raise AssertionError(f"the node at {url} {why}:\n{testees.tail_of(log, 30)}")
        time.sleep(0.2)  # polling another process for readiness: nothing to await


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(pid: int, timeout: float = 15.0) -> None:
    """SIGTERM to the process group ``setsid`` made, then SIGKILL; bounded."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.1)
