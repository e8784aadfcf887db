"""``pdwire run``: start a whole P/D deployment on loopback, send requests, check every byte and
every text, and print what it measured (``reference_connector.run``)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

from pdwire.versions import LEGACY, PDWIRE_2

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: The level of the Mooncake transfer engine's own log: errors only, unless --verbose or the
#: caller set it (ERROR is its highest).
_MOONCAKE_LOG_LEVEL = "MC_LOG_LEVEL"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``pdwire``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "run",
        help="run a P/D deployment on loopback and verify it byte by byte",
        description="Start a P node (with its bootstrap server), a D node and the proxy on "
        "127.0.0.1, send streamed completions through the proxy (greedy), check that every "
        "text equals the reference completion and that D verified every KV byte, and print "
        "TTFT (split into proxy, P prefill, wait, transfer and D), transfer GB/s against the "
        "raw transfer engine's for the same descriptors, and descriptors per request. "
        "Progress goes to stderr, the summary to stdout. Exit status 0 only when every "
        "request verified. Defaults: the seeds' case (Qwen3-8B KV geometry, 1000-token "
        "prompts, max_tokens 128).",
    )
    load = p.add_argument_group("requests")
    load.add_argument("--requests", type=int, default=8, help="requests to send (default 8)")
    load.add_argument("--concurrency", type=int, default=2, help="in flight at once (default 2)")
    load.add_argument(
        "--prompt-tokens", type=int, default=1000, help="prompt length (default 1000)"
    )
    load.add_argument("--max-tokens", type=int, default=128, help="tokens to decode (default 128)")
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts' words (default 0)")
    load.add_argument(
        "--timeout", type=float, default=300.0, help="seconds any one request may take (300)"
    )
    split = p.add_argument_group("parallelism and protocol")
    split.add_argument("--prefill-tp", type=int, default=1, help="P's TP size (default 1)")
    split.add_argument("--decode-tp", type=int, default=1, help="D's TP size (default 1)")
    split.add_argument("--prefill-pp", type=int, default=1, help="P's PP size (default 1)")
    split.add_argument("--decode-pp", type=int, default=1, help="D's PP size (default 1)")
    split.add_argument("--profile", choices=(LEGACY, PDWIRE_2), default=PDWIRE_2)
    for side in ("prefill", "decode"):
        split.add_argument(
            f"--{side}-agent",
            metavar="MODULE:CALLABLE",
            default="",
            help=f"the {side} workers' side-channel agent factory (default: pdwire's own); "
            "see pdwire node --agent",
        )
    geometry = p.add_argument_group("KV geometry (default: Qwen3-8B, bfloat16)")
    geometry.add_argument("--layers", type=int, default=36)
    geometry.add_argument("--kv-heads", type=int, default=8)
    geometry.add_argument("--head-dim", type=int, default=128)
    geometry.add_argument("--block-size", type=int, default=16)
    geometry.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="blocks per worker pool (default: enough for twice --concurrency requests)",
    )
    p.add_argument(
        "--raw-repeats", type=int, default=5, help="raw engine writes to time (best counts; 5)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log INFO, and Mooncake's own INFO log (default: warnings; Mooncake's errors)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """0 when every request verified; 1 when one did not or the deployment failed; 2 on bad
    usage; 130 on Ctrl-C (or SIGTERM). Everything started is stopped in every case."""
    from .run import RunConfig, run_deployment, write_json

    try:
        config = RunConfig(
            requests=args.requests,
            concurrency=args.concurrency,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            prefill_pp=args.prefill_pp,
            decode_pp=args.decode_pp,
            profile=LEGACY if args.profile == LEGACY else PDWIRE_2,
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            seed=args.seed,
            raw_repeats=args.raw_repeats,
            request_timeout=args.timeout,
            prefill_agent=args.prefill_agent,
            decode_agent=args.decode_agent,
        )
    except ValueError as exc:
        print(f"pdwire run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet = _MOONCAKE_LOG_LEVEL not in os.environ and not args.verbose
    if quiet:  # the workers inherit it: they start after this
        os.environ[_MOONCAKE_LOG_LEVEL] = "ERROR"
    previous = _sigterm_interrupts()
    try:
        report = run_deployment(config)
    except KeyboardInterrupt:
        print("pdwire run: interrupted; everything started was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RuntimeError, OSError) as exc:  # RunError, WorkerError, TimeoutError, bind errors
        print(f"pdwire run: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if quiet:
            os.environ.pop(_MOONCAKE_LOG_LEVEL, None)
    print(report.summary(), flush=True)
    if args.json:
        try:
            write_json(report, args.json)
        except OSError as exc:
            print(f"pdwire run: cannot write --json {args.json}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return report.exit_code


def _sigterm_interrupts() -> Any:
    """Make SIGTERM stop the run as Ctrl-C does; the previous handler (None off the main
    thread, where signals cannot be handled)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand alone: ``python -m reference_connector.cli_run``."""
    parser = argparse.ArgumentParser(prog="pdwire")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["run", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
