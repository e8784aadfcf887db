"""Reference nodes forked from a warm process, their modules imported once.

The harness starts many reference nodes (the mutant check about sixty, ``self`` about twenty),
and a node's start is mostly importing its modules, torch above all: about 2 s of CPU each. The
starter (``python -m conformance.warm_start SOCKET MODULE...``) imports the modules it is given,
then forks a node for each request on its Unix socket; the node forks its workers in turn
(``pdwire node --worker-start fork``). The harness still imports nothing of the reference
connector: it names the modules, and the starter imports them.

A forked node starts as its command would: its environment replaces the starter's before its
command line runs, its output goes to its log, and a ``sitecustomize`` module in a folder its
``PYTHONPATH`` adds runs as Python's start-up runs it (the mutants are applied so). The starter
reports each node's exit status on the request's connection, which ``ForkedProcess`` reads: the
harness handles a forked node as it handles a child process.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

#: Set to "0", the harness starts its reference nodes as commands, each importing its modules.
ENV: Final = "PDWIRE_WARM_START"
#: In a node's environment, more modules (comma-separated) for its starter to import: a node
#: whose agent imports a heavy package (vLLM) forks from a starter that has imported it.
MODULES_ENV: Final = "PDWIRE_WARM_MODULES"
#: How long the starter may take to import its modules and listen.
READY_S: Final = 120.0


class WarmStartError(RuntimeError):
    """The starter did not start or does not answer."""


class ForkedProcess:
    """A node the starter forked, handled as ``subprocess.Popen`` handles a child: its exit
    status is the starter's report (a negative signal number for a node a signal ended)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buf = b""
        self.pid = 0  # the starter's first line
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> bytes | None:
        """The starter's next line on this node's connection: None if none came within
        ``timeout``, ``b""`` once the starter has closed it."""
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                chunk = self._conn.recv(64)
                if not chunk:
                    return b""
                self._buf += chunk
        except (TimeoutError, BlockingIOError):
            return None
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        line = self._line(timeout)
        if line is None:
            return
        self.returncode = int(line) if line else -9  # the starter is gone: it reports no status
        self._conn.close()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"node {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Starter:
    """The harness's end of one starter process, started with ``modules`` imported."""

    def __init__(self, modules: Sequence[str]) -> None:
        self._folder = tempfile.mkdtemp(prefix="pdwire-warm-start-")
        self._path = str(Path(self._folder) / "starter.sock")
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, self._path, *modules],
            stdout=subprocess.PIPE,
        )
        assert self._process.stdout is not None
        ready = selectors.DefaultSelector()
        ready.register(self._process.stdout, selectors.EVENT_READ)
        if not ready.select(READY_S) or self._process.stdout.readline() != b"ready\n":
            self.close()
            raise WarmStartError(f"the starter did not start (exit {self._process.poll()})")

    def start(
        self, argv: Sequence[str], env: dict[str, str], log: Path, *, session: bool = False
    ) -> ForkedProcess:
        """Fork ``python -m ARGV`` (``argv`` without the interpreter and ``-m``) with ``env``
        as its whole environment, its output appended to ``log``; with ``session``, in a
        session of its own, so that a signal to its process group reaches only it and its
        children."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        process = ForkedProcess(conn)
        try:
            conn.settimeout(READY_S)
            conn.connect(self._path)
            request = {"argv": list(argv), "env": env, "log": str(log), "session": session}
            conn.sendall(json.dumps(request).encode() + b"\n")
            line = process._line(READY_S)
        except OSError as exc:
            conn.close()
            raise WarmStartError(f"the starter did not fork {argv[0]}: {exc}") from exc
        if not line:
            conn.close()
            why = "no answer" if line is None else "the starter closed the connection"
            raise WarmStartError(f"the starter did not fork {argv[0]}: {why}")
        process.pid = int(line)
        return process

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


_lock = threading.Lock()
_starters: dict[tuple[str, ...], Starter] = {}


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def modules_named(env: dict[str, str]) -> tuple[str, ...]:
    """The modules ``env`` names in ``MODULES_ENV``."""
    return tuple(m for m in (n.strip() for n in env.get(MODULES_ENV, "").split(",")) if m)


def starter(modules: Sequence[str]) -> Starter:
    """This process's starter of ``modules``, started on first use, stopped at exit."""
    key = tuple(modules)
    with _lock:
        if key not in _starters:
            _starters[key] = Starter(modules)
            atexit.register(_starters[key].close)
        return _starters[key]


# -- the starter process -----------------------------------------------------------------------


def serve(path: str, modules: Sequence[str]) -> None:
    """Import ``modules``, then fork a node for each request on ``path`` and report its exit
    status on the request's connection. One thread only: a fork copies no other."""
    for name in modules:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears it
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ, "request")
    events.register(wake_r, selectors.EVENT_READ, "exited")
    nodes: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in events.select():
            if key.data == "request":
                conn, _ = listener.accept()
                request = json.loads(conn.makefile("rb").readline())
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_node(request, [listener, conn, wake_r, wake_w])
                nodes[pid] = conn
                with contextlib.suppress(OSError):
                    conn.sendall(f"{pid}\n".encode())
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _report_exited(nodes)


def _report_exited(nodes: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = nodes.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _run_node(request: dict[str, Any], inherited: list[socket.socket | int]) -> None:
    """The forked node: the starter's sockets closed, its own environment, output and
    start-up, then its command line; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        if request.get("session"):
            os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        for item in inherited:
            if isinstance(item, int):
                os.close(item)
            else:
                item.close()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(request["env"])
        _start_up(os.environ.get("PYTHONPATH", ""))
        sys.argv = ["-m", *request["argv"][1:]]
        runpy.run_module(request["argv"][0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start_up(pythonpath: str) -> None:
    """What Python's start-up does with ``pythonpath`` that the starter's did not: its new
    folders go first on ``sys.path``, and the first ``sitecustomize`` among them runs."""
    new = [f for f in pythonpath.split(os.pathsep) if f and f not in sys.path]
    sys.path[:0] = new
    for folder in new:
        custom = Path(folder) / "sitecustomize.py"
        if custom.is_file():
            runpy.run_path(str(custom), run_name="sitecustomize")
            return


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
