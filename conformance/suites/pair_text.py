"""Pair cases: what D answers (§5.2, §9.1). Greedy disaggregated text must equal D's own
local-prefill text, and D must have decoded from the KV P wrote: a D that recomputes the prompt
instead of loading it, and answers HTTP 200, is the field's worst silent fallback."""

from __future__ import annotations

import asyncio
import time

from ..case import Unsupported, case, expect
from .pair_env import PROMPTS, PairCtx


@case(
    "pair/5.2/1",
    "5.2-R5",
    covers=("9.1-R1", "9.1-R2", "10.10.3"),
    risk=9,
)
async def same_text_as_local(t: PairCtx) -> None:
    """The disaggregated text equals D's local-prefill text, for prompts of several lengths sent
    at once (an HTTP 200 with any other text is a failure)."""
    exchanges = await asyncio.gather(*(t.exchange(t.body(p)) for p in PROMPTS))
    for x in exchanges:
        t.expect_same_text(x, await t.local(x.body))


@case(
    "pair/5.2/2",
    "5.2-R5",
    risk=9,
)
async def same_text_streaming(t: PairCtx) -> None:
    """Streamed, the disaggregated text equals D's local-prefill text streamed."""
    for prompt in PROMPTS[:3]:
        x, local = await t.compare(t.body(prompt, stream=True))
        t.expect_same_text(x, local)


@case(
    "pair/5.2/3",
    "5.2-R5",
)
async def same_text_chat(t: PairCtx) -> None:
    """Chat completions, whole and streamed, give D's local-prefill text."""
    for stream in (False, True):
        x, local = await t.compare(t.body(PROMPTS[1], chat=True, stream=stream))
        t.expect_same_text(x, local)


@case(
    "pair/5.2/4",
    "5.2-R5",
    covers=("4.4-R17", "4.2-R3"),
)
async def d_pulls_what_it_answers(t: PairCtx) -> None:
    """Every request D answers with HTTP 200 was pulled from P at least once: D did not
    recompute the prompt silently."""
    exchanges = await asyncio.gather(*(t.exchange(t.body(p)) for p in PROMPTS[:3]))
    for x in exchanges:
        t.expect_served(x)
        t.expect_pulled(x)


@case(
    "pair/5.2/5",
    "5.2-R5",
    covers=("5.3-R3",),
)
async def d_decodes_what_it_loaded(t: PairCtx) -> None:
    """D decodes from the KV it loaded: when P prefilled another, longer prompt under the
    transfer_id, D does not answer its own local text while claiming it loaded the prompt."""
    body = t.body(PROMPTS[1])
    x = await t.exchange(body, p_body=t.body(PROMPTS[4]))
    local = await t.local(body)
    expect(x.p.ok, f"P's leg failed: {x.p.describe()}")
    t.expect_pulled(x)
    t.log.note("P wrote the KV of another prompt: D's text must not be its local one")
    if not (x.d.ok and x.d.text == local.text):
        return  # D decoded from what it loaded, or saw that it was wrong
    cached = (
        x.d.params.get("remote_prefill_cached_tokens") if isinstance(x.d.params, dict) else None
    )
    expect(
        cached == 0,
        f"P wrote the KV of another prompt into D's blocks, yet D answered HTTP 200 with its "
        f"own local text {local.text!r} (remote_prefill_cached_tokens {cached!r}): it did not "
        "decode from the KV it loaded",
    )


@case(
    "pair/5.2/6",
    "5.2-R4",
    covers=("6.3-R4", "10.11.3", "8.4-R4", "3.5-R1", "3.5-R8", "3.5-R9"),
    risk=6,
)
async def d_keeps_its_deadline(t: PairCtx) -> None:
    """With deadline_ms in its leg and P's leg held back, a D that announces deadline answers
    by its deadline (withdrawing its pulls only where cancel is in use), not when P's KV comes."""
    deadline, bound = 0.3, t.options.answer_bound
    legs = t.legs(t.body(PROMPTS[1]), d_params={"deadline_ms": int(deadline * 1000)})
    sent = time.monotonic()
    d_leg = asyncio.create_task(t.send_d(legs))
    try:
        pulls = await t.observer.named(legs.transfer_id, t.options.request_timeout)
        if not any("deadline" in rec.caps for rec, _ in pulls):
            raise Unsupported(
                "D announced no capability deadline in its pulls (a pdwire/2 D does not to a P "
                "it knows to be legacy): whether it keeps deadline_ms cannot be told"
            )
        await asyncio.wait({d_leg}, timeout=deadline + bound)
        waited = time.monotonic() - sent
        expect(
            d_leg.done(),
            f"D had not answered {waited:.2f}s after a leg with deadline_ms "
            f"{int(deadline * 1000)} (P's leg held back)",
        )
    finally:
        t.log.note("P's leg goes now")
        p = await t.send_p(legs)
        d = await d_leg
    t.log.note(f"D answered {d.describe()} after {d.done_at - sent:.2f}s; P {p.describe()}")
    t.expect_clean("8.4-R4", "3.5-R8", "3.5-R9")
