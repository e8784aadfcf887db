"""Testees the harness starts itself: the reference P and D nodes (``pdwire node``) as child
processes on loopback with free ports, each with the environment the caller adds.

The harness never imports the reference connector: it only runs its command line.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from pdwire.roles import Role

from .peers.http import client_tls
from .ports import free_port

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 4, 16, 4


def geometry(kv_heads: int = KV_HEADS) -> tuple[str, ...]:
    """The reference testees' KV geometry (small, so a run moves little memory) as node flags,
    with ``kv_heads`` KV heads."""
    return (
        "--layers", str(LAYERS), "--kv-heads", str(kv_heads), "--head-dim", str(HEAD_DIM),
        "--block-size", str(BLOCK_SIZE),
    )  # fmt: skip


GEOMETRY: Final = geometry()
#: The reference testees' VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT: short, so timer cases are quick.
ABORT_TIMEOUT: Final = 2.0


#: How long a process may take to be reaped after its SIGKILL: seconds, unless the machine
#: itself stalls (a stalled virtual machine's clock jumps past every bound when it runs again).
KILL_WAIT_S: Final = 5.0


def reap_killed(process: subprocess.Popen[bytes]) -> None:
    """Wait for ``process``, sent SIGKILL, to end. One not reaped within ``KILL_WAIT_S`` is left
    to end (it cannot outlive its SIGKILL) with a line on stderr: the run that stopped it still
    ends with its report."""
    try:
        process.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        print(
            f"pdwire conformance: process {process.pid} was not reaped {KILL_WAIT_S}s after "
            "SIGKILL; going on without it",
            file=sys.stderr,
        )


class TesteeError(RuntimeError):
    """A testee did not start; the message holds the tail of its log."""


class ChildProcess:
    """A process the harness started, its output in ``log_path``."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds (``reap_killed``); the log goes."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                reap_killed(self.process)
        self.log_path.unlink(missing_ok=True)


@dataclasses.dataclass
class Testee(ChildProcess):
    """One running node."""

    role: Role
    url: str
    bootstrap: str  # "" for a decode node
    process: subprocess.Popen[bytes]
    log_path: Path

    def settled(self, timeout: float) -> bool:
        """Whether the node is healthy and holds no block within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0, verify=client_tls()) as http:
            while True:
                try:
                    healthy = http.get(f"{self.url}/health").status_code == 200
                    stats = http.get(f"{self.url}/pdwire/stats").json()
                    if healthy and stats.get("blocks_in_use") == 0:
                        return True
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() >= deadline or not self.alive():
                    return False
                time.sleep(0.1)  # polling another process's counters: nothing to await

    def wait_healthy(self, timeout: float) -> None:
        """Wait until the node answers ``/health``; stop it and raise ``TesteeError`` if it
        exits or does not answer within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, verify=client_tls()) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    tail = self.log_tail()
                    self.stop()
                    raise TesteeError(
                        f"the {self.role} node exited with {self.process.returncode}:\n{tail}"
                    )
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)  # polling a child process for readiness: nothing to await
        tail = self.log_tail()
        self.stop()
        raise TesteeError(f"the {self.role} node did not answer /health within {timeout}s:\n{tail}")


#: In a node's log when another process took a port between its choice and its bind (the
#: Mooncake engine picks its listeners' ports itself): the start is tried once more.
PORT_TAKEN: Final = "Address already in use"


def start_node(role: Role, *, timeout: float = 120.0, **options: Any) -> Testee:
    """Start a reference node (``spawn_node``'s ``options``) and wait until it answers
    ``/health``; once more on new ports when one of its ports was taken while it started."""
    testee = spawn_node(role, **options)
    try:
        testee.wait_healthy(timeout)
    except TesteeError as exc:
        if PORT_TAKEN not in str(exc):
            raise
        testee = spawn_node(role, **options)
        testee.wait_healthy(timeout)
    return testee


def node_command(
    role: Role,
    port: int,
    *,
    bootstrap: str = "",
    bootstrap_port: int = 0,
    tp: int = 1,
    pp: int = 1,
    profile: str = "pdwire/2",
    extra: Sequence[str] = (),
    abort_timeout: float = ABORT_TIMEOUT,
    geometry: Sequence[str] = GEOMETRY,
) -> list[str]:
    """The command line of a reference node whose API is on ``port``. A prefill node
    registers at ``bootstrap``, or serves its own bootstrap server on ``bootstrap_port``."""
    args = [
        sys.executable, "-m", "pdwire", "node", "--role", role, "--port", str(port),
        "--tp", str(tp), "--pp", str(pp), "--profile", profile, *geometry,
        "--num-blocks", "256", "--abort-timeout", str(abort_timeout), *extra,
    ]  # fmt: skip
    if role == "prefill" and bootstrap:
        args += ["--bootstrap", bootstrap]
    elif role == "prefill" and bootstrap_port:
        args += ["--bootstrap-port", str(bootstrap_port)]
    return args


def spawn_node(
    role: Role,
    *,
    abort_timeout: float = ABORT_TIMEOUT,
    env: dict[str, str] | None = None,
    bootstrap: str = "",
    bootstrap_port: int = 0,
    **command: Any,
) -> Testee:
    """Start a reference node (``node_command``'s ``command`` options), without waiting for
    it. A prefill node serves its own bootstrap server on ``bootstrap_port`` (0: a free one), or
    registers at ``bootstrap``."""
    port = free_port()
    if role == "prefill" and not bootstrap:
        bootstrap_port = bootstrap_port or free_port()
    args = node_command(
        role,
        port,
        bootstrap=bootstrap,
        bootstrap_port=bootstrap_port,
        abort_timeout=abort_timeout,
        **command,
    )
    if role == "prefill" and not bootstrap:
        bootstrap = f"http://127.0.0.1:{bootstrap_port}"
    fd, name = tempfile.mkstemp(prefix=f"pdwire-testee-{role}-", suffix=".log")
    environ = {
        **os.environ,
        "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
        "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(round(abort_timeout)),
        **(env or {}),
    }
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=environ)
    return Testee(role, f"http://127.0.0.1:{port}", bootstrap, process, Path(name))
