"""``pdwire bootstrap``: run a bootstrap server (spec §4) in the foreground."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from pdwire.http_models import DEFAULT_BOOTSTRAP_PORT as DEFAULT_PORT
from pdwire.versions import CURRENT_VERSION, WIRE_VERSION

from .cli_common import EXIT_USAGE, add_key_options, read_keys, serve, standalone

if TYPE_CHECKING:  # the server (FastAPI, uvicorn) loads only when the command runs
    from .bootstrap import BootstrapServer


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
    add_key_options(
        p,
        "require registrations signed with the key in PATH (§8.6); the file's bytes are the "
        "key, less a trailing newline",
    )
    p.add_argument(
        "--legacy",
        action="store_true",
        help="behave like vLLM's server: drop pdwire/2 fields, no pdwire_version, no /health",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 on a clean stop, 1 if the server died, 2 on bad usage."""
    try:
        key, accepted = read_keys(args)
    except (OSError, ValueError) as exc:
        print(f"pdwire bootstrap: {exc}", file=sys.stderr)
        return EXIT_USAGE
    mode = "legacy" if args.legacy else "pdwire/2" + (", signed registrations" if key else "")

    def start() -> BootstrapServer:
        from .bootstrap import BootstrapServer

        version = WIRE_VERSION["legacy"] if args.legacy else CURRENT_VERSION
        keys = (key, *accepted) if key is not None else None
        return BootstrapServer(auth_key=keys, server_version=version).start(args.host, args.port)

    return serve("bootstrap", start, lambda server: f"bootstrap server ({mode}) at {server.url}")


def main(argv: list[str] | None = None) -> int:
    return standalone("bootstrap", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
