"""Pair cases: the side channel between a real P and D, as the observer relays it (§3.1, §3.4).
Every frame is decoded and checked as it passes; a case fails on the problems of its topic."""

from __future__ import annotations

import asyncio

from ..case import case, expect
from .pair_env import PROMPTS, Exchange, PairCtx


async def _traffic(t: PairCtx, n: int = 3) -> list[Exchange]:
    """A few requests at once, and a pause to see anything P sends after its terminal replies."""
    exchanges = await asyncio.gather(*(t.exchange(t.body(p)) for p in PROMPTS[:n]))
    await t.observer.quiet()
    return list(exchanges)


@case(
    "pair/3.1/1",
    "3.1-R4",
    covers=("3.1-R6",),
)
async def replies_reach_d_as_one_frame(t: PairCtx) -> None:
    """Every reply P sends reaches D's DEALER as one frame (P sends [identity, payload], with no
    delimiter)."""
    exchanges = await _traffic(t)
    t.expect_clean("3.1-R4")
    t.expect_pulled_and_served(exchanges)


@case(
    "pair/3.1/2",
    "3.1-R3",
    covers=("3.1-R2",),
)
async def pulls_are_one_frame_on_a_new_socket(t: PairCtx) -> None:
    """D sends each pull as one frame on a socket of its own, and nothing else on it."""
    exchanges = await _traffic(t)
    t.expect_clean("3.1-R3")
    t.expect_pulled_and_served(exchanges)


@case(
    "pair/3.4/1",
    "3.4-R14",
    covers=("3.4-R15", "3.3-R2", "8.4-R5", "7.3-R1", "2.1-R1", "3.4-R26", "3.4-R3", "12.4-R1"),
)
async def one_terminal_reply_per_pull(t: PairCtx) -> None:
    """P ends every pull with exactly one terminal reply and sends nothing after it; every
    frame either side sends decodes."""
    exchanges = await _traffic(t)
    t.expect_clean("3.4-R14", "3.4-R15", "3.3-R2", "7.3-R1", "3.4-R3")
    t.require_traffic()
    open_pulls = [r for r in t.observer.records if r.kind == "pull" and r.terminal_at is None]
    expect(
        not open_pulls,
        f"{len(open_pulls)} pull(s) got no terminal reply, e.g. to P worker "
        f"{open_pulls[0].worker if open_pulls else ''}",
    )
    for x in exchanges:
        t.expect_served(x)


@case(
    "pair/3.4/2",
    "3.4-R16",
    covers=("3.4-R17", "3.4-R18", "3.2-R6"),
)
async def each_request_listed_once(t: PairCtx) -> None:
    """Over the replies of each pull, P lists every request of the pull exactly once (by its
    FINISH) and none it was not sent."""
    exchanges = await _traffic(t)
    t.expect_clean("3.4-R16", "3.4-R17", "3.4-R18", "3.2-R6")
    t.expect_pulled_and_served(exchanges)
