"""What the serving subcommands (``pdwire bootstrap``, ``node``, ``proxy``) share: start a
server, serve until SIGINT or SIGTERM, report how it ended; and running one standalone."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

if TYPE_CHECKING:  # uvicorn and FastAPI load only when a server starts
    from .http_server import AppServer

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_POLL_S = 0.5
#: ``kill -USR1`` on a server or one of its workers prints every thread's stack to its stderr.
STACKS_SIGNAL = signal.SIGUSR1


def print_stacks_on_signal() -> None:
    """Print every thread's Python stack to stderr on ``STACKS_SIGNAL``, from the signal handler
    itself: it shows where a process that stopped answering waits, even one whose threads are
    all blocked. A forked child inherits it."""
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)


A = TypeVar("A", bound="AppServer")


def add_key_options(p: argparse.ArgumentParser, key_help: str) -> None:
    """``--auth-key-file`` and ``--accept-key-file`` (§8.6)."""
    p.add_argument("--auth-key-file", metavar="PATH", help=key_help)
    p.add_argument(
        "--accept-key-file",
        metavar="PATH",
        action="append",
        default=[],
        help="also accept what is signed with the older key in PATH, while keys are rotated "
        "(8.6-R16; repeatable; needs --auth-key-file)",
    )


def read_keys(args: argparse.Namespace) -> tuple[bytes | None, tuple[bytes, ...]]:
    """The key of ``--auth-key-file`` and those of ``--accept-key-file``; ``ValueError`` or
    ``OSError`` naming the file when one cannot be used."""
    from pdwire.auth import read_key_file

    if args.accept_key_file and not args.auth_key_file:
        raise ValueError("--accept-key-file needs --auth-key-file")
    key = read_key_file(args.auth_key_file) if args.auth_key_file else None
    return key, tuple(read_key_file(path) for path in args.accept_key_file)


def serve(
    command: str,
    start: Callable[[], A],
    banner: Callable[[A], str],
    failures: tuple[type[BaseException], ...] = (RuntimeError, TimeoutError),
    *,
    duration: float | None = None,
    banner_stream: TextIO | None = None,
) -> int:
    """Start with ``start`` and serve until a signal (or ``duration`` seconds): 0 on a clean
    stop, 1 if the server died or failed to start (``failures``), 2 on bad usage (bind errors,
    bad values). The banner goes to ``banner_stream`` (stdout). ``STACKS_SIGNAL`` prints
    the stacks of this process's threads, and of its workers' (started by ``start``)."""
    print_stacks_on_signal()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # A SIGTERM while the server starts stops it once it has started; SIGINT still interrupts it.
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_signal)}
    try:
        try:
            server = start()
        except (OSError, ValueError) as exc:
            print(f"pdwire {command}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except failures as exc:
            print(f"pdwire {command}: {exc}", file=sys.stderr)
            return EXIT_FAILED
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_signal)
        return _serve_until(command, server, stop, banner(server), banner_stream, duration)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _serve_until(
    command: str,
    server: AppServer,
    stop: threading.Event,
    banner: str,
    banner_stream: TextIO | None,
    duration: float | None,
) -> int:
    """Serve until ``stop`` is set (or ``duration`` seconds), then stop ``server``."""
    print(banner, file=banner_stream or sys.stdout, flush=True)
    end = None if duration is None else time.monotonic() + duration
    try:
        while not stop.wait(_POLL_S if end is None else min(_POLL_S, end - time.monotonic())):
            if not server.alive:
                print(f"pdwire {command}: the server stopped serving", file=sys.stderr)
                return EXIT_FAILED
            if end is not None and time.monotonic() >= end:
                break
        return EXIT_OK
    finally:
        server.stop()


def standalone(
    command: str, add_parser: Callable[[Any], argparse.ArgumentParser], argv: Sequence[str] | None
) -> int:
    """Run one subcommand alone: ``python -m reference_connector.cli_<command>``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="pdwire")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)
