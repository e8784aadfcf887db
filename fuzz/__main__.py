"""``python -m fuzz``: run the fuzz targets under atheris and report their executions.

Each target runs in its own process, from its corpus in ``fuzz/corpus/<target>/``; new inputs
are kept only with ``--update-corpus``. A crash's input is written under ``--artifacts`` and the
command exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import runner, seeds
from .targets import TARGETS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fuzz",
        description="Coverage-guided fuzzing (atheris) of pdwire's decoders and sessions.",
    )
    p.add_argument(
        "--target",
        action="append",
        metavar="NAME",
        help="a target (repeatable), 'all' (the default), or module:function / file.py:function",
    )
    p.add_argument("--runs", type=int, help="executions per target at most (libFuzzer -runs)")
    p.add_argument(
        "--seconds",
        type=float,
        help="time per target at most (libFuzzer -max_total_time); default 10 without --runs",
    )
    p.add_argument("--corpus", type=Path, default=runner.CORPUS, help="corpus root folder")
    p.add_argument("--artifacts", type=Path, default=runner.CRASHES, help="where crashes go")
    p.add_argument("--timeout", type=int, default=5, help="seconds one input may take (a hang)")
    p.add_argument(
        "--update-corpus",
        action="store_true",
        help="merge the new inputs that add coverage into the corpus (-merge=1)",
    )
    p.add_argument("--seed", action="store_true", help="write the seed inputs into the corpus")
    p.add_argument("--list", action="store_true", help="list the targets and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print libFuzzer's log")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, target in TARGETS.items():
            doc = (target.__doc__ or "").strip().splitlines()
            print(f"{name:12} {doc[0] if doc else ''}")
        return 0
    if args.seed:
        for name, count in seeds.write(args.corpus).items():
            print(f"{name:12} {count} inputs in {args.corpus / name}")
        return 0
    names = args.target or ["all"]
    if "all" in names:
        names = [n for n in names if n != "all"] + list(TARGETS)
    unknown = [n for n in names if n not in TARGETS and ":" not in n]
    if unknown:
        print(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    seconds = 10.0 if args.runs is None and args.seconds is None else args.seconds
    total = crashed = 0
    for name in names:
        result = runner.run(
            name,
            runs=args.runs,
            seconds=seconds,
            corpus=args.corpus,
            artifacts=args.artifacts,
            timeout=args.timeout,
            update_corpus=args.update_corpus,
        )
        if args.verbose or result.crashed:
            print(result.log[-6000:], file=sys.stderr)
        print(result.line(), flush=True)
        total += result.executions
        crashed += result.crashed
    print(f"{'total':12} {total:>10,} executions, {len(names)} targets, {crashed} crashed")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
