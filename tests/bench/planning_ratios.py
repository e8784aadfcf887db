"""pdwire's vectorised ``descriptors`` against a plain Python per-block loop.

Run from the repository root: ``python -m tests.bench.planning_ratios [--quick] [--json PATH]``.
The seeds' request: 36 layers x K/V = 72 regions, 63 blocks, 32768-byte blocks (16 tokens x
8 heads x 128 dims x 2 bytes). Each case checks first that both give the same bytes, expanded
per block; nothing here asserts timings.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import sys
import timeit
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pdwire.planning import (
    Descriptors,
    Plan,
    PlanError,
    Region,
    Side,
    descriptors,
    prepare,
    regions_of_pull,
)
from pdwire.vectors import SEED_BLOCK_BYTES, seed_pull

from .codec_ratios import Settings, _loop_size, bench_main

BLOCKS_PER_REQUEST: Final = 63
POOL: Final = 20_000  # blocks per region
SEED: Final = 20_240_601
P_BASE: Final = 0x7E00_0000_0000

Blocks = list[list[int]]
Lists = tuple[list[int], list[int], list[int]]  # what a transfer engine's batch write takes


# -- the baseline -----------------------------------------------------------------------------


def loop_descriptors(plan: Plan, src_blocks: Blocks, dst_blocks: Blocks) -> Lists:
    """The straightforward implementation: one (src, dst, length) per region and block."""
    src_ptrs: list[int] = []
    dst_ptrs: list[int] = []
    lengths: list[int] = []
    if all(not group for group in dst_blocks):
        return src_ptrs, dst_ptrs, lengths
    chosen = [(s[len(s) - len(d) :], d) for s, d in zip(src_blocks, dst_blocks, strict=True)]
    for rp in plan.regions:
        if not rp.write:
            continue
        src_ids, dst_ids = chosen[rp.src.group_index]
        src_base, src_stride = rp.src.base_addr + rp.src_offset, rp.src.block_len
        dst_base, dst_stride = rp.dst.base_addr + rp.dst_offset, rp.dst.block_len
        for p_block, d_block in zip(src_ids, dst_ids, strict=True):
            src_ptrs.append(src_base + p_block * src_stride)
            dst_ptrs.append(dst_base + d_block * dst_stride)
            lengths.append(rp.length)
    return src_ptrs, dst_ptrs, lengths


def expand(src: Any, dst: Any, length: Any, unit: int) -> npt.NDArray[np.uint64]:
    """Every descriptor cut into ``unit``-byte pieces, in order: an (n, 2) array of addresses."""
    src, dst, length = (np.asarray(a, dtype=np.uint64) for a in (src, dst, length))
    pieces = (length // np.uint64(unit)).astype(np.intp)
    first = np.cumsum(pieces) - pieces
    step = (np.arange(int(pieces.sum())) - np.repeat(first, pieces)).astype(np.uint64)
    step *= np.uint64(unit)
    return np.stack([np.repeat(src, pieces) + step, np.repeat(dst, pieces) + step], axis=1)


def same_bytes(vectorised: Descriptors, loop: Lists) -> bool:
    """Whether both copy the same bytes to the same places, in the same order."""
    unit = int(np.gcd.reduce(np.concatenate([vectorised.length, np.asarray(loop[2], np.uint64)])))
    v = expand(vectorised.src, vectorised.dst, vectorised.length, unit)
    return bool(np.array_equal(v, expand(*loop, unit)))


# -- cases ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    plan: Plan
    src_blocks: Blocks
    dst_blocks: Blocks
    block_bytes: int  # P's payload per block and region

    def vectorised(self) -> Descriptors:
        result = descriptors(self.plan, self.src_blocks, self.dst_blocks)
        assert not isinstance(result, PlanError), result
        return result

    def loop(self) -> Lists:
        return loop_descriptors(self.plan, self.src_blocks, self.dst_blocks)


def _consumer() -> tuple[Side, list[int]]:
    """D as the seeds' pull describes it (TP 1), and the pull's block ids (a random sample)."""
    pull = seed_pull(1, BLOCKS_PER_REQUEST, seed=SEED)
    ((_, (blocks,)),) = pull.req_blocks.values()
    return Side(1, 0, 1, regions_of_pull(pull)), blocks


def _producer(consumer: Side, tp: int, rank: int) -> Side:
    payload = SEED_BLOCK_BYTES // tp
    regions = tuple(
        Region(r.layer_name, r.layer_index, P_BASE + i * POOL * payload, payload, payload)
        for i, r in enumerate(consumer.regions)
    )
    return Side(tp, rank, 1, regions)


def _contiguous() -> tuple[list[int], list[int]]:
    return list(range(1000, 1000 + BLOCKS_PER_REQUEST)), list(
        range(7000, 7000 + BLOCKS_PER_REQUEST)
    )


def _fragmented(dst: list[int]) -> tuple[list[int], list[int]]:
    return random.Random(SEED).sample(range(POOL), BLOCKS_PER_REQUEST), dst


IdsFor = Callable[[list[int]], tuple[list[int], list[int]]]  # D's pulled ids -> (P's, D's)


def _case(name: str, tp: int, rank: int, ids: IdsFor) -> Case:
    consumer, pulled = _consumer()
    producer = _producer(consumer, tp, rank)
    plan = prepare(producer, consumer)
    assert isinstance(plan, Plan), plan
    src, dst = ids(pulled)
    return Case(name, plan, [src], [dst], SEED_BLOCK_BYTES // tp)


CASE_NAMES: Final = ("TP1->TP1 contiguous", "TP1->TP1 fragmented", "TP2->TP1 contiguous")


@functools.cache
def case(name: str) -> Case:
    builders: dict[str, Callable[[], Case]] = {
        "TP1->TP1 contiguous": lambda: _case(name, 1, 0, lambda _: _contiguous()),
        "TP1->TP1 fragmented": lambda: _case(name, 1, 0, _fragmented),
        # P rank 1 writes the second half of each D block: offsets, so no coalescing.
        "TP2->TP1 contiguous": lambda: _case(name, 2, 1, lambda _: _contiguous()),
    }
    return builders[name]()


def check(c: Case) -> None:
    if not same_bytes(c.vectorised(), c.loop()):
        raise AssertionError(f"{c.name}: the vectorised descriptors differ from the loop's")


# -- timing -----------------------------------------------------------------------------------

IMPLS: Final = ("vectorised", "loop")


@dataclasses.dataclass(frozen=True)
class Timing:
    best_us: dict[str, float]
    ratio: float  # median over rounds of vectorised / loop


def time_case(c: Case, settings: Settings) -> Timing:
    """Each round times both back to back (order alternating), so load from other processes
    cancels out of the median of the rounds' ratios."""
    timers = {
        "vectorised": timeit.Timer(c.vectorised),
        "loop": timeit.Timer(c.loop),
    }
    numbers = {impl: _loop_size(t, settings.target_s) for impl, t in timers.items()}
    rounds: list[dict[str, float]] = []
    for r in range(settings.repeats):
        per_call = {}
        for impl in IMPLS if r % 2 == 0 else reversed(IMPLS):
            per_call[impl] = timers[impl].timeit(numbers[impl]) / numbers[impl]
        rounds.append(per_call)
    best = {impl: min(r[impl] for r in rounds) * 1e6 for impl in IMPLS}
    return Timing(best, statistics.median(r["vectorised"] / r["loop"] for r in rounds))


def run_case(c: Case, settings: Settings) -> dict[str, Any]:
    check(c)
    t = time_case(c, settings)
    return {
        "case": c.name,
        "regions": len(c.plan.regions),
        "blocks": len(c.dst_blocks[0]),
        "block_bytes": c.block_bytes,
        "vectorised_us": t.best_us["vectorised"],
        "vectorised_descriptors": len(c.vectorised()),
        "loop_us": t.best_us["loop"],
        "loop_descriptors": len(c.loop()[0]),
        "ratio": t.ratio,
        "same_bytes": True,
    }


def run_all(settings: Settings) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for i, name in enumerate(CASE_NAMES, 1):
        print(f"[{i}/{len(CASE_NAMES)}] {name}", file=sys.stderr, flush=True)
        results.append(run_case(case(name), settings))
    return results


# -- output -----------------------------------------------------------------------------------

COLUMNS: Final = (  # key, title, width, format
    ("case", "case", 20, "{}"),
    ("block_bytes", "block B", 7, "{}"),
    ("vectorised_us", "vectorised us", 13, "{:.1f}"),
    ("vectorised_descriptors", "descs", 5, "{}"),
    ("loop_us", "loop us", 9, "{:.1f}"),
    ("loop_descriptors", "descs", 5, "{}"),
    ("ratio", "ratio", 6, "{:.3f}"),
)


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    def row(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, (_, _, w, _)) in enumerate(zip(cells, COLUMNS, strict=True))
        )

    lines = [row([title for _, title, _, _ in COLUMNS]), row(["-" * w for _, _, w, _ in COLUMNS])]
    lines += [row([fmt.format(c[key]) for key, _, _, fmt in COLUMNS]) for c in cases]
    lines.append(
        "per request of 72 regions x 63 blocks; us = best per request; descs = descriptors per "
        "request; ratio = median over rounds of vectorised / loop timed back to back"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(
        argv,
        "python -m tests.bench.planning_ratios",
        "Time pdwire.planning.descriptors (numpy, coalescing runs of blocks) against a plain "
        "Python loop that writes one descriptor per block, on the seeds' request (72 regions x "
        "63 blocks of 32768 bytes): contiguous and fragmented block ids at TP1->TP1, and "
        "TP2->TP1. Each case runs 41 rounds; a round times both back to back over a loop of "
        "about 20 ms, and the ratio is the median of the rounds' ratios.",
        run_all,
        format_table,
    )


if __name__ == "__main__":
    sys.exit(main())
