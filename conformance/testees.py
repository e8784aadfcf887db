"""Testees the harness starts itself: the reference P and D nodes (``pdwire node``) as child
processes on loopback with free ports, each with the environment the caller adds.

The harness never imports the reference connector: it only runs its command line.
"""

from __future__ import annotations

import contextlib
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

from . import stacks, warm_start
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
#: The signal on which a ``pdwire node`` and each of its workers print their threads' stacks.
STACKS_SIGNAL: Final = signal.SIGUSR1
#: How long the stacks of one process of a node may take to reach its log, in seconds; they
#: are taken to be all there once the log has not grown for STACKS_QUIET_S.
STACKS_WAIT_S: Final = 5.0
STACKS_QUIET_S: Final = 0.3


#: A process the harness started: a child, or a node the warm starter forked.
NodeProcess = subprocess.Popen[bytes] | warm_start.ForkedProcess


def reap_killed(process: NodeProcess) -> None:
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

    process: NodeProcess
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        return tail_of(self.log_path, lines)

    def alive(self) -> bool:
        return self.process.poll() is None

    def print_stacks(self) -> int:
        """Have the process, and each process under it that handles ``STACKS_SIGNAL`` (a
        ``pdwire node``'s workers do), print its threads' stacks to the log: where a testee
        that stopped answering waits. One process at a time, so that their lines do not mix:
        the next is asked once the log has grown and then not for ``STACKS_QUIET_S`` (at most
        ``STACKS_WAIT_S``; a process of a busy machine may print later). Returns the number of
        processes asked."""
        asked = 0
        for pid in process_tree(self.process.pid):
            if not _handles(pid, STACKS_SIGNAL):
                continue
            stacks.mark(self.log_path, pid)
            size = self._log_size()
            try:
                os.kill(pid, STACKS_SIGNAL)
            except ProcessLookupError:
                continue
            asked += 1
            self._wait_log_quiet(size)
        return asked

    def evidence(self, lines: int = 30) -> str:
        """The log's last ``lines``, ending with the stacks of the process's threads and its
        workers' when it still runs: what a failed test shows of where the process waits."""
        if self.alive():
            self.print_stacks()
        return self.log_tail(lines)

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _wait_log_quiet(self, size: int) -> None:
        """Wait until the log has grown past ``size`` and then not for ``STACKS_QUIET_S``."""
        deadline = time.monotonic() + STACKS_WAIT_S
        grew_at: float | None = None
        while time.monotonic() < deadline:
            now = self._log_size()
            if now != size:
                size, grew_at = now, time.monotonic()
            elif grew_at is not None and time.monotonic() - grew_at >= STACKS_QUIET_S:
                return
            time.sleep(0.05)  # another process writing its log: nothing to await

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


def tail_of(log: Path, lines: int) -> str:
    """The last ``lines`` of the log at ``log``; empty when it cannot be read."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (Linux's ``/proc``)."""
    found, i = [pid], 0
    while i < len(found):
        for task in Path(f"/proc/{found[i]}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                found += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return found


def _handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` (``SigCgt`` in ``/proc/PID/status``): any
    other process would end on it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@dataclasses.dataclass
class Testee(ChildProcess):
    """One running node."""

    role: Role
    url: str
    bootstrap: str  # "" for a decode node
    process: NodeProcess
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
        *NODE_COMMAND, "--role", role, "--port", str(port),
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
    port: int = 0,
    **command: Any,
) -> Testee:
    """Start a reference node (``node_command``'s ``command`` options) with its API on ``port``
    (0: a free one), without waiting for it. A prefill node serves its own bootstrap server on
    ``bootstrap_port`` (0: a free one), or registers at ``bootstrap``."""
    port = port or free_port()
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
    os.close(fd)
    process = _start(args, environ, Path(name))
    return Testee(role, f"http://127.0.0.1:{port}", bootstrap, process, Path(name))


#: What the reference node imports before it serves (the modules of ``python -m pdwire node``
#: and of its workers): ``warm_start`` imports them once, and forks each node.
NODE_MODULES: Final = (
    "pdwire.cli",
    "reference_connector.cli_node",
    "reference_connector.node_api",
    "reference_connector.worker_process",
    "reference_connector.worker_agents",
)


#: The command line of pdwire's commands: ``python -m pdwire COMMAND ...``.
PDWIRE_COMMAND: Final = (sys.executable, "-m", "pdwire")
#: The command line of the reference node: ``python -m pdwire node ...``.
NODE_COMMAND: Final = (*PDWIRE_COMMAND, "node")
#: The commands of ``PDWIRE_COMMAND`` that the warm starter forks, and the options it adds:
#: a forked node forks its workers in turn.
FORKED: Final = {"node": ("--worker-start", "fork"), "proxy": ()}


def fork_command(
    args: Sequence[str], environ: dict[str, str], log: Path, *, session: bool = False
) -> warm_start.ForkedProcess | None:
    """The reference node or proxy of command ``args`` (``PDWIRE_COMMAND``, one of ``FORKED``
    and its options) forked from a warm process (``warm_start``) that has imported
    ``NODE_MODULES`` and the modules ``environ`` names (``warm_start.MODULES_ENV``), in a session
    of its own with ``session``; None when ``args`` is another command, or warm starts are off
    or fail (with a line on stderr): the caller runs the command."""
    n = len(PDWIRE_COMMAND)
    if tuple(args[:n]) != PDWIRE_COMMAND or len(args) <= n or args[n] not in FORKED:
        return None
    if not warm_start.enabled():
        return None
    try:
        starter = warm_start.starter((*NODE_MODULES, *warm_start.modules_named(environ)))
        return starter.start([*args[2:], *FORKED[args[n]]], environ, log, session=session)
    except warm_start.WarmStartError as exc:
        print(f"pdwire conformance: {exc}; starting the {args[n]} as a command", file=sys.stderr)
        return None


def _start(args: list[str], environ: dict[str, str], log: Path) -> NodeProcess:
    """The node of command ``args``, forked (``fork_command``) or else run as that command."""
    forked = fork_command(args, environ, log)
    if forked is not None:
        return forked
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environ)
