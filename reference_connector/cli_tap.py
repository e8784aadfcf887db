"""``pdwire tap``: show the live side channel between a running D and P."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import TYPE_CHECKING, Any

from pdwire.observer import summary_table

from .cli_common import EXIT_USAGE, serve, standalone

if TYPE_CHECKING:  # the server (FastAPI, uvicorn, pyzmq) loads only when the command runs
    from .tap import TapServer


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``tap`` subcommand to ``pdwire``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "tap",
        help="show the live side channel between a running D and P",
        description="Serve a bootstrap front before P's bootstrap server: /query answers with "
        "relay addresses of the tap's own, and every side-channel message between D and P "
        "goes through the tap unchanged. Point D at the tap by its remote_bootstrap_addr: "
        "run the proxy with --prefill P_URL@TAP_URL. Each message is printed to stdout as a "
        "JSON line (timestamp, direction, connection, P worker, D worker, kind, the message "
        "decoded, and for a reply the message it answers and after how long); a message the "
        "tap cannot decode is printed raw with the decode error. On SIGINT, SIGTERM or the end "
        "of --duration, a summary line per transfer (pulls, replies, blocks and bytes asked "
        "for, time from first pull to last reply, verdict) goes to stdout, and a table of "
        "them to stderr. Needs pdwire[runtime].",
    )
    p.add_argument(
        "--bootstrap", required=True, metavar="URL", help="P's bootstrap server (http://host:port)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default: a free one)")
    p.add_argument(
        "--relay-host",
        default="127.0.0.1",
        help="address the relays bind and give D (default 127.0.0.1)",
    )
    p.add_argument("--follow", metavar="TRANSFER_ID", help="print only this transfer's messages")
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Tap until SIGINT, SIGTERM or ``--duration``; then print the summary."""
    if args.duration is not None and args.duration <= 0:
        print("pdwire tap: --duration must be positive", file=sys.stderr)
        return EXIT_USAGE
    out = sys.stdout
    lock = threading.Lock()

    def sink(record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with lock:
            out.write(line + "\n")
            out.flush()

    taps: list[TapServer] = []

    def start() -> TapServer:
        from .tap import TapServer

        tap = TapServer(args.bootstrap, sink, follow=args.follow, relay_host=args.relay_host)
        taps.append(tap.start(args.host, args.port))
        return tap

    code = serve(
        "tap",
        start,
        lambda tap: (
            f"pdwire tap: bootstrap front at {tap.url} for {tap.upstream}; "
            f"give D {tap.url} as remote_bootstrap_addr (pdwire proxy --prefill P_URL@{tap.url})"
        ),
        duration=args.duration,
        banner_stream=sys.stderr,
    )
    if taps:
        rows = taps[0].summary()
        for row in rows:
            sink({"summary": row})
        print(summary_table(rows), file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    return standalone("tap", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
