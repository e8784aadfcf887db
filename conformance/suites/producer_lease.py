"""Producer cases: vLLM 0.34's KV lease (§3.9, §6.4) measured against the testee's lease `L`
(``kv_lease_duration``, ``--kv-lease-duration``): renewals, the end of a lease, what a renewal
must not create, and P's answers to heartbeats, with and without a lease."""

from __future__ import annotations

import asyncio
from typing import Final

import msgspec

from pdwire import error_strings
from pdwire.messages import XferResponseStatus

from ..case import Unsupported, case, expect, expect_equal
from ..peers.fake_d import PullResult
from .producer_env import ProducerCtx
from .producer_timers import SLACK, expect_failed

FINISH, ERROR = XferResponseStatus.FINISH, XferResponseStatus.ERROR
EXPIRED: Final = {"EXPIRED": error_strings.EXPIRED}
#: The most a pull for an expired transfer may wait for its answer ("at once", 6.4-R5), as a
#: share of T: an answer after the ready wait is the one this case tells apart.
AT_ONCE: Final = 0.5


def expect_renewed(r: PullResult, what: str) -> None:
    """One FINISH with no other key (3.9-R5)."""
    expect(
        r.status is FINISH and len(r.replies) == 1,
        f"{what}: expected one FINISH, got {r.describe()}",
    )
    expect_equal(r.replies[0].keys, ["status"], f"{what}: the keys of P's answer")


async def expect_served(t: ProducerCtx, tid: str, what: str) -> None:
    """Transfer ``tid``, already ready at P, is served: a D of TP 1 pulls it from every P
    worker, each answers FINISH with it in ok_reqs, and every block asked for is written."""
    worker = t.worker(1, 0)
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    try:
        for w, addr, r in await t.pull_to_targets(worker, tid, d_req, blocks):
            t.log.note(f"{what}: {r.describe()}")
            t.expect_ok(w, addr, r, d_req)
        t.expect_written(worker, blocks)
    finally:
        worker.give_back(blocks)


async def expect_expired_at_once(t: ProducerCtx, tid: str, what: str) -> None:
    """A legacy pull of ``tid`` (with a layout_id) is answered at once, well before P's ready
    wait T: FINISH with the request in err_reqs, "KV expired on P side before the pull.", and
    the pull's layout_id echoed (6.4-R5)."""
    bound = AT_ONCE * t.abort_timeout
    worker = t.worker(1, 0)
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    layout_id = 0x5EA5_E000_0000_0001
    try:
        req = {d_req: (tid, worker.group_lists(blocks))}
        r = await t.pull(
            worker, t.targets(worker)[0], req, layout_id=layout_id, timeout=t.abort_timeout + SLACK
        )
    finally:
        worker.give_back(blocks)
    expect_failed(r, d_req, what, EXPIRED)
    expect(
        r.replies[-1].t <= bound,
        f"{what}: answered after {r.replies[-1].t:.2f}s, not at once (at most {bound:.2f}s, T/2)",
    )
    assert r.terminal is not None
    expect_equal(r.terminal.layout_id, layout_id, f"{what}: layout_id of the answer")


@case(
    "producer/6.4/1",
    "6.4-R2",
    covers=("3.9-R5",),
    timeout=30.0,
)
async def renewal_extends_the_lease(t: ProducerCtx) -> None:
    """A transfer renewed at L/2 and at L by heartbeats to every P worker is still served at
    3L/2, past the end of its first lease: each renewal moved its end to 2L/3 from then. Each
    heartbeat gets one FINISH and nothing else."""
    lease = t.require_lease()
    (tid,) = await t.ready(1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for at in (lease / 2, lease):
        await asyncio.sleep(max(0.0, start + at - loop.time()))  # P's clock: nothing to await
        for addr in [t.addr(tp, pp) for tp in range(t.p_tp) for pp in range(t.p_pp)]:
            renewed = await t.heartbeat(addr, [tid], timeout=SLACK)
            expect_renewed(renewed, f"the renewal at {at:.1f}s to {addr}")
    await asyncio.sleep(max(0.0, start + 1.5 * lease - loop.time()))
    await expect_served(t, tid, "the pull at 3L/2")


@case(
    "producer/6.4/2",
    "6.4-R1",
    covers=("6.4-R5", "7.1-R1"),
    timeout=30.0,
)
async def lease_ends_and_a_late_pull_is_answered_at_once(t: ProducerCtx) -> None:
    """Two transfers nobody renews: the one pulled at 0.8 L is served; the one pulled at L
    plus the slack of an expiry is answered at once (well before T), FINISH with the request in
    err_reqs and "KV expired on P side before the pull.", the pull's layout_id echoed."""
    lease = t.require_lease()
    early, late = await t.ready(2)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.sleep(0.8 * lease)  # P's lease: nothing to await from outside
    await expect_served(t, early, "the pull at 0.8 L")
    await asyncio.sleep(max(0.0, start + lease + SLACK - loop.time()))
    await expect_expired_at_once(t, late, "the pull after the lease")


@case(
    "producer/6.4/3",
    "6.4-R3",
    timeout=30.0,
)
async def renewal_creates_nothing(t: ProducerCtx) -> None:
    """A heartbeat naming a transfer whose lease ended and one P never saw gets FINISH and makes
    no state: the expired one is still answered at once with EXPIRED, not waited for."""
    lease = t.require_lease()
    (tid,) = await t.ready(1)
    await asyncio.sleep(lease + SLACK)  # P's lease: nothing to await from outside
    for addr in [t.addr(tp, pp) for tp in range(t.p_tp) for pp in range(t.p_pp)]:
        renewed = await t.heartbeat(addr, [tid, t.new_transfer_id()], timeout=SLACK)
        expect_renewed(renewed, f"the renewal to {addr}")
    await expect_expired_at_once(t, tid, "the pull after the renewal")


@case(
    "producer/6.4/4",
    "6.4-R4",
    covers=("3.9-R5", "7.1-R1"),
)
async def no_lease_refuses_renewals(t: ProducerCtx) -> None:
    """A P without a lease answers a heartbeat with one ERROR: "kv_lease_duration is not set on
    this prefill instance.", and no other key."""
    if t.lease:
        raise Unsupported(f"P has a lease of {t.lease}s")
    r = await t.heartbeat(t.addr(), [t.new_transfer_id()], timeout=SLACK)
    expect(r.status is ERROR and len(r.replies) == 1, f"expected one ERROR, got {r.describe()}")
    assert r.terminal is not None
    expect_equal(r.terminal.err_msg, error_strings.LEASE_NOT_SET, "err_msg")
    expect_equal(r.replies[0].keys, ["status", "err_msg"], "the keys of P's answer")


@case(
    "producer/3.9/1",
    "3.9-R5",
    covers=("3.9-R6",),
)
async def heartbeat_answered_once(t: ProducerCtx) -> None:
    """A P with a lease answers a heartbeat with exactly one FINISH, without waiting for the
    transfers it names (one of which P has not even seen), also while a pull for an unknown
    transfer waits at the same worker."""
    lease = t.require_lease()
    worker = t.worker(t.p_tp, 0)
    addr = t.targets(worker)[0]
    waiting = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
    pull = asyncio.create_task(t.pull(worker, addr, waiting, timeout=SLACK))
    try:
        r = await t.heartbeat(addr, [t.new_transfer_id()], timeout=min(SLACK, lease / 6))
        expect_renewed(r, "the renewal")
        linger = await t.send(addr, msgspec.msgpack.encode({"lease_transfer_ids": ["x"]}),
                              timeout=SLACK, linger_after=0.3)  # fmt: skip
        expect(len(linger.replies) == 1, f"expected one reply, got {linger.describe()}")
    finally:
        await pull


@case(
    "producer/3.9/2",
    "3.9-R3",
    covers=("7.3-R1",),
)
async def malformed_heartbeats_are_errors(t: ProducerCtx) -> None:
    """Heartbeats naming no transfer, a transfer_id that is not a string, or a string instead of
    a list each get one ERROR (a decode error, §2.4), and P goes on serving: a transfer loads
    afterwards."""
    for bad in ([], [7], "x"):
        data = msgspec.msgpack.encode({"lease_transfer_ids": bad})
        r = await t.send(t.addr(), data, timeout=SLACK)
        expect(
            r.status is ERROR,
            f"lease_transfer_ids={bad!r}: expected ERROR, got {r.describe()}",
        )
    loaded = await t.load()
    try:
        t.expect_loaded(loaded)
    finally:
        t.release(loaded)
