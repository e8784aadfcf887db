"""Applying mutants to processes from outside, through their environment.

A process started with ``environ(NAME)`` imports ``startup/sitecustomize.py`` at start-up, which
applies mutant NAME before the process runs anything; the processes it starts inherit the
environment, and so the mutant. With ``environ(switch=DIR)``, each such process also serves a
Unix socket ``DIR/PID.sock`` on which ``switch`` sets the mutant it applies ("" = none).
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
from pathlib import Path

import mutants

MUTANT_ENV = "PDWIRE_MUTANT"
SWITCH_ENV = "PDWIRE_MUTANT_SWITCH"
#: Holds the ``sitecustomize`` that applies them, and the folder ``mutants`` is in.
PATH = (Path(__file__).resolve().parent / "startup", Path(__file__).resolve().parents[1])
OK = "ok"


def environ(name: str = "", switch: Path | None = None) -> dict[str, str]:
    """The variables that make a process and those it starts apply mutant ``name``; with
    ``switch``, serve switching in that folder."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join([*map(str, PATH), *rest]), MUTANT_ENV: name}
    if switch is not None:
        env[SWITCH_ENV] = str(switch)
    return env


def start() -> None:
    """Apply the mutant the environment names, and serve switching if it asks for it: in this
    process, and in each process forked from it (a node's forkserver forks its workers)."""
    mutants.apply(os.environ.get(MUTANT_ENV, ""))
    folder = os.environ.get(SWITCH_ENV)
    if folder:
        _serve_switching(Path(folder))
        os.register_at_fork(after_in_child=lambda: _serve_switching(Path(folder)))


_listener: socket.socket | None = None


def _serve_switching(folder: Path) -> None:
    global _listener
    if _listener is not None:  # the parent's, inherited by a fork: it serves the parent
        _listener.close()
    path = folder / f"{os.getpid()}.sock"
    _listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _listener.bind(str(path))  # before the process goes on: a switch after its start finds it
    _listener.listen()
    atexit.register(_unlink_own, path, os.getpid())
    threading.Thread(target=_serve, args=(_listener,), name="mutant-switch", daemon=True).start()


def _unlink_own(path: Path, pid: int) -> None:
    """At exit, remove ``path`` if this is the process that bound it: a forked child inherits
    its parent's exit handlers, and must not remove the socket its parent still serves."""
    if os.getpid() == pid:
        path.unlink(missing_ok=True)


def _serve(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        with conn:
            name = _read_line(conn)
            try:
                mutants.apply(name)
                answer = OK
            except Exception as exc:  # whatever a patch raised goes back to the switch
                answer = f"{type(exc).__name__}: {exc}"
            conn.sendall(answer.encode() + b"\n")


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def switch(folder: Path, name: str, timeout: float = 30.0) -> int:
    """Make every live process serving in ``folder`` apply mutant ``name`` ("" = none); how
    many did. ``RuntimeError`` when one refused, or none serves there."""
    done = 0
    for path in sorted(folder.glob("*.sock")):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout)
                conn.connect(str(path))
                conn.sendall(name.encode() + b"\n")
                answer = _read_line(conn)
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # its process has exited
            continue
        if answer != OK:
            raise RuntimeError(f"process {path.stem} did not switch to mutant {name!r}: {answer}")
        done += 1
    if not done:
        raise RuntimeError(f"no process serves mutant switching in {folder}")
    return done
