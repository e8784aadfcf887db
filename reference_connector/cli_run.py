"""``pdwire run``: start a whole P/D deployment on loopback, send requests, check every byte and
every text, and print what it measured (``reference_connector.run``); with ``--soak``, load it
for minutes with faults injected and check that nothing leaks (``reference_connector.soak``)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from pdwire.session import check_lease
from pdwire.versions import LEGACY, PDWIRE_2

from .worker_spec import WORKER_START_HELP, WORKER_STARTS

if TYPE_CHECKING:  # the deployment's modules load only when it runs: they bring torch
    from .run import Report
    from .soak import SoakReport

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: The level of the Mooncake transfer engine's own log: errors only, unless --verbose or the
#: caller set it (ERROR is its highest).
_MOONCAKE_LOG_LEVEL = "MC_LOG_LEVEL"
#: The defaults of the options left unset: a fixed run has the seeds' case (Qwen3-8B KV), a
#: soak a geometry small enough to run for minutes on a laptop's two cores.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {
        **{"layers": 36, "kv_heads": 8, "head_dim": 128, "block_size": 16},
        **{"prompt_tokens": 1000, "max_tokens": 128, "timeout": 300.0, "requests": 8},
    },
    "soak": {
        **{"layers": 4, "kv_heads": 8, "head_dim": 16, "block_size": 4},
        **{"prompt_tokens": 64, "max_tokens": 16, "timeout": 20.0, "requests": 16},
    },
}
_SOAK_FAULT_RATE = 0.1
_SOAK_ABORT_TIMEOUT = 3.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``pdwire``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "run",
        help="run a P/D deployment on loopback and verify it byte by byte",
        description="Start a P node (with its bootstrap server), a D node and the proxy on "
        "127.0.0.1, send streamed completions through the proxy (greedy), check that every "
        "text equals the reference completion and that D verified every KV byte, and print "
        "TTFT (split into proxy, P prefill, wait, transfer, D and D's first step), the "
        "disaggregation tax (P's write time, D's pull latency, the overhead, each beside its "
        "target), transfer GB/s against the raw transfer engine's for the same descriptors, "
        "and descriptors per request. "
        "Progress goes to stderr, the summary to stdout. Exit status 0 only when every "
        "request verified. Defaults: the seeds' case (Qwen3-8B KV geometry, 1000-token "
        "prompts, max_tokens 128). With --soak MINUTES: a closed loop of --concurrency "
        "clients for MINUTES with faults injected, then a drain; exit status 0 only when no "
        "request had an unexpected outcome or was late and no block leaked.",
    )
    load = p.add_argument_group("requests")
    load.add_argument(
        "--requests",
        type=int,
        help="requests to send (default 8; not with --soak, which sends for MINUTES)",
    )
    load.add_argument("--concurrency", type=int, default=2, help="in flight at once (default 2)")
    load.add_argument(
        "--prompt-tokens", type=int, help="prompt length (default 1000; 64 with --soak)"
    )
    load.add_argument(
        "--max-tokens", type=int, help="tokens to decode (default 128; 16 with --soak)"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts' words (default 0)")
    load.add_argument(
        "--timeout",
        type=float,
        help="seconds any one request may take, and D's wait for P's KV (300; 20 with --soak)",
    )
    split = p.add_argument_group("parallelism and protocol")
    split.add_argument("--prefill-tp", type=int, default=1, help="P's TP size (default 1)")
    split.add_argument("--decode-tp", type=int, default=1, help="D's TP size (default 1)")
    split.add_argument("--prefill-pp", type=int, default=1, help="P's PP size (default 1)")
    split.add_argument("--decode-pp", type=int, default=1, help="D's PP size (default 1)")
    split.add_argument("--profile", choices=(LEGACY, PDWIRE_2), default=PDWIRE_2)
    split.add_argument(
        "--kv-lease-duration",
        type=float,
        metavar="S",
        help="vLLM 0.34's KV lease on both nodes, seconds (§6.4; default: no lease)",
    )
    for side in ("prefill", "decode"):
        split.add_argument(
            f"--{side}-agent",
            metavar="MODULE:CALLABLE",
            default="",
            help=f"the {side} workers' side-channel agent factory (default: pdwire's own); "
            "see pdwire node --agent",
        )
    geometry = p.add_argument_group(
        "KV geometry",
        "default: Qwen3-8B, bfloat16 (36 layers, 8 KV heads, head dim 128, blocks of 16 "
        "tokens); with --soak: 4 layers, 8 KV heads, head dim 16, blocks of 4 tokens, each "
        "option unless set",
    )
    geometry.add_argument("--layers", type=int)
    geometry.add_argument("--kv-heads", type=int)
    geometry.add_argument("--head-dim", type=int)
    geometry.add_argument("--block-size", type=int)
    geometry.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="blocks per worker pool (default: enough for twice --concurrency requests; "
        "8 times with --soak)",
    )
    soak = p.add_argument_group(
        "soak",
        "Faults, in turn, each through the interface it breaks: the client disconnects from "
        "the proxy after the first token; the client gives up before it; D gets a D leg "
        "whose transfer_id P never prefilled (it must fail it by its deadline: the leg's "
        "deadline_ms of 1500 in pdwire/2, P's ready wait T in legacy); P gets a P leg that "
        "no D pulls (it must free the blocks when T expires). Both nodes run with "
        "T (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT) = --abort-timeout and D's receive timeout "
        "T + 2 s, so that every fault resolves within seconds. The JSON has requests, "
        "terminal, late_terminal, leaked_blocks_prefill, leaked_blocks_decode, rps, TTFT "
        "percentiles, faults by kind, blocks in use over time and per-window figures; a "
        "PNG of blocks in use and TTFT over time goes beside it (same name, .png).",
    )
    soak.add_argument(
        "--soak",
        type=float,
        metavar="MINUTES",
        help="send requests for MINUTES (a fraction is fine: 0.2) instead of --requests",
    )
    soak.add_argument(
        "--fault-rate",
        type=float,
        metavar="R",
        help=f"the probability in [0, 1] that a request is a fault (default {_SOAK_FAULT_RATE})",
    )
    soak.add_argument(
        "--abort-timeout",
        type=float,
        metavar="S",
        help=f"both nodes' T in seconds (default {_SOAK_ABORT_TIMEOUT:g})",
    )
    soak.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="how long both pools may take to empty after the last request (default: "
        "--abort-timeout + 10)",
    )
    p.add_argument("--worker-start", choices=WORKER_STARTS, default="spawn", help=WORKER_START_HELP)
    p.add_argument(
        "--raw-repeats",
        type=int,
        default=9,
        help="raw engine writes to time (the median counts; 9)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH (with --soak, and the plot beside it)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log INFO, and Mooncake's own INFO log (default: warnings; Mooncake's errors)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """0 when every request verified (a soak: nothing unexpected, late or leaked); 1 when one
    did not or the deployment failed; 2 on bad usage; 130 on Ctrl-C (or SIGTERM). Everything
    started is stopped in every case."""
    from . import soak
    from .run import RunConfig, run_deployment, write_json

    soaking = args.soak is not None
    defaults = _DEFAULTS["soak" if soaking else "run"]

    def option(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    try:
        _check_soak_options(args)
        check_lease(args.kv_lease_duration)
        config = RunConfig(
            requests=option("requests"),
            concurrency=args.concurrency,
            prompt_tokens=option("prompt_tokens"),
            max_tokens=option("max_tokens"),
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            prefill_pp=args.prefill_pp,
            decode_pp=args.decode_pp,
            profile=LEGACY if args.profile == LEGACY else PDWIRE_2,
            layers=option("layers"),
            kv_heads=option("kv_heads"),
            head_dim=option("head_dim"),
            block_size=option("block_size"),
            num_blocks=args.num_blocks,
            seed=args.seed,
            raw_repeats=args.raw_repeats,
            request_timeout=option("timeout"),
            prefill_agent=args.prefill_agent,
            decode_agent=args.decode_agent,
            abort_timeout=args.abort_timeout or (_SOAK_ABORT_TIMEOUT if soaking else 480.0),
            kv_lease_duration=args.kv_lease_duration,
            worker_start=args.worker_start,
        )
        soak_config = (
            soak.SoakConfig(
                run=soak.deployment_config(config),
                minutes=args.soak,
                fault_rate=_SOAK_FAULT_RATE if args.fault_rate is None else args.fault_rate,
                drain_timeout=args.drain_timeout or 0.0,
            )
            if soaking
            else None
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
    report: Report | SoakReport
    try:
        report = soak.run_soak(soak_config) if soak_config else run_deployment(config)
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
            if isinstance(report, soak.SoakReport):
                png = soak.write_json(report, args.json)
                print(f"pdwire run: wrote {args.json} and {png}", file=sys.stderr)
            else:
                write_json(report, args.json)
        except OSError as exc:
            print(f"pdwire run: cannot write --json {args.json}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return report.exit_code


def _check_soak_options(args: argparse.Namespace) -> None:
    soak_only = ("fault_rate", "abort_timeout", "drain_timeout")
    if args.soak is None:
        given = [f"--{n.replace('_', '-')}" for n in soak_only if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only with --soak")
        return
    if args.requests is not None:
        raise ValueError("--requests and --soak exclude each other: a soak sends for MINUTES")
    if args.abort_timeout is not None and args.abort_timeout <= 0:
        raise ValueError(f"--abort-timeout must be more than 0, got {args.abort_timeout}")
    if args.drain_timeout is not None and args.drain_timeout <= 0:
        raise ValueError(f"--drain-timeout must be more than 0, got {args.drain_timeout}")


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
