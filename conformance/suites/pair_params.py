"""Pair cases: kv_transfer_params in the answers of P and D (§5.3)."""

from __future__ import annotations

import asyncio

from ..case import Unsupported, case, expect
from .pair_env import PROMPTS, PairCtx


@case(
    "pair/5.3/1",
    "5.3-R1",
    covers=("5.3-R2",),
)
async def p_answers_null_params(t: PairCtx) -> None:
    """P's answer to the P leg carries kv_transfer_params null."""
    x = await t.exchange(t.body(PROMPTS[0]))
    t.expect_served(x)
    expect(
        x.p.has_params,
        f"P's answer has no kv_transfer_params key: {x.p.describe()}",
    )
    expect(
        x.p.params is None,
        f"P's answer carries kv_transfer_params {x.p.params!r}, not null",
    )


@case(
    "pair/5.3/2",
    "5.3-R3",
)
async def cached_tokens_are_the_loaded_tokens(t: PairCtx) -> None:
    """D's remote_prefill_cached_tokens, when present, is the number of prompt tokens it loaded:
    no more than the prompt, and as many blocks as D pulled."""
    bodies = [t.body(p, stream=s) for p in PROMPTS[:4] for s in (False, True)][:6]
    exchanges = await asyncio.gather(*(t.exchange(b) for b in bodies))
    seen = 0
    block_size = t.env.block_size
    for x in exchanges:
        t.expect_served(x)
        params = x.d.params if isinstance(x.d.params, dict) else {}
        cached = params.get("remote_prefill_cached_tokens")
        if cached is None:
            continue
        seen += 1
        prompt = x.d.prompt_tokens
        expect(isinstance(cached, int) and cached >= 0, f"remote_prefill_cached_tokens {cached!r}")
        if prompt is not None:
            expect(
                cached <= prompt,
                f"D reports {cached} prompt tokens loaded of a {prompt}-token prompt "
                f"(transfer {x.transfer_id})",
            )
        pulls = t.pulls(x)
        asked = max((len(g) for r, d in pulls for g in r.blocks(d)[:1]), default=0)
        if block_size and asked:
            expect(
                -(-cached // block_size) == asked,
                f"D reports {cached} prompt tokens loaded but pulled {asked} blocks of "
                f"{block_size} tokens (transfer {x.transfer_id})",
            )
    if not seen:
        raise Unsupported("D's answers carry no remote_prefill_cached_tokens")
