"""``pdwire proxy``: run the disaggregation proxy (spec §5.4) in the foreground."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from .cli_common import serve, standalone

if TYPE_CHECKING:  # the server (FastAPI, uvicorn, httpx) loads only when the command runs
    from .proxy import ProxyServer


DEFAULT_PORT = 8000  # vLLM's example proxy's
PROFILES = ("legacy", "pdwire/2")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``proxy`` subcommand to ``pdwire``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "proxy",
        help="run a disaggregation proxy",
        description="Run a disaggregation proxy (spec §5.4) until SIGINT or SIGTERM: each "
        "completion goes to a prefill engine (max_tokens 1) and, at the same time, to a decode "
        "engine that loads the prefill's KV and answers. Prints its URL once it serves.",
    )
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL[@BOOTSTRAP]",
        help="a prefill engine's OpenAI server (repeatable); BOOTSTRAP is its bootstrap "
        "server's URL, or a port on URL's host, or 'none'; default port 8998",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode engine's OpenAI server (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="pdwire/2",
        help="legacy: kv_transfer_params exactly as vLLM's proxy sends them; pdwire/2 (the "
        "default) adds pdwire_version",
    )
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="send 'Authorization: Bearer <key>' upstream, the key read from environment "
        "variable NAME (default: no Authorization header)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="bound on each completion leg (default: none, as vLLM's proxy)",
    )
    p.set_defaults(func=run)
    return p


def _api_key(name: str | None) -> str | None:
    if name is None:
        return None
    key = os.environ.get(name, "")
    if not key:
        raise ValueError(f"--api-key-env {name}: the variable is unset or empty")
    return key


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 on a clean stop, 1 if the server died, 2 on bad usage."""

    def start() -> ProxyServer:
        from .proxy import ProxyServer, parse_prefill

        prefills = [parse_prefill(spec) for spec in args.prefill]
        server = ProxyServer(
            prefills,
            args.decode,
            profile=args.profile,
            api_key=_api_key(args.api_key_env),
            client_timeout=args.timeout,
        )
        return server.start(args.host, args.port)

    return serve("proxy", start, lambda server: f"proxy ({server.proxy.profile}) at {server.url}")


def main(argv: list[str] | None = None) -> int:
    return standalone("proxy", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
