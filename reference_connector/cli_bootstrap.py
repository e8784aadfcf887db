"""``pdwire bootstrap``: run a bootstrap server (spec §4) in the foreground."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from pdwire.versions import CURRENT_VERSION, WIRE_VERSION

if TYPE_CHECKING:  # the server (FastAPI, uvicorn) loads only when the command runs
    from .bootstrap import BootstrapServer


EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_PORT = 8998  # VLLM_MOONCAKE_BOOTSTRAP_PORT's default (4.4-R14)
_POLL_S = 0.5


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bootstrap`` subcommand to ``pdwire``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bootstrap",
        help="run a bootstrap server",
        description="Run a bootstrap server (spec §4) until SIGINT or SIGTERM: P workers "
        "POST /register their side-channel address, D workers and the proxy GET /query. "
        "Prints its URL once it serves.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--auth-key-file",
        metavar="PATH",
        help="require registrations signed with the key in PATH (§8.6); the file's bytes are "
        "the key, less a trailing newline",
    )
    p.add_argument(
        "--legacy",
        action="store_true",
        help="behave like vLLM's server: drop pdwire/2 fields, no pdwire_version, no /health",
    )
    p.set_defaults(func=run)
    return p


def _read_key(path: str) -> bytes:
    key = Path(path).read_bytes().rstrip(b"\r\n")
    if not key:
        raise ValueError(f"{path}: the auth key file is empty")
    return key


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 on a clean stop, 1 if the server died, 2 on bad usage."""
    try:
        key = _read_key(args.auth_key_file) if args.auth_key_file else None
        version = WIRE_VERSION["legacy"] if args.legacy else CURRENT_VERSION
        from .bootstrap import BootstrapServer

        server = BootstrapServer(auth_key=key, server_version=version)
        server.start(args.host, args.port)
    except (OSError, ValueError) as exc:
        print(f"pdwire bootstrap: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdwire bootstrap: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return _serve(server, legacy=args.legacy, signed=key is not None)


def _serve(server: BootstrapServer, *, legacy: bool, signed: bool) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    mode = "legacy" if legacy else "pdwire/2" + (", signed registrations" if signed else "")
    print(f"bootstrap server ({mode}) at {server.url}", flush=True)
    try:
        while not stop.wait(_POLL_S):
            if not server.alive:
                print("pdwire bootstrap: the server thread exited", file=sys.stderr)
                return EXIT_FAILED
        return EXIT_OK
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand alone: ``python -m reference_connector.cli_bootstrap``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="pdwire")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bootstrap", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
