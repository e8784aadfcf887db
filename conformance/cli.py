"""``pdwire conformance``: check a producer, a consumer or a P/D pair against the spec.

Exit status: 0 when nothing unexpected failed, 1 when something did, 2 on bad usage or when the
testee could not be reached at all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from pdwire.sim.geometry import KV_LAYOUT_HELP, KV_LAYOUTS

from .case import Case, Suite, all_cases
from .command import check
from .requirements import CATALOGUE, dump, parse_spec
from .runner import (
    DEFAULT_REQUEST_TIMEOUT,
    Progress,
    Result,
    RunOptions,
    blocked,
    exit_code,
    read_list,
    scale_for,
    select,
    summary,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selection and reports")
    g.add_argument(
        "--cases",
        action="append",
        metavar="GLOB",
        help="run only the cases whose id matches (repeatable, comma-separated), "
        "e.g. 'producer/3.*'",
    )
    g.add_argument("--strict", action="store_true", help="a failed SHOULD case fails the run")
    g.add_argument(
        "--known-failing",
        metavar="FILE",
        help="case ids or globs that must fail (a listed case that passes fails the run)",
    )
    g.add_argument("--known-flaky", metavar="FILE", help="case ids or globs that may fail")
    g.add_argument("--json", metavar="PATH", help="write the report as JSON")
    g.add_argument("--junit", metavar="PATH", help="write the report as JUnit XML")
    g.add_argument(
        "--html", metavar="PATH", help="write the report as one self-contained HTML file"
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        metavar="S",
        help="seconds to wait for any one reply or HTTP answer of the testee (10); above 10, "
        "each case's own bound grows in the same proportion",
    )
    g.add_argument("-q", "--quiet", action="store_true", help="no line per case, only the summary")
    g.add_argument(
        "--restart-command",
        metavar="CMD",
        help="a shell command that restarts the testee (e.g. 'systemctl restart vllm-p'): run "
        "when the testee stops serving after a case, so that the cases left still run instead "
        "of ending as blocked; it returns once the restart is under way",
    )
    g.add_argument(
        "--restart-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds for --restart-command and the testee's return to service together (600)",
    )


def _geometry(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "P's KV geometry (default: from the fingerprint P registered, else from the config.json "
        "of the model path GET /v1/models names and the block size of vLLM's /metrics)"
    )
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--block-size", type=int)
    g.add_argument(
        "--kernel-block-size",
        type=int,
        metavar="N",
        help="P's attention kernel block size, when smaller than its block size: each block "
        "id then stands for block_size/N rows of P's and D's regions (10.6.6)",
    )
    g.add_argument(
        "--sliding-window",
        type=int,
        metavar="W",
        help="the sliding window, in tokens, of P's odd layers, which then form KV-cache group "
        "1: D lists only the last ceil(W / block size) + 1 of a prompt's blocks there (10.4.7)",
    )
    g.add_argument(
        "--mamba",
        action="store_true",
        help="P's odd layers are state-space (Mamba) layers, KV-cache group 1: D lists there "
        "a request's state block after a null block (id 0) for each earlier block (10.6.3)",
    )
    g.add_argument(
        "--kv-layout",
        choices=KV_LAYOUTS,
        help=f"P's KV layout (default: as P's fingerprint names it, else apart; an MLA model's "
        f"config gives mla): {KV_LAYOUT_HELP}",
    )
    g.add_argument(
        "--packed-rows",
        action="store_true",
        help="P's regions are slices of packed rows (row offsets 0 and up): the fake D packs "
        "its rows likewise (10.7.8)",
    )
    g.add_argument(
        "--opaque-rows",
        action="store_true",
        help="P registers each packed row whole, one region named after its first layer (shared "
        "by its KV-cache groups when it has two): the fake D does likewise (10.2.8, 10.6.7)",
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``conformance`` and its subcommands to ``pdwire``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "conformance",
        help="check a producer, a consumer or a P/D pair against the spec",
        description="The pdwire conformance harness. Each case has an id tied to a spec section "
        "(producer/3.4/1), quotes its requirement and its level, and ends pass, fail, "
        "non-strict (a failed SHOULD), informational (a MAY not taken), unsupported or skipped.",
    )
    sub = p.add_subparsers(dest="conformance_command", required=True, metavar="COMMAND")

    ls = sub.add_parser("list", help="list the cases (id, level, requirement, title)")
    ls.add_argument("--cases", action="append", metavar="GLOB")
    ls.add_argument("--json", action="store_true", help="one JSON object per case")
    ls.set_defaults(func=cmd_list)

    prod = sub.add_parser(
        "producer",
        help="check a P: the harness is the client and the D",
        description="Check a P (prefill engine) against the spec. The harness sends the P leg "
        "of requests to --api, reads P's workers from --bootstrap, and pulls from them as a D "
        "with its own Mooncake engine and memory, checking every reply and every byte written.",
    )
    prod.add_argument("--api", required=True, metavar="URL", help="P's OpenAI API")
    prod.add_argument("--bootstrap", required=True, metavar="URL", help="P's bootstrap server")
    prod.add_argument("--engine-id", help="the engine to test (default: DP rank 0's)")
    prod.add_argument("--model", help="the model name to send (default: from /v1/models)")
    prod.add_argument(
        "--abort-timeout",
        type=float,
        metavar="S",
        help="P's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT; timer cases are skipped without it",
    )
    _lease(prod, "P")
    prod.add_argument(
        "--max-message-bytes",
        type=int,
        metavar="N",
        help="P's size limit on side-channel messages (pdwire's default: 67108864): the same "
        "as message_bytes in --limits; the case of a message over the limit is skipped "
        "without either",
    )
    _auth_key(prod, "P")
    _limits(prod, "P")
    _geometry(prod)
    _common(prod)
    prod.set_defaults(func=cmd_producer)

    cons = sub.add_parser(
        "consumer",
        help="check a D: the harness is P and its bootstrap server",
        description="Check a D (decode engine) against the spec. The harness runs fake P "
        "workers with their own bootstrap server and Mooncake engine, sends D requests whose "
        "kv_transfer_params point at them, and checks every pull D sends and how D handles "
        "every kind of reply.",
    )
    cons.add_argument("--api", required=True, metavar="URL", help="D's OpenAI API")
    cons.add_argument("--model", help="the model name to send (default: from /v1/models)")
    cons.add_argument(
        "--abort-timeout",
        type=float,
        metavar="S",
        help="D's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, when known",
    )
    _lease(cons, "D")
    cons.add_argument(
        "--receive-timeout",
        type=float,
        metavar="S",
        help="D's receive timeout per pull, when known (default: --abort-timeout "
        "+ 60); receive-timeout cases are skipped without either",
    )
    cons.add_argument(
        "--d-command",
        metavar="TEMPLATE",
        help="the command line that starts a D like the one at --api, for the case that "
        "restarts D (3.7-R2); placeholders {port} (its API) and {python}; set a fixed engine "
        "id in it where D takes one (the case is skipped without it)",
    )
    cons.add_argument(
        "--sliding-window",
        type=int,
        metavar="W",
        help="the sliding window, in tokens, of D's KV-cache group 1, when it has one: D must "
        "list there only the last ceil(W / block size) + 1 of a prompt's blocks (10.4.7)",
    )
    _auth_key(cons, "D")
    _common(cons)
    cons.set_defaults(func=cmd_consumer)

    pair = sub.add_parser(
        "pair",
        help="check a P/D pair: the harness is the client and the proxy",
        description="Check a P and a D together. The harness is the proxy: it sends both legs "
        "of each request, relays and checks every side-channel message between them, and "
        "checks that the disaggregated text equals D's own local-prefill text.",
    )
    from .preflight import add_prefill_argument

    add_prefill_argument(pair)
    pair.add_argument("--decode", required=True, metavar="URL", help="D's API")
    pair.add_argument("--model", help="the model name to send (default: from /v1/models)")
    _common(pair)
    pair.set_defaults(func=cmd_pair)

    prox = sub.add_parser(
        "proxy",
        help="check a proxy: the harness is the client, P and D",
        description="Check a disaggregation proxy (spec 5.4). The harness starts the proxy "
        "from --command, pointed at its own fake P API, P bootstrap and D API servers, restarts "
        "it when a case needs backends in another state, and checks both legs of every request "
        "and what the client gets back.",
    )
    prox.add_argument(
        "--command",
        required=True,
        metavar="TEMPLATE",
        help="the command line that starts the proxy; placeholders {port} (where it must "
        "listen), {prefill_url}, {bootstrap_url}, {decode_url}, their {*_host} and {*_port}, "
        "{host}, {python}; {bootstrap_url} and {bootstrap_port} are 'none' in the case of an "
        "omitted bootstrap port. E.g. 'pdwire proxy --port {port} --prefill "
        "{prefill_url}@{bootstrap_url} --decode {decode_url}'",
    )
    prox.add_argument(
        "--key-command",
        metavar="TEMPLATE",
        help="the same for a proxy with an API key, given as {api_key} and in the environment "
        "variable PDWIRE_CONFORMANCE_API_KEY (the API-key case is skipped without it)",
    )
    _limits(prox, "the proxy")
    _common(prox)
    prox.set_defaults(func=cmd_proxy)

    reg = sub.add_parser(
        "registration",
        help="check how a P registers: the harness is its deployment and bootstrap server",
        description="Check how a P's workers register at the bootstrap server (spec 4.4). For "
        "each case the harness starts P from --command, pointed at a scripted bootstrap server "
        "that lets every attempt time out, refuses it, or answers it late, and checks the "
        "attempts, their timing, P's failure message and where P serves. P's environment sets "
        "VLLM_MOONCAKE_CONNECTOR_TIMEOUT (--attempt-timeout) and VLLM_MOONCAKE_BOOTSTRAP_PORT "
        "(a free port, where P must serve a bootstrap server of its own only when started from "
        "--own-command). The cases run side by side.",
    )
    reg.add_argument(
        "--command",
        required=True,
        metavar="TEMPLATE",
        help="the command line that starts P with an external bootstrap server; placeholders "
        "{port} (P's API, whose /health says it started), {bootstrap_address} (host:port, "
        "vLLM's bootstrap_server_address; a host without a port in the case of 4.4-R12), "
        "{bootstrap_url}, {bootstrap_host}, {bootstrap_port}, {python}. E.g. 'pdwire node "
        "--role prefill --port {port} --tp 2 --bootstrap {bootstrap_address}'",
    )
    reg.add_argument(
        "--own-command",
        metavar="TEMPLATE",
        help="the command line that starts P without an external bootstrap server, so that it "
        "serves its own at VLLM_MOONCAKE_BOOTSTRAP_PORT (4.4-R14); placeholders {port} and "
        "{python} (the case is skipped without it)",
    )
    reg.add_argument(
        "--dp-command",
        metavar="TEMPLATE",
        help="the command line that starts one engine of a data-parallel deployment without an "
        "external bootstrap server (4.4-R13, R15, R16); placeholders {port}, {python}, "
        "{dp_index}, {dp_local_rank}, {dp_load_balancing} (internal, hybrid or external), "
        "{dp_master_ip} (vLLM's data_parallel_master_ip), {master_addr} and {dp_nodes} (how "
        "many nodes one DP rank spans). The engines listen and register on 127.0.0.1 to "
        "127.0.0.3 (the case is skipped without it)",
    )
    reg.add_argument(
        "--attempt-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="the VLLM_MOONCAKE_CONNECTOR_TIMEOUT P gets in the case whose attempts time out "
        "(default 1; 10 in the others)",
    )
    reg.add_argument(
        "--start-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long P may take from its start to its first registration, and to answer "
        "/health (default 60)",
    )
    reg.add_argument("--tp", type=int, help="P's TP size, when its registrations omit it")
    reg.add_argument("--pp", type=int, help="P's PP size, when its registrations omit it")
    _common(reg)
    reg.set_defaults(func=cmd_registration)

    from .matrix import add_matrix_parser
    from .preflight import add_preflight_parser

    add_preflight_parser(sub)
    add_matrix_parser(sub)

    me = sub.add_parser(
        "self",
        help="start the reference testees and run every suite against them",
        description="Start the reference P node (TP 2, with its bootstrap server) and D node on "
        "loopback, with a short VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, run every suite against "
        "them and stop them. The cases that need other testees get testees of their own: a "
        "keyed pair, a P of PP 2 and a D of TP 2, a P of TP 2 over one KV head, a slow prefill, "
        "kernel blocks and a sliding window, state-space layers with packed or opaque rows, a "
        "KV lease, and a P for each registration case.",
    )
    _common(me)
    me.set_defaults(func=cmd_self)

    trace = sub.add_parser(
        "trace",
        help="the traceability table: which cases check which requirement",
        description="Print how many requirements of each level, of each profile and of each "
        "role the cases cover (a requirement that binds two roles counts for each), and every "
        "MUST that no case covers; exit 1 when such a MUST is not listed as unobservable.",
    )
    trace.add_argument("--markdown", action="store_true", help="print the whole table")
    trace.add_argument("--json", action="store_true", help="print the counts as JSON")
    trace.set_defaults(func=cmd_trace)

    reqs = sub.add_parser("requirements", help="check or regenerate requirements.json from spec/")
    reqs.add_argument("--write", action="store_true", help="rewrite it instead of checking it")
    reqs.set_defaults(func=cmd_requirements)
    return p


def cmd_list(args: argparse.Namespace) -> int:
    for c in select(all_cases(), args.cases):
        if args.json:
            print(
                json.dumps(
                    {
                        "id": c.id,
                        "level": c.level.value,
                        "requirement": c.requirement.id,
                        "covers": list(c.covers),
                        "title": c.title,
                        "breaks_testee": c.breaks_testee,
                    }
                )
            )
        else:
            print(f"{c.id:<20} {c.level.value:<6} {c.requirement.id:<9} {c.title}")
    return EXIT_OK


def cmd_trace(args: argparse.Namespace) -> int:
    from . import traceability as tr

    rows = tr.table()
    if args.markdown:
        print(tr.markdown(rows), end="")
        return EXIT_OK
    counts = tr.counts()
    if args.json:
        print(json.dumps(counts, indent=1))
    else:
        for level, total in counts["requirements"].items():
            print(f"{level}: {counts['requirements_covered'].get(level, 0)} of {total} covered")
        for kind in ("profile", "role"):
            for name, total in counts[f"requirements_by_{kind}"].items():
                got = counts[f"requirements_covered_by_{kind}"][name]
                print(f"{kind} {name}: {got} of {total} covered")
        print("cases by level:", counts["cases_by_level"])
        print("cases by chapter:", counts["cases_by_chapter"])
    missing = [r for r in tr.uncovered_musts(rows) if r.id not in tr.UNCOVERED]
    for r in missing:
        print(f"uncovered MUST {r.id}: {r.text}", file=sys.stderr)
    return EXIT_FAILED if missing else EXIT_OK


def cmd_requirements(args: argparse.Namespace) -> int:
    text = dump(parse_spec())
    if args.write:
        CATALOGUE.write_text(text, encoding="utf-8")
        print(f"wrote {CATALOGUE}")
        return EXIT_OK
    if CATALOGUE.read_text(encoding="utf-8") != text:
        print(
            f"{CATALOGUE} differs from spec/: run pdwire conformance requirements --write",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print("requirements.json matches spec/")
    return EXIT_OK


def run_options(args: argparse.Namespace) -> RunOptions:
    return RunOptions(
        strict=args.strict,
        timeout_scale=scale_for(args.timeout),
        known_failing=read_list(args.known_failing) if args.known_failing else frozenset(),
        known_flaky=read_list(args.known_flaky) if args.known_flaky else frozenset(),
        restart_command=args.restart_command,
        restart_timeout=args.restart_timeout,
    )


def finish(args: argparse.Namespace, results: Sequence[Result], testee: dict[str, Any]) -> int:
    """Print the summary, write the reports asked for, and give the exit status."""
    counts = summary(results)
    line = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    unexpected = [r.case.id for r in results if r.unexpected]
    print(f"{len(results)} cases: {line}")
    if unexpected:
        print(f"unexpected: {', '.join(unexpected)}")
    write_reports(args, results, testee)
    return exit_code(results)


def write_reports(
    args: argparse.Namespace, results: Sequence[Result], testee: dict[str, Any]
) -> None:
    """The JSON, JUnit and HTML reports that ``args`` asks for."""
    from .report import write_html, write_json, write_junit

    for flag, writer in (("json", write_json), ("junit", write_junit), ("html", write_html)):
        path = getattr(args, flag, None)
        if path:
            writer(path, results, testee)


def _run(
    args: argparse.Namespace,
    suite: Suite | None,
    go: Callable[[list[Case], RunOptions, Progress], Coroutine[Any, Any, list[Result]]],
    testee: dict[str, Any],
) -> int:
    try:
        options = run_options(args)
    except OSError as exc:
        print(f"pdwire conformance: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # The Mooncake engine's own log: errors only, unless the caller chose (ERROR is its highest).
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    cases = [c for c in select(all_cases(), args.cases) if suite in (None, c.suite)]
    progress = Progress(len(cases), quiet=args.quiet)
    try:
        results = asyncio.run(go(cases, options, progress))
    except (RuntimeError, OSError, TimeoutError) as exc:  # the testee is unreachable or broken
        print(f"pdwire conformance {suite or 'self'}: {exc}", file=sys.stderr)
        # The reports asked for still say why no case ran: CI reads them, not stderr.
        write_reports(args, [blocked(c, f"the run could not start: {exc}") for c in cases], testee)
        return EXIT_USAGE
    return finish(args, results, testee)


def _auth_key(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--auth-key-file",
        metavar="PATH",
        help=f"the key {role} shares (§8.6): the harness signs and checks with it; the "
        "authentication cases (*/8.6/*) are skipped without it",
    )


def _lease(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--kv-lease-duration",
        type=float,
        metavar="S",
        help=f"{role}'s kv_lease_duration (vLLM 0.34, §6.4), 0 when it has none; the lease "
        "cases are skipped without it",
    )


def _limits(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument(
        "--limits",
        metavar="PATH",
        help=f"a JSON object of {role}'s limits by name (chapter 13, e.g. "
        '{"requests_per_message": 4096}); the cases past a limit are skipped without it',
    )


def read_limits(path: str | None) -> dict[str, int]:
    """The limits of ``--limits``; exits with the reason when the file is not valid."""
    from .case import limits_from_file

    try:
        return limits_from_file(path)
    except ValueError as exc:
        raise SystemExit(f"pdwire conformance: {exc}") from None


def with_size_limit(limits: dict[str, int], max_message_bytes: int | None) -> dict[str, int]:
    """``limits`` with ``--max-message-bytes`` as its ``message_bytes``; exits when the two
    name different sizes."""
    if max_message_bytes is None:
        return limits
    declared = limits.get("message_bytes", max_message_bytes)
    if declared != max_message_bytes:
        raise SystemExit(
            f"pdwire conformance: --max-message-bytes {max_message_bytes} and message_bytes "
            f"{declared} in --limits differ: give P's size limit once"
        )
    return {**limits, "message_bytes": max_message_bytes}


def read_auth_key(args: argparse.Namespace) -> bytes | None:
    """The key of ``--auth-key-file``: the file's bytes less a trailing newline."""
    from pdwire.auth import read_key_file

    if not args.auth_key_file:
        return None
    try:
        return read_key_file(args.auth_key_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pdwire conformance: {exc}") from None


def producer_options(args: argparse.Namespace) -> Any:
    from pdwire.sim.geometry import Geometry

    from .suites.producer_env import ProducerOptions

    dims = (args.layers, args.kv_heads, args.head_dim, args.block_size)
    geometry = None
    if any(d is not None for d in dims):
        if not all(d is not None for d in dims):
            raise SystemExit(
                "pdwire conformance: give all of --layers --kv-heads --head-dim "
                "--block-size, or none"
            )
        geometry = Geometry(*dims)
    return ProducerOptions(
        api=args.api.rstrip("/"),
        bootstrap=args.bootstrap.rstrip("/"),
        engine_id=args.engine_id,
        geometry=geometry,
        model=args.model,
        abort_timeout=args.abort_timeout,
        kv_lease_duration=args.kv_lease_duration,
        request_timeout=args.timeout,
        auth_key=read_auth_key(args),
        limits=with_size_limit(read_limits(args.limits), args.max_message_bytes),
        kernel_block_size=args.kernel_block_size,
        sliding_window=args.sliding_window,
        mamba=args.mamba,
        packed_rows=args.packed_rows,
        opaque_rows=args.opaque_rows,
        kv_layout=args.kv_layout,
    )


def cmd_producer(args: argparse.Namespace) -> int:
    from .suites.run import run_producer

    options = producer_options(args)
    testee = {"role": "producer", "api": options.api, "bootstrap": options.bootstrap}
    return _run(
        args,
        Suite.PRODUCER,
        lambda cases, ro, progress: run_producer(options, cases, ro, progress),
        testee,
    )


def cmd_consumer(args: argparse.Namespace) -> int:
    from .suites.consumer_env import D_PLACEHOLDERS, ConsumerOptions, run_consumer

    if args.d_command is not None:
        try:
            check(args.d_command, D_PLACEHOLDERS, "D")
        except ValueError as exc:
            print(f"pdwire conformance consumer: {exc}", file=sys.stderr)
            return EXIT_USAGE
    options = ConsumerOptions(
        api=args.api.rstrip("/"),
        model=args.model,
        abort_timeout=args.abort_timeout,
        receive_timeout=args.receive_timeout,
        kv_lease_duration=args.kv_lease_duration,
        request_timeout=args.timeout,
        auth_key=read_auth_key(args),
        d_command=args.d_command,
        sliding_window=args.sliding_window,
    )
    testee = {"role": "consumer", "api": options.api}
    return _run(
        args,
        Suite.CONSUMER,
        lambda cases, ro, progress: run_consumer(options, cases, ro, progress),
        testee,
    )


def cmd_pair(args: argparse.Namespace) -> int:
    from .suites.pair_env import PairOptions, run_pair

    prefill, bootstrap = args.prefill
    options = PairOptions(
        prefill=prefill,
        prefill_bootstrap=bootstrap,
        decode=args.decode.rstrip("/"),
        model=args.model,
        request_timeout=args.timeout,
    )
    testee = {"role": "pair", "prefill": prefill, "bootstrap": bootstrap, "decode": options.decode}
    return _run(
        args, Suite.PAIR, lambda cases, ro, progress: run_pair(options, cases, ro, progress), testee
    )


def cmd_proxy(args: argparse.Namespace) -> int:
    from .suites.proxy_env import ProxyOptions, check_template, run_proxy

    for template in (args.command, args.key_command):
        try:
            if template is not None:
                check_template(template)
        except ValueError as exc:
            print(f"pdwire conformance proxy: {exc}", file=sys.stderr)
            return EXIT_USAGE
    options = ProxyOptions(
        command=args.command,
        key_command=args.key_command,
        request_timeout=args.timeout,
        limits=read_limits(args.limits),
    )
    testee = {"role": "proxy", "command": args.command}
    return _run(
        args,
        Suite.PROXY,
        lambda cases, ro, progress: run_proxy(options, cases, ro, progress),
        testee,
    )


def cmd_registration(args: argparse.Namespace) -> int:
    from .suites.registration_env import RegistrationOptions, check_template, run_registration

    try:
        check_template(args.command)
        if args.own_command is not None:
            check_template(args.own_command, own=True)
        if args.dp_command is not None:
            check_template(args.dp_command, dp=True)
    except ValueError as exc:
        print(f"pdwire conformance registration: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = RegistrationOptions(
        command=args.command,
        own_command=args.own_command,
        dp_command=args.dp_command,
        attempt_timeout=args.attempt_timeout,
        start_timeout=args.start_timeout,
        tp=args.tp,
        pp=args.pp,
        request_timeout=args.timeout,
    )
    testee = {"role": "registration", "command": args.command}
    return _run(
        args,
        Suite.REGISTRATION,
        lambda cases, ro, progress: run_registration(options, cases, ro, progress),
        testee,
    )


def cmd_self(args: argparse.Namespace) -> int:
    from .selftest import run_self

    return _run(
        args,
        None,
        lambda cases, ro, progress: run_self(cases, ro, progress, args.timeout),
        {"role": "self"},
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``pdwire conformance ARGV...`` parsed."""
    parser = argparse.ArgumentParser(prog="pdwire")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["conformance", *argv])


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance.cli ...`` (the same as ``pdwire conformance ...``)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
