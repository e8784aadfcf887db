"""``python -m mutants``: list the reference testee's mutants, give the environment that applies
one, or check that the cases each names catch it. Run from a checkout: this package is not
installed with pdwire."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from pathlib import Path

from conformance.case import all_cases

from . import MUTANTS, NAMES, get, preload

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def cmd_list(args: argparse.Namespace) -> int:
    for m in MUTANTS.values():
        mode = "switchable" if m.switchable else "own-proxy" if m.role == "proxy" else "own-node"
        print(f"{m.name:<28} {m.role:<8} {mode:<10} {m.defect}")
    return EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
    try:
        get(args.name)
    except KeyError as exc:
        print(f"python -m mutants env: {exc.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in preload.environ(args.name).items()))
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    from .check import MutantResult, check_mutants

    chosen = args.names or list(NAMES)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    done = [0]

    def show(r: MutantResult) -> None:
        done[0] += 1
        mark = "caught" if r.caught else "SURVIVED"
        survived = {i: v for i, v in r.verdicts.items() if v != "fail"}
        extra = f" {survived}" if survived else ""
        print(
            f"[{done[0]:>3}/{len(chosen)}] {mark:<8} {r.name:<28} {r.role:<8} {r.mode:<9} "
            f"{len(r.verdicts)} case(s) {r.seconds:.1f}s{extra}",
            file=sys.stderr,
            flush=True,
        )

    try:
        results = asyncio.run(check_mutants(chosen, all_cases(), args.timeout, show, args.jobs))
    except (RuntimeError, OSError, TimeoutError) as exc:
        print(f"python -m mutants check: {exc}", file=sys.stderr)
        return EXIT_USAGE
    survivors = [r.name for r in results if not r.caught]
    print(
        f"{len(results)} mutants: {len(results) - len(survivors)} caught, "
        f"{len(survivors)} survived{': ' + ', '.join(survivors) if survivors else ''}"
    )
    if args.json:
        rows = [
            {
                "name": r.name,
                "role": r.role,
                "mode": r.mode,
                "caught": r.caught,
                "seconds": round(r.seconds, 2),
                "verdicts": r.verdicts,
            }
            for r in results
        ]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return EXIT_FAILED if survivors else EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mutants",
        description="The reference testee's mutants: each is one deliberate defect, and names "
        "the conformance cases that catch it.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="each mutant: name, role, how it is applied, its defect")
    env = sub.add_parser(
        "env",
        help="the environment that applies a mutant in a process and those it starts",
        description="Print NAME=VALUE assignments; a process started with them (env $(python "
        "-m mutants env NAME) pdwire node ...) applies the mutant.",
    )
    env.add_argument("name", metavar="NAME")
    check = sub.add_parser(
        "check",
        help="run each mutant against the cases it names; each of them must fail",
        description="Start the reference testees and run each mutant (all, or those named) "
        "against the cases it names; every such case must fail (SHOULD cases are run as "
        "--strict). Exit 0 only when every mutant is caught.",
    )
    check.add_argument("names", nargs="*", metavar="NAME", help="the mutants to check (all)")
    check.add_argument("--json", metavar="PATH", help="write each mutant's verdicts as JSON")
    check.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="check up to N groups of mutants side by side, each in testees of its own (1)",
    )
    check.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds to wait for any one reply of a testee (3)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = {"list": cmd_list, "env": cmd_env, "check": cmd_check}[args.command]
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
