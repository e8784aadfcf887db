"""Consumer cases: the release-only request a D sends for a request it will not load
(§10.10.8), so that P frees its blocks at once instead of at its expiry."""

from __future__ import annotations

import asyncio
from typing import Final

from pdwire.messages import XferResponseStatus

from ..case import Unsupported, expect
from ..peers.fake_p import FakeP, Received
from .consumer_env import FAST, ConsumerCtx, Leg, consumer_case, names

#: max_tokens of the requests that fill D: a D that reserves blocks for the whole sequence
#: fills after a few (the reference testees hold 256 blocks of 4 tokens).
FILL_TOKENS: Final = 256
#: How many requests the case sends D to fill it before it gives up (unsupported).
MAX_FILL: Final = 64
#: A request whose pull has not come this long after it was sent waits in D for blocks.
QUEUED_S: Final = FAST
#: How long D may take to send its release-only request once the client went away.
RELEASE_S: Final = 10.0


def _release_only(rx: Received, transfer: str) -> bool:
    assert rx.pull is not None
    return not any(rx.pull.req_blocks[rx.d_req(transfer)][1])


async def _pull_for(fake: FakeP, leg: Leg, timeout: float) -> Received | None:
    rx = await fake.next(timeout, lambda r: r.kind == "pull" and names(r, leg.transfer_id))
    expect(rx is None or rx.error is None, f"D sent {rx.describe() if rx else ''}")
    return rx


async def fill_until_queued(t: ConsumerCtx, fake: FakeP, held: list[tuple[Leg, Received]]) -> Leg:
    """Send D requests whose pulls ``fake`` holds unanswered (kept in ``held``) until one gets
    no pull within QUEUED_S: D holds it back, waiting for blocks. That request's leg;
    unsupported when D answers instead, or pulls for each of MAX_FILL requests."""
    for _ in range(MAX_FILL):
        leg = t.start(fake, body={"max_tokens": FILL_TOKENS})
        rx = await _pull_for(fake, leg, QUEUED_S)
        if rx is None:
            if leg.task.done():
                got = await leg.result()
                raise Unsupported(
                    f"D answered a request of max_tokens {FILL_TOKENS} with HTTP "
                    f"{got.status} {got.error or got.body!r} before it pulled"
                )
            t.log.note(f"no pull within {QUEUED_S}s: D holds the request back")
            return leg
        held.append((leg, rx))
    raise Unsupported(
        f"D pulled for each of {MAX_FILL} requests of max_tokens {FILL_TOKENS} without "
        "holding one back: the case could not fill its blocks"
    )


async def fail_held(t: ConsumerCtx, fake: FakeP, held: list[tuple[Leg, Received]]) -> None:
    """Fail the held pulls, and wait until D answered their requests: D frees their blocks
    before the next case needs them."""
    for _leg, rx in held:
        await fake.reply(
            rx,
            XferResponseStatus.ERROR,
            err_msg="the fake P failed this pull",
            err_code="INTERNAL",
        )
    if held:
        await asyncio.wait([leg.task for leg, _ in held], timeout=t.options.request_timeout)


async def release_only_after_abort(
    t: ConsumerCtx,
    fake: FakeP,
    leg: Leg,
    held: list[tuple[Leg, Received]],
    *,
    answer: bool = True,
) -> Received | None:
    """Abort ``leg``, a request D holds back, and return the release-only request D then sends
    for it, answered ok unless not ``answer``; None when D had allocated its blocks before the
    abort reached it: it then pulls with blocks (held, like the others), not the moment a case
    about release-only requests needs."""
    leg.task.cancel()
    rx = await _pull_for(fake, leg, RELEASE_S)
    expect(
        rx is not None,
        f"D sent P nothing for a request aborted while it waited for blocks, within "
        f"{RELEASE_S}s: P keeps its blocks until they expire",
    )
    assert rx is not None
    if not _release_only(rx, leg.transfer_id):
        t.log.note("D pulled it with blocks after all")
        held.append((leg, rx))
        return None
    if answer:
        await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)])
    return rx


@consumer_case(
    "consumer/10.10/4",
    "10.10.8",
)
async def release_only_for_an_abort_before_allocation(t: ConsumerCtx) -> None:
    """D is filled with requests whose pulls the fake P holds unanswered, until a request gets
    no pull: D waits for blocks to hold it. That request is aborted, its HTTP connection
    closed; D must then send a release-only request for it (a pull naming its transfer_id with
    every block list empty), and P answers it. The held pulls fail at the end."""
    fake = await t.fake_p()
    held: list[tuple[Leg, Received]] = []
    try:
        for _ in range(MAX_FILL):
            queued = await fill_until_queued(t, fake, held)
            if await release_only_after_abort(t, fake, queued, held) is not None:
                return
        raise Unsupported(f"D allocated each of {MAX_FILL} aborted requests before the abort")
    finally:
        await fail_held(t, fake, held)
