"""Consumer cases: how a D with vLLM 0.34's KV lease renews it (§3.9, §6.4), measured against
the testee's lease `L` (``kv_lease_duration``, ``--kv-lease-duration``): the period, the P
workers it renews at, how long it renews (while queued, until the load settles, not past a
release-only request), and that a refused renewal fails nothing."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Final

from ..case import Unsupported, expect, expect_equal
from ..peers.fake_p import FakeP, Received
from .consumer_env import ConsumerCtx, Leg, consumer_case
from .consumer_release import fail_held, fill_until_queued, release_only_after_abort

#: How late a renewal may come past its period: D checks its timers once per engine step.
LATE: Final = 0.5
#: Renewals this close to the settling of a load may have been on their way already.
IN_FLIGHT: Final = 0.1
#: How many requests consumer/6.4/2 holds back and aborts, each checked, until D sends a
#: release-only request for one rather than allocating it before the abort reached it.
QUEUE_TRIES: Final = 3


def expect_heartbeat_frames(renewals: list[Received]) -> None:
    """Each renewal is the one frame of a socket of its own, a map of the one key
    ``lease_transfer_ids`` (3.9-R1, 3.9-R2)."""
    identities = [rx.identity for rx in renewals]
    expect(
        len(set(identities)) == len(identities),
        "D sent two renewals on one socket: each needs a DEALER of its own",
    )
    for rx in renewals:
        expect_equal(len(rx.frames), 2, "frames at P's ROUTER (identity and one frame)")
        expect_equal(rx.keys, ["lease_transfer_ids"], "the keys of a renewal")


def expect_period(times: list[float], period: float, what: str) -> None:
    """Consecutive renewals come one period apart: not sooner, not much later."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    expect(
        all(0.8 * period <= g <= period + LATE for g in gaps),
        f"{what}: renewals {[round(g, 2) for g in gaps]}s apart, expected L/6 = {period:.2f}s",
    )


def renewals_after(fake: FakeP, leg: Leg, t0: float) -> list[Received]:
    return [rx for rx in fake.renewals(leg.transfer_id) if rx.t > t0 + IN_FLIGHT]


@consumer_case(
    "consumer/6.4/1",
    "6.4-R7",
    covers=("6.4-R6", "3.9-R1", "3.9-R2", "3.9-R4"),
)
async def renews_every_paired_worker_until_settled(t: ConsumerCtx) -> None:
    """While a fake P of TP 2 holds D's pulls for 3.5 L/6, each of its workers gets a renewal
    every L/6 naming the transfer, each the one frame of its own socket; once both pulls are
    served, no renewal names it any more."""
    lease = t.require_lease()
    period = lease / 6
    fake = await t.fake_p(tp=2)
    leg = t.start(fake)
    pulls = await t.pulls(fake, leg, 2)
    for rx in pulls:
        expect("lease_transfer_ids" not in rx.keys, "D's pull carries lease_transfer_ids")
    await asyncio.sleep(3.5 * period)  # D's renewal timer: nothing to await from outside
    renewals = fake.renewals(leg.transfer_id)
    expect_heartbeat_frames(renewals)
    for worker in ((0, 0), (1, 0)):
        times = [rx.t for rx in renewals if rx.worker == worker]
        expect(
            len(times) >= 3,
            f"P worker {worker} got {len(times)} renewals in {3.5 * period:.2f}s "
            f"(L/6 = {period:.2f}s)",
        )
        expect_period(times, period, f"P worker {worker}")
    for rx in pulls:
        await fake.serve(rx)
    settled = time.monotonic()
    t.expect_decoded(await leg.result())
    await asyncio.sleep(2 * period)  # renewals that must not come
    late = renewals_after(fake, leg, settled)
    expect(not late, f"D renewed a loaded request {len(late)} times after its pulls settled")


@consumer_case(
    "consumer/6.4/2",
    "6.4-R6",
    covers=("6.4-R9",),
)
async def renews_while_queued_and_stops_after_release(t: ConsumerCtx) -> None:
    """A request that D holds back for want of blocks is renewed from its arrival, before any
    pull for it, every L/6; once it is aborted and D sent its release-only request, no
    renewal names it any more, while P holds that request unanswered for 2 L/6 too. The held
    pulls fail at the end."""
    lease = t.require_lease()
    period = lease / 6
    fake = await t.fake_p()
    held: list[tuple[Leg, Received]] = []
    try:
        for _ in range(QUEUE_TRIES):
            queued = await fill_until_queued(t, fake, held)
            await asyncio.sleep(max(0.0, queued.sent + 2.5 * period - time.monotonic()))
            times = [rx.t for rx in fake.renewals(queued.transfer_id)]
            expect(
                len(times) >= 2,
                f"D renewed a request it holds back {len(times)} times in its first "
                f"{time.monotonic() - queued.sent:.2f}s (L/6 = {period:.2f}s)",
            )
            expect_period(times, period, "the queued request")
            released = await release_only_after_abort(t, fake, queued, held, answer=False)
            if released is not None:
                break
        else:  # D allocated each before the abort reached it: the release never came to pass
            raise Unsupported(
                f"D allocated each of {QUEUE_TRIES} aborted requests before the abort"
            )
        await asyncio.sleep(2 * period)  # renewals that must not come
        await fake.reply(released, ok=[released.d_req(queued.transfer_id)])
        late = renewals_after(fake, queued, released.t)
        expect(not late, f"D renewed a released request {len(late)} times after releasing it")
    finally:
        await fail_held(t, fake, held)


@consumer_case(
    "consumer/3.9/1",
    "3.9-R7",
)
async def refused_renewals_fail_nothing(t: ConsumerCtx) -> None:
    """Two fake P's, one that answers renewals ERROR (a P without a lease) and one that never
    answers them, hold D's pulls for 2 L/6 while D renews; then they serve the pulls, and D
    decodes both requests."""
    lease = t.require_lease()
    fakes = [await t.fake_p(heartbeat_reply=how) for how in ("error", "none")]
    legs = [t.start(fake) for fake in fakes]
    pulls = [await t.pull_of(fake, leg) for fake, leg in zip(fakes, legs, strict=True)]
    await asyncio.sleep(2 * lease / 6)  # D's renewal timer: nothing to await from outside
    for fake, leg in zip(fakes, legs, strict=True):
        how = fake.config.heartbeat_reply
        expect(bool(fake.renewals(leg.transfer_id)), f"D renewed nothing at the {how!r} P")
    for fake, rx in zip(fakes, pulls, strict=True):
        await fake.serve(rx)
    for fake, leg in zip(fakes, legs, strict=True):
        t.expect_decoded(await leg.result(), f"D, renewals answered {fake.config.heartbeat_reply}")
