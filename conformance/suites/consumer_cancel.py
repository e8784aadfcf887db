"""Consumer cases: when D may reuse the blocks of a request it withdrew with an XferCancel
(§3.5, 3.5-R17). Only the end of the withdrawn pull, or a FINISH to the cancel that lists the
request, tells D that P will write no more into those blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from pdwire.messages import XferResponseStatus
from pdwire.versions import Capability

from ..case import Unsupported, expect
from ..peers.fake_p import FakeP, Received
from .consumer_env import QUIET, ConsumerCtx, Leg, consumer_case

#: The deadline of the withdrawn request: short, so that D sends its cancel soon.
BUDGET = 0.4
#: What a P that cannot decode an XferCancel answers: the decoder's complaint, as vLLM's does.
UNDECODABLE = "Object missing required field `kv_caches_base_addr`"


@dataclasses.dataclass
class Withdrawn:
    """A request D gave up on at its deadline: its leg, the pull P still holds, the cancel."""

    fake: FakeP
    leg: Leg
    pull: Received
    cancel: Received

    @property
    def d_req(self) -> str:
        return self.pull.d_req(self.leg.transfer_id)


async def withdraw(t: ConsumerCtx) -> Withdrawn:
    """A request whose pull P holds unanswered past the request's deadline, and the XferCancel
    D then sends."""
    await t.require_pdwire2(Capability.DEADLINE, Capability.CANCEL)
    fake = await t.fake_p()
    leg = t.start(fake, deadline_ms=int(BUDGET * 1000))
    pull = await t.pull(fake)
    cancel = await t.pull(fake, BUDGET + t.receive_timeout, kind="cancel", what="XferCancel")
    return Withdrawn(fake, leg, pull, cancel)


async def expect_held(w: Withdrawn, window: float, after: str) -> None:
    """D does not answer the request (which frees its blocks) within ``window`` seconds."""
    done, _ = await asyncio.wait([w.leg.task], timeout=window)
    expect(
        not done,
        f"D answered the withdrawn request (its blocks free again) {after}, while the "
        "withdrawn pull was still open and P could still write into them (3.5-R17)",
    )


async def end_pull(t: ConsumerCtx, w: Withdrawn) -> None:
    """P writes the request's blocks after all, then ends the withdrawn pull: only now may D
    answer."""
    w.fake.write(w.pull)
    await w.fake.reply(w.pull, ok=[w.d_req])
    t.expect_failed(await w.leg.result(), "a request D withdrew at its deadline")


@consumer_case("consumer/3.5/2", "3.5-R17", risk=8, timeout=20.0)
async def cancel_error_frees_nothing(t: ConsumerCtx) -> None:
    """P answers D's XferCancel with ERROR, as a P that cannot decode it does (one D took for
    pdwire/2 that is legacy after all), while the withdrawn pull is still open. D keeps the
    request's blocks until that pull ends."""
    w = await withdraw(t)
    await w.fake.reply(w.cancel, XferResponseStatus.ERROR, announce=False, err_msg=UNDECODABLE)
    await expect_held(w, QUIET, "after an ERROR reply to its cancel")
    await end_pull(t, w)


@consumer_case("consumer/3.5/3", "3.5-R17", risk=8, timeout=20.0)
async def cancel_finish_without_the_request(t: ConsumerCtx) -> None:
    """P answers D's XferCancel with a FINISH that does not list the request (P did not
    cancel it). D keeps the request's blocks until the withdrawn pull ends."""
    w = await withdraw(t)
    await w.fake.reply(w.cancel, ok=[])
    await expect_held(w, QUIET, "after a FINISH to its cancel that did not list the request")
    await end_pull(t, w)


@consumer_case("consumer/3.5/4", "3.5-R17", risk=6, timeout=900.0)
async def cancel_timeout_frees_nothing(t: ConsumerCtx) -> None:
    """P never answers D's XferCancel, and keeps the withdrawn pull open with an empty CONTINUE
    halfway through the cancel's receive timeout. Once that timeout has passed, D still keeps
    the request's blocks until the withdrawn pull ends."""
    w = await withdraw(t)
    wait = t.receive_timeout
    if wait / 2 <= QUIET or wait / 2 <= w.cancel.t - w.pull.t:
        raise Unsupported(f"D's receive timeout of {wait}s is too short to tell the two apart")
    await asyncio.sleep(max(0.0, w.cancel.t + wait / 2 - time.monotonic()))  # a moment on D's timer
    await w.fake.reply(w.pull, XferResponseStatus.CONTINUE)
    until = w.cancel.t + wait + QUIET
    await expect_held(w, until - time.monotonic(), "once its cancel timed out")
    await end_pull(t, w)
