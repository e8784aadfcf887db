"""Consumer cases: how D uses P's bootstrap server (§4.2, §4.3, §4.4)."""

from __future__ import annotations

import json
import time

from ..case import CaseFailed, expect
from ..peers.fake_p import FakeP
from ..peers.http import HttpResult, transfer_id
from ..ports import free_port
from .consumer_env import FAST, ConsumerCtx, consumer_case


def _expect_reason(t: ConsumerCtx, got: HttpResult, fake: FakeP, bootstrap: str) -> None:
    """The reason of 4.2-R4, where D's error shows its reason at all."""
    reason = f"remote engine_id {fake.engine_id} not found from bootstrap server {bootstrap}"
    text = json.dumps(got.body) if not isinstance(got.body, str) else got.body
    if fake.engine_id not in text and "not found" not in text:
        t.log.note("D's HTTP error does not show why the load failed: the reason is not checked")
        return
    expect(reason in text, f"D's error does not give the reason {reason!r}: {text[:400]}")


@consumer_case(
    "consumer/4.2/1",
    "4.2-R4",
    covers=("4.4-R17",),
)
async def unknown_engine_fails_at_once(t: ConsumerCtx) -> None:
    """When the bootstrap server has no entry with the request's remote_engine_id, D queries it
    and fails the request at once, pulling nothing, with the reason
    "remote engine_id … not found from bootstrap server …"."""
    fake = await t.fake_p()
    other = {**fake.entry(), "engine_id": f"other-{fake.engine_id}"}
    fake.query_body = lambda: {"0": other}
    leg = t.start(fake)
    got = await leg.result()
    expect(bool(fake.queries), f"D never queried the bootstrap server it was given, {fake.url}")
    stray = [rx.describe() for rx in fake.pending()]
    expect(not stray, f"D sent {stray[:1]} to the workers of another engine")
    t.expect_failed(got)
    expect(got.elapsed < FAST, f"D took {got.elapsed:.2f}s to fail a request for an unknown engine")
    _expect_reason(t, got, fake, fake.url)


@consumer_case(
    "consumer/4.2/2",
    "4.2-R3",
    covers=("4.2-R1", "4.2-R2", "4.4-R17"),
)
async def pulls_from_its_own_engine(t: ConsumerCtx) -> None:
    """Of several engines in the /query reply, D pulls from the workers of the one the request
    names (here DP rank 1's), not from the first."""
    real = await t.fake_p(dp_rank=1)
    decoy = await t.fake_p()
    real.others = {"0": decoy.entry()}
    leg = t.start(real)
    rx = await real.next(t.options.request_timeout, lambda r: r.kind == "pull")
    if rx is None:
        stray = decoy.pending()
        where = f"it sent {stray[0].describe()} to engine {decoy.engine_id}" if stray else ""
        raise CaseFailed(f"D sent no pull to the engine the request names; {where}")
    await real.serve(rx)
    t.expect_decoded(await leg.result())
    expect(not decoy.pending(), f"D also pulled from engine {decoy.engine_id}")


@consumer_case(
    "consumer/4.2/3",
    "4.2-R8",
    covers=("4.2-R7", "4.2-R9"),
    risk=7,
)
async def incomplete_entry_is_not_used(t: ConsumerCtx) -> None:
    """D does not use an entry that lacks a worker its tp_size promises (a P of TP 2 whose rank 1
    has not registered yet) and does not cache it: once the entry is complete, D queries again
    and loads from both ranks."""
    await t.require_pdwire2()
    fake = await t.fake_p(tp=2)
    fake.hidden = {(1, 0)}
    first = t.start(fake)
    early = await fake.next(0.5, lambda r: r.kind == "pull")
    expect(
        early is None, f"D used an entry without TP rank 1: it sent {early and early.describe()}"
    )
    queried = len(fake.queries)
    fake.hidden.clear()
    second = t.start(fake)
    await t.serve_until_done(fake, [first, second])
    t.expect_decoded(await second.result(), "the request after the entry was complete")
    expect(len(fake.queries) > queried, "D pulled without querying the now complete entry again")
    pulled = {rx.worker for rx in fake.history if rx.pull is not None}
    expect(pulled == {(0, 0), (1, 0)}, f"D pulled from the P workers {sorted(pulled)} only")


@consumer_case(
    "consumer/4.2/4",
    "4.2-R12",
    risk=7,
    timeout=900.0,
)
async def queries_again_after_a_timeout(t: ConsumerCtx) -> None:
    """After a pull failed by receive timeout (P restarted on new ports under the same engine
    id), a pdwire/2 D queries the bootstrap server again and loads from P's new workers."""
    await t.require_pdwire2()
    wait = t.receive_timeout
    fake = await t.fake_p()
    leg = t.start(fake)
    await t.serve_leg(fake, leg)
    t.expect_decoded(await leg.result())
    fake.restart_workers()
    lost = t.start(fake, timeout=wait + 5.0, deadline_ms=int((wait + 30.0) * 1000))
    await t.serve_until_done(fake, [lost], wait + 6.0)
    queried = len(fake.queries)
    leg = t.start(fake)
    await t.serve_leg(fake, leg)
    t.expect_decoded(await leg.result())
    expect(len(fake.queries) > queried, "D did not query the bootstrap server again")


@consumer_case(
    "consumer/4.3/1",
    "4.3-R2",
)
async def no_health_route_needed(t: ConsumerCtx) -> None:
    """D loads from a P whose bootstrap server has no GET /health (vLLM's has none)."""
    fake = await t.fake_p(health=False)
    leg = t.start(fake)
    await t.serve_leg(fake, leg)
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/4.4/1",
    "4.4-R9",
)
async def concurrent_queries_share_one(t: ConsumerCtx) -> None:
    """Two requests for an engine D does not know yet, sent together while the bootstrap server
    is slow, cost one GET /query per D worker: the second waits for the first one's answer."""
    fake = await t.fake_p()
    fake.hold_query = 0.5
    legs = [t.start(fake), t.start(fake)]
    served = await t.serve_until_done(fake, legs)
    for leg in legs:
        t.expect_decoded(await leg.result())
    workers = {rx.sender for rx in served}
    expect(
        len(fake.queries) <= len(workers),
        f"{len(fake.queries)} queries of the bootstrap server for {len(workers)} D worker(s)",
    )


@consumer_case(
    "consumer/4.4/2",
    "4.4-R10",
    covers=("4.4-R7",),
)
async def unreachable_bootstrap_fails(t: ConsumerCtx) -> None:
    """When D cannot reach the bootstrap server at all, it fails the request soon, with the
    reason of 4.2-R4."""
    fake = await t.fake_p()
    url = f"http://{t.options.host}:{free_port(t.options.host)}"
    start = time.monotonic()
    got = await t.complete(t.prompt(), t.params(fake, transfer_id(), remote_bootstrap_addr=url))
    t.expect_failed(got)
    took = time.monotonic() - start
    expect(took < FAST, f"D took {took:.2f}s to fail a request whose bootstrap server is down")
    _expect_reason(t, got, fake, url)
