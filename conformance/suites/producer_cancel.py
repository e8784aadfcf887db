"""Producer cases: XferCancel (§3.5), which withdraws D's requests from P's waiting pulls and
counts them as settled. Each is unsupported against a P that does not announce ``cancel``."""

from __future__ import annotations

import asyncio
import time
from typing import Final

from pdwire import error_strings
from pdwire.messages import XferResponseStatus
from pdwire.versions import Capability

from ..case import case, expect, expect_equal
from .producer_env import ProducerCtx
from .producer_pairing import expect_settled, half_pulled
from .producer_timers import expect_failed
from .producer_v2 import QUICK

FINISH = XferResponseStatus.FINISH
#: How long after P's leg answered the case watches for a write into withdrawn blocks.
WRITE_WATCH_S: Final = 1.0


@case(
    "producer/3.5/1",
    "3.5-R12",
    covers=("3.5-R7", "3.5-R8", "3.5-R9", "3.5-R13", "3.1-R7", "10.11.2", "7.1-R4"),
    risk=10,
)
async def cancel_ends_a_waiting_pull(t: ProducerCtx) -> None:
    """A cancel withdraws a waiting pull: the cancel gets FINISH listing the request (and no
    request P held nothing for), the pull ends at once with it in err_reqs, "Request
    cancelled by the consumer." and the code CANCELLED."""
    t.require_cap(Capability.CANCEL)
    worker = t.worker(1, 0)
    waiting, unknown = t.new_d_req(), t.new_d_req()
    tid = t.new_transfer_id()
    addr = t.addr()
    pull = asyncio.create_task(
        t.pull(worker, addr, {waiting: (tid, [[0]])}, announce=True, timeout=QUICK + 1.0)
    )
    await asyncio.sleep(0.2)  # the pull must be waiting at P: nothing to await from outside
    start = time.monotonic()
    reply = await t.cancel(worker, addr, {waiting: tid, unknown: t.new_transfer_id()})
    r = await pull
    expect(
        reply.status is FINISH and len(reply.replies) == 1,
        f"the cancel: expected one FINISH, got {reply.describe()}",
    )
    expect_equal(sorted(reply.ok()), [waiting], "the cancel's ok_reqs")
    expect(time.monotonic() - start < QUICK, "the cancelled pull did not end at once")
    expect_failed(r, waiting, "the cancelled pull", {"CANCELLED": error_strings.CANCELLED})
    assert r.terminal is not None
    expect_equal((r.terminal.err_codes or {}).get(waiting), "CANCELLED", "err_codes")


@case(
    "producer/3.5/2",
    "3.5-R15",
    covers=("3.5-R14", "3.5-R9"),
)
async def cancel_counts_as_settled(t: ProducerCtx) -> None:
    """With D's TP twice P's, one paired D rank pulls and the other cancels: the transfer is
    settled, P frees it at once, and a further pull is not served."""
    t.require_cap(Capability.CANCEL)
    async with half_pulled(t) as h:
        for w in h.others:
            for addr in t.targets(w):
                reply = await t.cancel(w, addr, {h.d_req: h.transfer})
                expect(
                    reply.status is FINISH and reply.ok() == [h.d_req],
                    f"a cancel to {addr}: expected FINISH listing {h.d_req}, got "
                    f"{reply.describe()}",
                )
        await expect_settled(t, h, QUICK, "every paired D rank pulled or cancelled")


@case(
    "producer/3.5/3",
    "3.5-R11",
)
async def no_write_after_a_cancel(t: ProducerCtx) -> None:
    """A pull waits for a transfer P has not prefilled yet, and D cancels it at every P worker
    it pairs with: the pull ends with the request cancelled. P then prefills the transfer; it
    must not write into the blocks the withdrawn request named, neither while its leg runs nor
    in the second after it answered."""
    t.require_cap(Capability.CANCEL)
    worker = t.worker(1, 0)
    d_req, tid = t.new_d_req(), t.new_transfer_id()
    addrs = t.targets(worker)
    blocks = worker.take(t.blocks_for())
    try:
        pull = asyncio.create_task(
            t.pull(worker, addrs[0], {d_req: (tid, [blocks])}, announce=True, timeout=QUICK + 1.0)
        )
        await asyncio.sleep(0.2)  # the pull must be waiting at P: nothing to await from outside
        for addr in addrs:  # at each, so that no P worker keeps the transfer until it expires
            reply = await t.cancel(worker, addr, {d_req: tid})
            expect(
                reply.status is FINISH,
                f"the cancel at {addr}: expected FINISH, got {reply.describe()}",
            )
        expect_failed(
            await pull, d_req, "the cancelled pull", {"CANCELLED": error_strings.CANCELLED}
        )
        t.expect_leg_ok(await t.prefill(tid))
        await asyncio.sleep(WRITE_WATCH_S)  # a write that must not come: only a watch shows it
        pairs = len(worker.regions) * len(blocks)
        written = pairs - len(worker.unwritten(blocks))
        expect(
            written == 0,
            f"P wrote into {written} of the {pairs} (region, block) pairs of the request D had "
            "cancelled, once it prefilled the request's transfer",
        )
    finally:
        worker.give_back(blocks)
