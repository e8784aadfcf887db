"""How the simulator's wall time grows with requests and with workers.

Run from the repository root: ``python -m tests.bench.sim_scaling [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdwire.sim import SimParams, simulate

FULL_REQUESTS = (10_000, 25_000, 50_000, 100_000)
FULL_INSTANCES = (8, 16, 32, 64)
QUICK_REQUESTS = (200, 400)
QUICK_INSTANCES = (2, 4)


def case(instances: int, requests: int, tp: int, profile: str, fault_rate: float) -> dict[str, Any]:
    params = SimParams(
        prefill_instances=instances,
        decode_instances=instances,
        prefill_tp=tp,
        decode_tp=tp,
        requests=requests,
        arrival_rate=2000.0,
        profile=profile,  # type: ignore[arg-type]
        fault_rate=fault_rate,
    )
    started = time.perf_counter()
    r = simulate(params)
    wall = time.perf_counter() - started
    return {
        "workers_per_side": instances * tp,
        "instances": instances,
        "tp": tp,
        "requests": requests,
        "profile": profile,
        "fault_rate": fault_rate,
        "wall_seconds": wall,
        "us_per_request": 1e6 * wall / requests,
        "late_terminal": r.late_terminal,
        "early_frees": r.early_frees,
        "leaked_blocks": r.leaked_blocks,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.sim_scaling",
        description="Wall time of `pdwire simulate` as requests and workers grow (TP1 engines, "
        "then the same worker count as TP4 engines), both profiles at the largest size.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    requests = QUICK_REQUESTS if args.quick else FULL_REQUESTS
    instances = QUICK_INSTANCES if args.quick else FULL_INSTANCES
    most, biggest = requests[-1], instances[-1]
    plan = [(biggest, n, 1, "pdwire/2", 0.0) for n in requests]
    plan += [(k, requests[0], 1, "pdwire/2", 0.0) for k in instances]
    plan += [(biggest // 4 or 1, requests[0], 4, "pdwire/2", 0.0)]
    plan += [(biggest, most, 1, profile, 0.05) for profile in ("legacy", "pdwire/2")]
    rows = []
    for i, args_ in enumerate(plan, 1):
        print(
            f"[{i}/{len(plan)}] instances={args_[0]} requests={args_[1]} tp={args_[2]} "
            f"{args_[3]} faults={args_[4]}",
            file=sys.stderr,
            flush=True,
        )
        rows.append(case(*args_))
    head = ("workers/side", "tp", "requests", "profile", "faults", "wall s", "us/req", "late")
    print(" ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (
            r["workers_per_side"],
            r["tp"],
            r["requests"],
            r["profile"],
            r["fault_rate"],
            f"{r['wall_seconds']:.1f}",
            f"{r['us_per_request']:.0f}",
            r["late_terminal"],
        )
        print(" ".join(f"{c!s:>12}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps({"cases": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
