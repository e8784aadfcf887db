"""The ``pdwire`` command: a wire inspector and the spec's generators."""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from . import __version__, capture, spectables, vectors
from .codec import DEFAULT_MAX_MESSAGE_BYTES, decode_message
from .errors import PdwireError
from .extras import COMMANDS, install_hint, missing, named
from .legacy import older_variants
from .messages import LeaseHeartbeat, XferCancel, XferMetadataV2, XferResponseV2
from .observer import Observer, summary_table
from .schema import schemas
from .vectors import ENCODERS, as_json
from .versions import WIRE_VERSION

#: Other packages of the distribution add subcommands here (``pdwire bootstrap``, ...) without
#: pdwire importing them: each entry point names a module with ``add_parser(subparsers)``.
COMMANDS_GROUP = "pdwire.commands"
_KINDS = {
    "pull": XferMetadataV2,
    "response": XferResponseV2,
    "cancel": XferCancel,
    "heartbeat": LeaseHeartbeat,
}
_HEX = frozenset(string.hexdigits + string.whitespace)
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _read(source: str) -> bytes:
    if source == "-":
        return sys.stdin.buffer.read()
    return Path(source).read_bytes()


def _unhex(data: bytes) -> bytes:
    """Raw bytes as given, or decoded from hex when the input is nothing but hex digits."""
    text = data.decode("ascii", "replace")
    if data and all(c in _HEX for c in text):
        compact = "".join(text.split())
        if len(compact) % 2 == 0:
            return bytes.fromhex(compact)
    return data


def cmd_decode(args: argparse.Namespace) -> int:
    if (args.pcap is None) == (not args.files):
        print("pdwire decode: give FILE... or --pcap FILE", file=sys.stderr)
        return EXIT_USAGE
    if args.pcap is not None:
        return _decode_pcap(args.pcap, args.follow, args.max_size)
    status = EXIT_OK
    for source in args.files:
        data = _unhex(_read(source))
        try:
            kind, msg = decode_message(data, max_size=args.max_size)
        except PdwireError as exc:
            hint = (
                " (this looks like JSON; decode reads msgpack or hex)" if data[:1] == b"{" else ""
            )
            print(f"{source}: {exc}{hint}", file=sys.stderr)
            status = EXIT_INVALID
            continue
        out: dict[str, Any] = {"kind": kind, "bytes": len(data), "message": as_json(msg)}
        if isinstance(msg, XferResponseV2):
            out["status_name"] = msg.status.name
        if kind == "pull":
            out["older_variants"] = older_variants(msgspec.msgpack.decode(data))
        if len(args.files) > 1:
            out = {"source": source, **out}
        print(json.dumps(out, indent=None if args.compact else 2))
    return status


def _decode_pcap(path: str, follow: str | None, max_size: int) -> int:
    observer = Observer(follow, max_size)
    last = 0.0
    try:
        with open(path, "rb") as source:
            for seen in capture.messages(source):
                last = seen.at
                record = observer.see(seen)
                if observer.shown(record):
                    print(json.dumps(record, separators=(",", ":")))
    except (OSError, capture.CaptureError) as exc:
        print(f"pdwire decode: {path}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    rows = observer.summary(last)
    for row in rows:
        print(json.dumps({"summary": row}, separators=(",", ":")))
    print(summary_table(rows), file=sys.stderr)
    return EXIT_OK


def cmd_encode(args: argparse.Namespace) -> int:
    text = _read(args.jsonfile)
    try:
        msg = msgspec.json.decode(text, type=_KINDS[args.kind])
    except msgspec.DecodeError as exc:
        print(f"{args.jsonfile}: not a valid {args.kind}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        data = ENCODERS[args.kind](msg, args.profile)
    except PdwireError as exc:
        print(f"cannot encode: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if args.out:
        Path(args.out).write_bytes(data)
    elif args.hex:
        print(data.hex())
    else:
        stdout: BinaryIO = sys.stdout.buffer
        if stdout.isatty():
            print("refusing to write binary to a terminal: use --hex or --out", file=sys.stderr)
            return EXIT_USAGE
        stdout.write(data)
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in schemas().items():
        (out / name).write_text(text)
    print(f"wrote {len(schemas())} schemas to {out}")
    return EXIT_OK


def cmd_vectors(args: argparse.Namespace) -> int:
    if args.action == "write":
        if args.dir is None:
            print("pdwire vectors: write needs --dir", file=sys.stderr)
            return EXIT_USAGE
        written = vectors.write(Path(args.dir))
        print(f"wrote {len(written)} files to {args.dir}")
        return EXIT_OK
    directory = vectors.packaged() if args.dir is None else Path(args.dir)
    outcomes = vectors.check(directory)
    if not outcomes:
        print(f"no vectors in {directory}", file=sys.stderr)
        return EXIT_INVALID
    width = max(len(o.name) for o in outcomes)
    for o in outcomes:
        print(f"{'ok  ' if o.ok else 'FAIL'} {o.name:<{width}}  {o.detail}")
        if args.print and o.message is not None:
            print(f"     {json.dumps(o.message)}")
    failed = sum(not o.ok for o in outcomes)
    print(f"{len(outcomes) - failed} passed, {failed} failed")
    return EXIT_INVALID if failed else EXIT_OK


def cmd_spec_tables(args: argparse.Namespace) -> int:
    stale = []
    for path in sorted(Path(args.dir).glob("*.md")):
        text = path.read_text()
        filled = spectables.fill(text)
        if filled != text:
            stale.append(path)
            if args.write:
                path.write_text(filled)
    verb = "updated" if args.write else "out of date"
    for path in stale:
        print(f"{verb}: {path}")
    return EXIT_INVALID if stale and not args.write else EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim import SimParams, simulate  # numpy and the sessions load only for this command

    params = SimParams(
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_pp=args.prefill_pp,
        decode_pp=args.decode_pp,
        requests=args.requests,
        fault_rate=args.fault_rate,
        seed=args.seed,
        profile=args.profile,
        arrival_rate=args.arrival_rate,
        prompt_tokens=args.prompt_tokens,
        deadline=args.deadline,
        lease=args.lease,
        d_queue=args.d_queue,
    )
    step = max(1, args.requests // 20)
    tty = sys.stderr.isatty()

    def progress(n: int) -> None:
        if n % step == 0 or n == args.requests - 1:
            end = "\r" if tty and n < args.requests - 1 else "\n"
            print(f"simulating: {n + 1}/{args.requests} requests arrived", end=end, file=sys.stderr)

    report = simulate(params, progress=None if args.quiet else progress).as_dict()
    width = max(map(len, report))
    for key, value in report.items():
        if key != "params":
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"{key:<{width}}  {shown}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdwire",
        description="The P/D disaggregation wire protocol: inspect, encode and check messages.",
    )
    parser.add_argument("--version", action="version", version=f"pdwire {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "decode",
        help="decode captured side-channel messages to JSON",
        description="Decode side-channel messages (raw msgpack, or hex) to JSON. The kind "
        "(pull, response, cancel, heartbeat) is detected from the keys. Exit 1 if any input is "
        "invalid. With --pcap FILE: every side-channel message of a tcpdump capture (pcap), "
        "as JSON lines like pdwire tap's, then a summary line per transfer (and a table of "
        "them on stderr).",
    )
    p.add_argument("files", nargs="*", metavar="FILE", help="file to read, or - for stdin")
    p.add_argument("--pcap", metavar="FILE", help="a capture: tcpdump -i lo -w FILE tcp")
    p.add_argument("--follow", metavar="TRANSFER_ID", help="with --pcap: this transfer only")
    p.add_argument("--max-size", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="BYTES")
    p.add_argument("--compact", action="store_true", help="one line of JSON per message")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser(
        "encode",
        help="encode a JSON message to msgpack",
        description="Encode a message written as JSON (the shape `pdwire decode` prints under "
        "'message') into its wire bytes under a profile.",
    )
    p.add_argument("jsonfile", metavar="JSONFILE", help="file to read, or - for stdin")
    p.add_argument("--kind", choices=sorted(_KINDS), required=True)
    p.add_argument("--profile", choices=sorted(WIRE_VERSION), default="legacy")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--hex", action="store_true", help="print hex instead of raw bytes")
    out.add_argument("--out", metavar="FILE", help="write the raw bytes to FILE")
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser(
        "schema",
        help="write the JSON Schemas of every message and document",
        description="Write JSON Schema (2020-12) files generated from the code.",
    )
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser(
        "vectors",
        help="write or check the golden wire vectors",
        description="'check' decodes every vector and compares it with its JSON: the vectors "
        "that ship with pdwire, or those in DIR (another implementation's, for instance). "
        "'write' regenerates them from the code into DIR.",
    )
    p.add_argument("action", choices=["check", "write"])
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="the vectors' directory (check: default the packaged vectors; write: required)",
    )
    p.add_argument("--print", action="store_true", help="with check: print each decoded message")
    p.set_defaults(func=cmd_vectors)

    p = sub.add_parser(
        "spec-tables",
        help="check or refresh the generated tables in the spec",
        description="Field and negotiation tables in spec/*.md are generated from the code "
        "between markers. Without --write, exit 1 if any is out of date.",
    )
    p.add_argument("--dir", default="spec", metavar="DIR")
    p.add_argument("--write", action="store_true", help="rewrite stale tables in place")
    p.set_defaults(func=cmd_spec_tables)

    p = sub.add_parser(
        "simulate",
        help="run real P and D sessions in a simulated cluster, in virtual time",
        description="Drive many producer and consumer sessions through a modelled network, "
        "transfer engine and prefill, deterministically, with injected faults (lost message, a "
        "D stage that never pulls, P abort, stop token first, duplicate transfer_id, slow P). "
        "Reports early frees, leaked blocks and requests not terminal by their deadline.",
    )
    for flag, default, what in (
        ("--prefill-instances", 1, "P engines"),
        ("--decode-instances", 1, "D engines"),
        ("--prefill-tp", 1, "TP size of each P engine"),
        ("--decode-tp", 1, "TP size of each D engine"),
        ("--prefill-pp", 1, "PP size of each P engine"),
        ("--decode-pp", 1, "PP size of each D engine"),
        ("--requests", 1000, "requests to run"),
        ("--seed", 0, "random seed: the same seed gives the same run"),
        ("--prompt-tokens", 1000, "prompt length"),
    ):
        p.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--fault-rate", type=float, default=0.0, help="share of requests with a fault")
    p.add_argument("--profile", choices=sorted(WIRE_VERSION), default="pdwire/2")
    p.add_argument("--arrival-rate", type=float, default=200.0, help="requests per second")
    p.add_argument("--deadline", type=float, default=60.0, help="D's load deadline, seconds")
    p.add_argument(
        "--lease",
        type=float,
        metavar="S",
        help="vLLM 0.34's kv_lease_duration on every P and D, seconds (default: no lease)",
    )
    p.add_argument(
        "--d-queue",
        type=float,
        default=0.0,
        metavar="S",
        help="each request waits up to S seconds in D's queue before its load (default 0)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_simulate)
    for command in entry_points(group=COMMANDS_GROUP):
        needs = COMMANDS.get(command.name, ())
        try:
            module = command.load()
        except ImportError as exc:
            _unavailable(sub, command.name, needs, exc)
        else:
            module.add_parser(_NamingExtras(sub, needs))
    return parser


class _NamingExtras:
    """The subparsers as another package's command sees them: the help of what it adds names
    the extras the command needs, and main checks them before it runs."""

    def __init__(self, sub: Any, extras: tuple[str, ...]) -> None:
        self._sub, self._extras = sub, extras

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if self._extras:
            if "help" in kwargs:
                kwargs["help"] = f"{kwargs['help']} (needs {named(self._extras)})"
            kwargs.setdefault(
                "epilog", f"Needs {named(self._extras)}: {install_hint(self._extras)}"
            )
        parser: argparse.ArgumentParser = self._sub.add_parser(name, **kwargs)
        parser.set_defaults(pdwire_extras=self._extras)
        return parser


def _not_installed(extras: tuple[str, ...], exc: ImportError | None = None) -> str | None:
    """Why a command cannot run here, naming what to install; None if nothing is missing."""
    absent = missing(extras)
    if absent:
        what = f"not installed: {', '.join(absent)}"
    elif isinstance(exc, ModuleNotFoundError) and exc.name:
        what = f"not installed: {exc.name}"
    elif exc is not None:
        what = f"cannot load: {exc}"
    else:
        return None
    return f"{what}; {install_hint(extras)}" if extras else what


def _unavailable(sub: Any, name: str, extras: tuple[str, ...], exc: ImportError) -> None:
    reason = _not_installed(extras, exc)

    def fail(args: argparse.Namespace) -> int:
        print(f"pdwire {name}: {reason}", file=sys.stderr)
        return EXIT_USAGE

    short = f"needs {named(extras)}" if extras else reason
    p = sub.add_parser(name, help=f"(unavailable: {short})", description=reason)
    p.set_defaults(func=fail, unavailable=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # An unavailable command takes any arguments: it only says what to install.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    extras: tuple[str, ...] = getattr(args, "pdwire_extras", ())
    # Checked here, before the command starts processes that would each fail on the import.
    reason = _not_installed(extras)
    if reason:
        print(f"pdwire {args.command}: {reason}", file=sys.stderr)
        return EXIT_USAGE
    try:
        code: int = args.func(args)
    except ModuleNotFoundError as exc:  # a package that the command's extras do not name
        print(f"pdwire {args.command}: {_not_installed(extras, exc)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"pdwire: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
