"""Producer cases: P's timers (§6, §10.4, §10.11) measured against the testee's T
(``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``, ``--abort-timeout``): the ready wait of a pull,
the retention of a ready transfer, the expiry of a placeholder, a pull's deadline_ms."""

from __future__ import annotations

import asyncio
import time
from typing import Final

from pdwire import error_strings
from pdwire.messages import XferResponseStatus

from ..case import Unsupported, case, expect, expect_equal
from ..peers.fake_d import PullResult
from .producer_env import ProducerCtx

FINISH = XferResponseStatus.FINISH
SLACK: Final = 1.5  # seconds an expiry may come late (6.3-R8: P may check once per step)
#: 6.3-R10: the most a pdwire implementation may let an expiry come late, in seconds.
EXPIRY_BOUND: Final = 1.0
#: What the harness adds to the time it reads a reply at, on top of that: the connect, the pull's
#: and the reply's way over loopback, its own loop.
DELIVERY: Final = 0.25
EARLY: Final = 0.9  # an expiry may not come before this share of its time
#: The least margin, in seconds, between the moments producer/6.3/3 tells apart.
MIN_MARGIN: Final = 0.25


def expect_in_window(what: str, took: float, due: float) -> None:
    expect(
        EARLY * due <= took <= due + SLACK,
        f"{what}: answered after {took:.2f}s, expected about {due:.2f}s",
    )


def expect_failed(r: PullResult, d_req: str, what: str, messages: dict[str, str]) -> None:
    """A FINISH with ``d_req`` in err_reqs, its err_msg one of ``messages`` (code -> message)
    and, where P sent codes, the matching code."""
    final = r.terminal
    expect(
        final is not None and final.status is FINISH and d_req in r.err(),
        f"{what}: expected FINISH with {d_req} in err_reqs, got {r.describe()}",
    )
    assert final is not None
    expect(
        final.err_msg in messages.values(),
        f"{what}: err_msg {final.err_msg!r}, expected one of {sorted(messages.values())}",
    )
    code = (final.err_codes or {}).get(d_req)
    if code is not None:
        expect_equal(messages.get(code), final.err_msg, f"{what}: the message of code {code}")


READY_TIMEOUT: Final = {"READY_TIMEOUT": error_strings.READY_TIMEOUT}
EXPIRED: Final = {"EXPIRED": error_strings.EXPIRED}


@case(
    "producer/10.4/2",
    "10.4.5",
    covers=("10.4.4", "3.3-R3", "7.1-R1", "10.4.2"),
    timeout=20.0,
)
async def ready_wait_expires(t: ProducerCtx) -> None:
    """A pull for a transfer whose P leg is never sent ends after T with FINISH and the request
    in err_reqs: "Timeout waiting for P side ready." (a pdwire/2 P may instead report the
    placeholder that expires at the same time: "KV expired on P side before the pull.")."""
    due = t.abort_timeout
    worker = t.worker(1, 0)
    variants = [False, True] if t.env.p_version >= 2 else [False]
    reqs = {announce: {t.new_d_req(): (t.new_transfer_id(), [[0]])} for announce in variants}
    start = time.monotonic()
    wait = due + SLACK + 1.0
    results = await asyncio.gather(
        *(t.pull(worker, t.addr(), reqs[a], announce=a, timeout=wait) for a in variants)
    )
    for announce, r in zip(variants, results, strict=True):
        what = "pdwire/2 pull" if announce else "legacy pull"
        (d_req,) = reqs[announce]
        allowed = {**READY_TIMEOUT, **(EXPIRED if t.env.p_version >= 2 else {})}
        expect_failed(r, d_req, what, allowed)
        expect_in_window(what, r.replies[-1].t, due)
    expect(time.monotonic() - start < wait + 1.0, "the pulls took too long")


@case(
    "producer/10.11/1",
    "10.11.5",
    covers=("10.5.7", "10.9.1", "7.1-R4"),
    timeout=20.0,
)
async def ready_transfer_expires(t: ProducerCtx) -> None:
    """A ready transfer no pull came for is dropped after T: a pull that names it later gets
    the request in err_reqs with "KV expired on P side before the pull." and, to a
    pdwire/2 D, the code EXPIRED."""
    t.require_pdwire2()
    due = t.abort_timeout
    (tid,) = await t.ready(1)
    await asyncio.sleep(due + 0.5)  # P's retention timer: nothing to await from outside
    worker = t.worker(1, 0)
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    try:
        for addr in t.targets(worker):
            r = await t.pull(worker, addr, {d_req: (tid, [blocks])}, announce=True, timeout=SLACK)
            expect_failed(r, d_req, f"a pull to {addr} after T", EXPIRED)
            assert r.terminal is not None
            expect_equal((r.terminal.err_codes or {}).get(d_req), "EXPIRED", "err_codes")
        expect(worker.stray_bytes() == 0, "P wrote the KV of an expired transfer")
    finally:
        worker.give_back(blocks)


@case(
    "producer/10.11/2",
    "10.11.4",
    covers=("6.3-R9", "10.11.5"),
    timeout=20.0,
    risk=2,
)
async def placeholder_expires(t: ProducerCtx) -> None:
    """A placeholder expires T after the pull that created it, whatever pulls name it later: a
    second pull for the never-sent transfer, sent T/2 after the first, ends at T with EXPIRED
    rather than waiting out its own ready wait."""
    t.require_pdwire2()
    due = t.abort_timeout
    worker = t.worker(1, 0)
    req = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
    (d_req,) = req
    wait = 1.5 * due + SLACK + 1.0
    first = asyncio.create_task(t.pull(worker, t.addr(), req, timeout=wait))
    await asyncio.sleep(due / 2)  # the second pull must come while the placeholder lives
    second = await t.pull(worker, t.addr(), req, announce=True, timeout=wait)
    first_sent = (await first).started
    expect_failed(second, d_req, "the second pull", EXPIRED)
    # From the first pull's send, not from the sleep: under load the second one goes late.
    ended = second.started + second.replies[-1].t - first_sent
    expect_in_window("the second pull (from the first pull's send)", ended, due)


@case(
    "producer/6.3/3",
    "6.3-R2",
    covers=("10.4.4", "10.4.5", "10.4.2"),
    timeout=40.0,
)
async def ready_wait_restarts_when_ready(t: ProducerCtx) -> None:
    """The ready wait restarts when a transfer of the pull becomes ready, and not when P only
    records one. With P's prefill taking d (at least 1 s, at most 0.8 T) and m = d/4: a pull
    names A and B, A's leg goes with it (ready at d); B's leg goes at T - 2m, so that P records
    B before its placeholder would expire, and B is ready at T - 2m + d: past T, before the wait
    restarted by A ends (d + T). B must be served. Another pull names C alone, whose leg goes
    with B's: recorded before T, ready after it; that pull must end at T with C in err_reqs."""
    due = t.abort_timeout
    probe = await t.prefill(t.new_transfer_id())
    t.expect_leg_ok(probe)
    d = probe.elapsed
    m = d / 4
    if m < MIN_MARGIN or d + m > due:
        raise Unsupported(
            f"P's prefill took {d:.2f}s; this case needs one of {4 * MIN_MARGIN:.1f}s to "
            f"{0.8 * due:.1f}s (a slower model or longer prompt; pdwire node --prefill-delay)"
        )
    worker = t.worker(1, 0)
    a, b, c = (t.new_transfer_id() for _ in range(3))
    ra, rb, rc = (t.new_d_req() for _ in range(3))
    taken = {r: worker.take(t.blocks_for()) for r in (ra, rb, rc)}
    wait = due + d + 2 * SLACK
    try:
        start = time.monotonic()
        both = asyncio.create_task(
            t.pull(worker, t.addr(), {ra: (a, [taken[ra]]), rb: (b, [taken[rb]])}, timeout=wait)
        )
        alone = asyncio.create_task(t.pull(worker, t.addr(), {rc: (c, [taken[rc]])}, timeout=wait))
        legs = [t.start_prefill(a)]
        # B's and C's legs are due at T - 2m after the pulls: P's clock, nothing to await.
        await asyncio.sleep(max(0.0, start + due - 2 * m - time.monotonic()))
        legs += [t.start_prefill(b), t.start_prefill(c)]
        r_both, r_alone = await both, await alone
        for leg in legs:
            t.expect_leg_ok(await leg)
        expect(
            ra in r_both.ok() and rb in r_both.ok(),
            f"a pull for A (ready at about {d:.2f}s) and B (ready at about {due - 2 * m + d:.2f}s)"
            f": expected both served, the wait having restarted at A; got {r_both.describe()}",
        )
        what = f"a pull for C alone (recorded at about {due - 2 * m:.2f}s, ready after T)"
        expect_failed(r_alone, rc, what, READY_TIMEOUT)
        expect_in_window(what, r_alone.replies[-1].t, due)
    finally:
        worker.give_back(block for blocks in taken.values() for block in blocks)
