"""The model-free node's work on a request's KV against memcpy of the same bytes, in one run.

Run from the repository root: ``python -m tests.bench.node_ratios [--quick] [--json PATH]``.
The seeds' request on one worker of TP 1: 36 layers, 8 KV heads of 128 channels, bf16, 1000
tokens in 63 blocks of 16 (148.6 MB with the last block's padding). P fills the blocks
(``write_prompt``) and digests them; D compares every byte with the expected KV (``verify``)
and digests them. Each round times memcpy of the same number of bytes beside each operation,
so a round's ratio compares neighbours in time. Nothing here asserts timings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from reference_connector.kv_content import BlockTable, KVShape
from reference_connector.kv_pool import KVPool

from .codec_ratios import Settings, bench_main

SHAPE: Final = KVShape(
    num_layers=36, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=80, vocab=32000
)
PROMPT: Final = list(range(1000))
TABLE: Final = BlockTable.split(list(range(1, 64)), [63], [0])
CASE_NAMES: Final = ("fill (write_prompt)", "verify", "digest")


def _seconds(op: Callable[[], object], target_s: float) -> float:
    """The best of the runs of ``op`` that fit in about ``target_s`` (at least two)."""
    best, spent, runs = float("inf"), 0.0, 0
    while spent < target_s or runs < 2:
        t0 = time.perf_counter()
        op()
        elapsed = time.perf_counter() - t0
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def run_all(settings: Settings) -> list[dict[str, Any]]:
    pool = KVPool(SHAPE, 1, 0, 1, 0)
    nbytes = pool.write_prompt(PROMPT, TABLE)
    assert pool.verify(PROMPT, TABLE) == (True, nbytes)
    src = torch.empty(nbytes // 2, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the pages of both, touched before any timing

    def digest() -> None:
        pool.digest(pool.new_digest(), TABLE, 0, len(PROMPT))

    ops: dict[str, Callable[[], object]] = {
        CASE_NAMES[0]: lambda: pool.write_prompt(PROMPT, TABLE),
        CASE_NAMES[1]: lambda: pool.verify(PROMPT, TABLE),
        CASE_NAMES[2]: digest,
    }
    target = settings.target_s * 10  # an operation takes tens of milliseconds
    cases = []
    for name, op in ops.items():
        rounds = [
            (_seconds(op, target), _seconds(lambda: dst.copy_(src), target))
            for _ in range(max(3, settings.repeats // 8))
        ]
        best_op = min(r[0] for r in rounds)
        best_copy = min(r[1] for r in rounds)
        cases.append(
            {
                "case": name,
                "bytes": nbytes,
                "gb_per_s": round(nbytes / best_op / 1e9, 3),
                "memcpy_gb_per_s": round(nbytes / best_copy / 1e9, 3),
                "ratio": round(statistics.median(c / o for o, c in rounds), 3),
            }
        )
    return cases


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'case':<22} {'MB':>8} {'GB/s':>8} {'memcpy GB/s':>12} {'ratio':>7}",
        *(
            f"{c['case']:<22} {c['bytes'] / 1e6:>8.1f} {c['gb_per_s']:>8.2f} "
            f"{c['memcpy_gb_per_s']:>12.2f} {c['ratio']:>7.3f}"
            for c in cases
        ),
        "ratio: the operation's speed over memcpy's on the same bytes, median of the rounds",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(
        argv,
        "python -m tests.bench.node_ratios",
        "The model-free node's KV fill, verification and digest against memcpy",
        run_all,
        format_table,
    )


if __name__ == "__main__":
    raise SystemExit(main())
