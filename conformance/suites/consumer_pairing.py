"""Consumer cases: which P workers D pulls from, and when it counts a request done (§10.1,
§10.2, §10.10)."""

from __future__ import annotations

import asyncio
import time

from pdwire.messages import XferResponseStatus
from pdwire.planning import target_ranks

from ..case import Unsupported, expect
from ..peers.fake_p import FakeP
from .consumer_env import FAST, QUIET, ConsumerCtx, consumer_case

ERROR = XferResponseStatus.ERROR
APART = 0.3  # the least time, in seconds, between the answers of two P ranks
GAPS = 3  # the time between them, in D's times to answer once every pull settled
MAX_APART = 10.0
TRIES = 3


@consumer_case(
    "consumer/10.1/1",
    "10.1.2",
    covers=("10.1.5", "10.10.1", "10.10.3"),
)
async def pulls_every_paired_tp_rank(t: ConsumerCtx) -> None:
    """With a P of TP 2, each D rank pulls from exactly the P ranks target_ranks pairs it with,
    and the request loads once all of them answered ok."""
    fake = await t.fake_p(tp=2)
    leg = t.start(fake)
    pulls = await t.all_pulls(fake, leg)
    pairs = set()
    for rx in pulls:
        assert rx.pull is not None
        d_tp, d_rank = rx.pull.remote_tp_size, rx.pull.remote_tp_rank
        p_rank = rx.worker[0]
        expect(
            p_rank in target_ranks(d_tp, d_rank, 2),
            f"D rank {d_rank} of {d_tp} pulled from P rank {p_rank}, which it is not paired with",
        )
        pairs.add((d_rank, p_rank))
    expect(len(pairs) == len(pulls), f"a D rank pulled one P rank twice: {sorted(pairs)}")
    for rx in pulls:
        await fake.serve(rx)
    t.expect_decoded(await leg.result())
    extra = await fake.next(QUIET, lambda r: r.kind == "pull")
    expect(extra is None, f"D pulled once more: {extra and extra.describe()}")


@consumer_case(
    "consumer/10.1/2",
    "10.1.1",
)
async def no_pull_when_the_tp_sizes_do_not_divide(t: ConsumerCtx) -> None:
    """With a P whose TP size neither divides D's nor is a multiple of it (D's TP plus one, for a
    D of TP 2 or more), D pulls from none of P's workers and fails the request at once."""
    probe = await t.fake_p()
    leg = t.start(probe)
    pulls = await t.all_pulls(probe, leg)
    for rx in pulls:
        await probe.serve(rx)
    t.expect_decoded(await leg.result(), "the request from a P of TP 1")
    assert pulls[0].pull is not None
    d_tp = pulls[0].pull.remote_tp_size
    if d_tp < 2:
        raise Unsupported(f"D runs TP {d_tp}: every P TP size is a multiple of it")
    fake = await t.fake_p(tp=d_tp + 1)
    got = await t.start(fake).result()
    await t.quiet(fake)  # and what D sends just after its answer
    stray = [rx.describe() for rx in fake.history]
    expect(not stray, f"D of TP {d_tp} sent a P of TP {d_tp + 1} {stray[:2]}")
    t.expect_failed(got, f"a request from a P of TP {d_tp + 1} to a D of TP {d_tp}")
    expect(got.elapsed < FAST, f"D took {got.elapsed:.2f}s to fail a request it cannot pull")


@consumer_case(
    "consumer/10.2/1",
    "10.2.2",
    covers=("10.2.3", "9.2-R2"),
    risk=5,
)
async def pulls_every_p_stage(t: ConsumerCtx) -> None:
    """With a P of PP 2, a D whose PP size differs pulls from both P stages (one of the same PP
    size only from its own), and the request loads once every stage answered."""
    fake = await t.fake_p(pp=2)
    leg = t.start(fake)
    pulls = await t.all_pulls(fake, leg)
    stages = {rx.worker[1] for rx in pulls}
    assert pulls[0].pull is not None
    if pulls[0].pull.remote_pp_size != 2:
        expect(stages == {0, 1}, f"D pulled from the P stages {sorted(stages)} only")
    for rx in pulls:
        await fake.serve(rx)
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/10.10/3",
    "10.10.2",
    covers=("10.10.3", "10.10.4", "10.10.5"),
)
async def answers_once_every_pull_settled(t: ConsumerCtx) -> None:
    """D answers a request only when every pull for it settled: from a P of TP 2 whose ranks
    answer apart, ok then failed fails it, and ERROR then ok fails it, each time only after the
    second answer. The answers are at least 0.3 s apart, and three times as long as D takes to
    answer once every pull is served, so that a D slowed by its machine, which answers the first
    late, still answers it within the gap. When D takes more than half the gap to answer once the
    second settled, its answer may be a late one to the first: the request is sent again with a
    wider gap."""
    fake = await t.fake_p(tp=2)
    leg = t.start(fake)
    for rx in await t.all_pulls(fake, leg):
        await fake.serve(rx)
    served = time.monotonic()
    t.expect_decoded(await leg.result(), "the request whose every pull was served")
    base = max(APART, GAPS * (time.monotonic() - served))
    for first_ok in (True, False):
        apart = base
        for attempt in range(1, TRIES + 1):
            late = await _answer_after_the_second(t, fake, first_ok, apart)
            if 2 * late < apart:
                break
            if attempt == TRIES:
                raise Unsupported(
                    f"D took {late:.2f}s to answer once the second pull settled, more than half "
                    f"of the {apart:.2f}s between the two: too slow to tell which it waited for"
                )
            apart = min(GAPS * late, MAX_APART)


async def _answer_after_the_second(
    t: ConsumerCtx, fake: FakeP, first_ok: bool, apart: float
) -> float:
    """One request from ``fake`` (TP 2) whose first pull settles ok (or ERROR), and the other
    ``apart`` seconds later the other way. Fails the case when D answers before the second
    settled; returns how long D took to answer after it did."""
    leg = t.start(fake)
    pulls = await t.all_pulls(fake, leg)
    head, rest = pulls[0], pulls[1:]
    d_req = head.d_req(leg.transfer_id)
    if first_ok:
        await fake.serve(head)
    else:
        await fake.reply(head, ERROR, err_msg="the fake P failed this pull", err_code="INTERNAL")
    done, _ = await asyncio.wait([leg.task], timeout=apart)
    expect(
        not done,
        f"D answered within {apart:.2f}s of the first of {len(pulls)} pulls settling "
        f"({'ok' if first_ok else 'ERROR'}), while another P rank could still write",
    )
    for rx in rest:
        if first_ok:
            await fake.reply(rx, err=[rx.d_req(leg.transfer_id)], err_msg="failed")
        else:
            await fake.serve(rx)
    settled = time.monotonic()
    t.expect_failed(await leg.result(), f"request {d_req}")
    return time.monotonic() - settled
