"""Pair cases: what P and D announce and what each then sends (§8, §9.3). The observer can show
D the same P as a legacy bootstrap server would (no pdwire/2 field), so a pdwire/2 pair is seen
speaking both profiles."""

from __future__ import annotations

import asyncio

from ..case import Unsupported, case, expect
from .pair_env import PROMPTS, PairCtx


@case(
    "pair/8.3/1",
    "8.3-R1",
    covers=("3.2-R20", "8.4-R1", "4.2-R11", "8.2-R2", "8.2-R3", "3.2-R14"),
)
async def d_speaks_legacy_to_a_legacy_p(t: PairCtx) -> None:
    """To a P whose /query entry shows it legacy, D sends pulls with no pdwire/2 field; to a P
    known to speak pdwire/2, a D that announces keeps announcing."""
    legacy = await t.new_view(legacy=True)
    fresh = await t.new_view()
    exchanges = await asyncio.gather(
        *(t.exchange(t.body(p), view=legacy) for p in PROMPTS[:2]),
        t.exchange(t.body(PROMPTS[2]), view=fresh),
    )
    t.expect_clean("8.3-R1")
    expect(
        any(r.view == legacy and r.kind == "pull" for r in t.observer.records),
        "D sent no pull to P under the legacy view",
    )
    for x in exchanges:
        t.expect_served(x)


@case(
    "pair/8.4/1",
    "8.4-R3",
    covers=("3.4-R6", "7.2-R2", "7.2-R3", "8.1-R1", "3.2-R15"),
)
async def p_answers_legacy_to_a_legacy_d(t: PairCtx) -> None:
    """P's replies to a pull that did not announce pdwire/2 carry no pdwire/2 field (no version,
    capabilities or error codes)."""
    legacy = await t.new_view(legacy=True)
    exchanges = await asyncio.gather(*(t.exchange(t.body(p), view=legacy) for p in PROMPTS[:2]))
    t.expect_pulled_and_served(exchanges)
    unannounced = [r for r in t.observer.records if r.kind == "pull" and not r.announced]
    if not unannounced:
        raise Unsupported("D announced pdwire/2 in every pull, even to a P shown as legacy")
    t.expect_clean("8.4-R3", "7.2-R3")


@case(
    "pair/3.4/3",
    "3.4-R7",
    covers=("8.2-R4",),
)
async def p_announces_to_an_announcing_d(t: PairCtx) -> None:
    """A pdwire/2 P answers every pull that announced pdwire/2 with its own version and
    capabilities."""
    if t.env.p_version < 2:
        raise Unsupported("P's /query entry does not announce pdwire/2")
    fresh = await t.new_view()
    exchanges = await asyncio.gather(*(t.exchange(t.body(p), view=fresh) for p in PROMPTS[:2]))
    t.expect_pulled_and_served(exchanges)
    if not any(r.kind == "pull" and r.announced for r in t.observer.records):
        raise Unsupported("D did not announce pdwire/2 (a legacy D)")
    t.expect_clean("3.4-R7")


@case(
    "pair/9.3/1",
    "9.3-R2",
    covers=("3.2-R12", "3.2-R13", "3.7-R6", "3.4-R3", "3.4-R4"),
)
async def layout_omitted_only_after_echo(t: PairCtx) -> None:
    """D omits its layout from a pull only to a P worker that has echoed its layout_id; P's
    echoes and D's omissions keep the layout cache in step."""
    fresh = await t.new_view()
    exchanges = [await t.exchange(t.body(p), view=fresh) for p in PROMPTS[:3]]
    t.expect_clean("9.3-R2", "3.2-R12", "3.4-R3")
    t.expect_pulled_and_served(exchanges)
