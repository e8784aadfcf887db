"""Producer cases: P's limits (chapter 13). Each case speaks as a D worker of its own (a
``remote_port`` no other case names), so that what other cases left at P does not count; every
transfer it names is one P never prefills, so P writes nothing. The cases past a limit need the
limit (``--limits``); the case of the minimums does not."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Mapping
from typing import Final, TypeVar

from pdwire.consumer import mint_layout_id
from pdwire.limits import MINIMUM, exceeded
from pdwire.messages import XferResponseStatus
from pdwire.versions import Capability

from ..case import Unsupported, case, expect, expect_equal
from ..peers.fake_d import DWorker, PullResult
from ..ports import free_port
from .producer_bootstrap import fresh, query, register, require_pdwire_server, worker
from .producer_env import ProducerCtx

FINISH, ERROR = XferResponseStatus.FINISH, XferResponseStatus.ERROR
LIMIT: Final = "LIMIT_EXCEEDED"
#: D's deadline on the pulls that wait: they end by it, or by P's ready wait if that is shorter.
DEADLINE_MS: Final = 1500
#: An answer due at once must come within this, seconds.
AT_ONCE: Final = 1.0

Requests = dict[str, tuple[str, list[list[int]]]]


class Peer:
    """A D worker of the case's own: the harness's worker under a ``remote_port`` of its own."""

    def __init__(self, t: ProducerCtx) -> None:
        t.require_cap(Capability.DEADLINE)  # the pulls of unknown transfers end by D's deadline
        self.t = t
        self.worker: DWorker = t.worker(t.p_tp, 0)
        self.addr = t.targets(self.worker)[0]
        self.port = free_port()

    def unknown(self, n: int) -> Requests:
        """``n`` requests for transfers P holds nothing for, and never will."""
        blocks = self.worker.group_lists([0])
        return {self.t.new_d_req(): (self.t.new_transfer_id(), blocks) for _ in range(n)}

    async def pull(self, reqs: Requests) -> PullResult:
        """A pull of ``reqs`` that ends by D's deadline, if P does not answer it before."""
        return await self.t.pull(
            self.worker,
            self.addr,
            reqs,
            announce=True,
            remote_port=self.port,
            deadline_ms=DEADLINE_MS,
            timeout=DEADLINE_MS / 1000 + self.t.options.request_timeout,
        )

    async def release(self, layout_id: int, *, with_layout: bool) -> PullResult:
        """A release-only pull (no request) under ``layout_id``."""
        return await self.t.pull(
            self.worker,
            self.addr,
            {},
            with_layout=with_layout,
            layout_id=layout_id,
            remote_port=self.port,
        )

    async def cancel(self, reqs: dict[str, str]) -> PullResult:
        return await self.t.cancel(self.worker, self.addr, reqs, port=self.port)


V = TypeVar("V")


def chunks(reqs: Mapping[str, V], size: int) -> Iterator[dict[str, V]]:
    """``reqs`` in maps of at most ``size`` entries."""
    items = iter(reqs.items())
    while batch := dict(itertools.islice(items, size)):
        yield batch


def codes_of(results: list[PullResult]) -> dict[str, str]:
    """Every request a reply of ``results`` failed, with its code ("" when it had none)."""
    return {
        d: (reply.err_codes or {}).get(d, "")
        for r in results
        for reply in r.decoded()
        for d in reply.err_reqs or ()
    }


def expect_refused(
    r: PullResult, what: str, limit: str, value: int, maximum: int, before: float = 0.0
) -> None:
    """One ERROR with LIMIT_EXCEEDED and the message of 13.1-R3, at once: within AT_ONCE of
    its send or, given ``before`` (monotonic), before that."""
    final = r.terminal
    expect(
        final is not None and final.status is ERROR and len(r.replies) == 1,
        f"{what}: expected one ERROR, got {r.describe()}",
    )
    assert final is not None
    expect_equal(final.err_msg, exceeded(limit, value, maximum), f"{what}: err_msg")
    expect_equal(final.err_code, LIMIT, f"{what}: err_code")
    expect(
        r.elapsed < AT_ONCE or r.ended < before,
        f"{what}: answered after {r.elapsed:.2f}s, not at once",
    )


@case(
    "producer/13.1/1",
    "13.1-R1",
)
async def minimums_are_supported(t: ProducerCtx) -> None:
    """At the minimums, nothing is refused: one D worker holds 64 open pulls of 16 requests
    each (1 024 placeholders), and another sends one pull of 1 024 requests; every request
    ends by D's deadline (or P's ready wait), none with LIMIT_EXCEEDED or an ERROR."""
    many, wide = Peer(t), Peer(t)
    per_pull = MINIMUM.placeholders_per_peer // MINIMUM.open_pulls_per_peer
    pulls = [many.unknown(per_pull) for _ in range(MINIMUM.open_pulls_per_peer)]
    big = wide.unknown(MINIMUM.requests_per_message)
    results = await asyncio.gather(*(many.pull(p) for p in pulls), wide.pull(big))
    for r, reqs in zip(results, [*pulls, big], strict=True):
        expect(
            r.status is FINISH and sorted(r.err()) == sorted(reqs),
            f"a pull of {len(reqs)} requests within the minimums: expected FINISH failing "
            f"each by the deadline, got {r.describe()}",
        )
    refused = sorted(d for d, code in codes_of(results).items() if code == LIMIT)
    expect(not refused, f"{len(refused)} requests within the minimums were refused: {refused[:3]}")


@case(
    "producer/13.2/1",
    "13.2-R1",
    covers=("13.1-R2", "13.1-R3", "13.1-R4"),
)
async def too_many_requests_in_a_pull(t: ProducerCtx) -> None:
    """A pull of one request more than P's requests_per_message is answered ERROR at once,
    with LIMIT_EXCEEDED and the message naming the limit."""
    maximum = t.limit("requests_per_message")
    d = Peer(t)
    r = await d.pull(d.unknown(maximum + 1))
    expect_refused(r, "the pull", "requests_per_message", maximum + 1, maximum)


@case(
    "producer/13.2/2",
    "13.2-R2",
)
async def too_many_requests_in_a_cancel(t: ProducerCtx) -> None:
    """A cancel of one request more than P's requests_per_message is answered ERROR at once,
    with LIMIT_EXCEEDED, and withdraws none of them: a pull for one of its transfers waits."""
    t.require_cap(Capability.CANCEL)
    maximum = t.limit("requests_per_message")
    d = Peer(t)
    reqs = d.unknown(maximum + 1)
    r = await d.cancel({req: tid for req, (tid, _) in reqs.items()})
    expect_refused(r, "the cancel", "requests_per_message", maximum + 1, maximum)
    first = dict(itertools.islice(reqs.items(), 1))
    after = await d.pull(first)
    expect(
        codes_of([after]) == dict.fromkeys(first, "DEADLINE_EXCEEDED"),
        f"a pull for a transfer the refused cancel named: expected it to wait until D's "
        f"deadline, got {after.describe()}",
    )


@case(
    "producer/13.3/1",
    "13.3-R1",
)
async def too_many_open_pulls(t: ProducerCtx) -> None:
    """One D worker sends one pull more than P's open_pulls_per_peer, each for a transfer
    that is not ready: exactly one is answered ERROR with LIMIT_EXCEEDED, at once; the others
    wait until D's deadline."""
    maximum = t.limit("open_pulls_per_peer")
    d = Peer(t)
    results = await asyncio.gather(*(d.pull(d.unknown(1)) for _ in range(maximum + 1)))
    refused = [r for r in results if r.status is ERROR]
    waited = [r for r in results if r.status is FINISH]
    first_ended = min((r.ended for r in waited), default=0.0)
    first_sent, last_sent = min(r.started for r in results), max(r.started for r in results)
    if not refused and waited and first_ended < last_sent:
        raise Unsupported(
            f"the harness took {last_sent - first_sent:.2f}s to send {maximum + 1} pulls, and "
            f"the first ended by D's deadline ({DEADLINE_MS} ms) before the last was "
            "sent: they were never all open at once"
        )
    expect(
        len(refused) == 1,
        f"{maximum + 1} open pulls of one D worker, P's limit {maximum}: expected exactly one "
        f"refused, got {len(refused)}",
    )
    # Under load P may take longer than AT_ONCE to read all the pulls; a refusal that comes
    # before any of the others ended by D's deadline was not queued behind them either.
    expect_refused(
        refused[0],
        "the pull past the limit",
        "open_pulls_per_peer",
        maximum + 1,
        maximum,
        before=first_ended,
    )
    expect(
        len(waited) == maximum
        and all(set(codes_of([r]).values()) == {"DEADLINE_EXCEEDED"} for r in waited),
        "the pulls within the limit: expected each to fail its request by D's deadline",
    )


@case(
    "producer/13.4/1",
    "13.4-R1",
)
async def too_many_placeholders(t: ProducerCtx) -> None:
    """One D worker's pulls name one transfer more than P's placeholders_per_peer, all unknown
    to P: exactly one request is answered in err_reqs with LIMIT_EXCEEDED, at once, in a reply
    of a pull whose other requests still wait; the others end by D's deadline."""
    maximum = t.limit("placeholders_per_peer")
    per_pull = t.limit("requests_per_message")
    d = Peer(t)
    reqs = d.unknown(maximum + 1)
    results = await asyncio.gather(*(d.pull(batch) for batch in chunks(reqs, per_pull)))
    codes = codes_of(results)
    refused = [req for req, code in codes.items() if code == LIMIT]
    expect(
        len(refused) == 1,
        f"{maximum + 1} placeholders of one D worker, P's limit {maximum}: expected exactly one "
        f"request refused, got {len(refused)}",
    )
    expect(
        set(codes) == set(reqs)
        and sum(c == "DEADLINE_EXCEEDED" for c in codes.values()) == maximum,
        "the requests within the limit: expected each to fail by D's deadline",
    )
    r, reply = next(
        (r, reply) for r in results for reply in r.decoded() if refused[0] in (reply.err_reqs or ())
    )
    expect(
        reply.status is XferResponseStatus.CONTINUE or r.elapsed < AT_ONCE,
        f"the refused request was answered after {r.elapsed:.2f}s, not at once",
    )
    expect_equal(
        reply.err_msg,
        exceeded("placeholders_per_peer", maximum + 1, maximum),
        "the err_msg of the refused request",
    )


@case(
    "producer/13.4/2",
    "13.4-R2",
)
async def too_many_remembered_cancels(t: ProducerCtx) -> None:
    """One D worker cancels one transfer more than P's remembered_cancels_per_peer, all unknown
    to P: exactly one request is listed in the err_reqs of a cancel's FINISH with
    LIMIT_EXCEEDED, and none in ok_reqs (P held nothing for them)."""
    t.require_cap(Capability.CANCEL)
    maximum = t.limit("remembered_cancels_per_peer")
    per_cancel = t.limit("requests_per_message")
    d = Peer(t)
    reqs = {req: tid for req, (tid, _) in d.unknown(maximum + 1).items()}
    results = await asyncio.gather(*(d.cancel(batch) for batch in chunks(reqs, per_cancel)))
    for r in results:
        expect(
            r.status is FINISH and not r.ok(),
            f"a cancel of transfers P held nothing for: expected FINISH with no ok_reqs, got "
            f"{r.describe()}",
        )
    codes = codes_of(results)
    expect_equal(list(codes.values()), [LIMIT], "the codes of the cancels' err_reqs")
    reply = next(reply for r in results for reply in r.decoded() if reply.err_reqs)
    expect_equal(
        reply.err_msg,
        exceeded("remembered_cancels_per_peer", maximum + 1, maximum),
        "the err_msg of the refused request",
    )


@case(
    "producer/13.5/1",
    "13.5-R1",
)
async def minimum_of_cached_layouts(t: ProducerCtx) -> None:
    """One D worker sends its layout under 64 layout_ids, in release-only pulls; a pull that
    then omits the layout under each of them is served from P's cache, none LAYOUT_MISS."""
    d = Peer(t)
    ids = [mint_layout_id() for _ in range(MINIMUM.cached_layouts)]
    for with_layout in (True, False):
        results = await asyncio.gather(*(d.release(i, with_layout=with_layout) for i in ids))
        how = "with" if with_layout else "without"
        missed = [(i, r) for i, r in zip(ids, results, strict=True) if r.status is not FINISH]
        expect(
            not missed,
            f"release-only pulls {how} the layout under {len(ids)} layout_ids: not FINISH under "
            f"{len(missed)} of them, e.g. {missed[0][0]:#x}: {missed[0][1].describe()}"
            if missed
            else "",
        )


@case(
    "producer/13.6/1",
    "13.6-R1",
    breaks_testee=True,
)
async def too_many_registrations(t: ProducerCtx) -> None:
    """P's bootstrap server takes new workers up to its registrations limit, the minimum
    included, and answers the next with HTTP 507, "LIMIT_EXCEEDED: " and the message naming
    the limit, storing nothing of it. It stays full: the case runs last."""
    require_pdwire_server(t)
    maximum = t.limit("registrations")
    held = sum(
        len(stages)
        for entry in (await query(t)).values()
        for stages in entry["worker_addr"].values()
    )
    engine_id, dp = fresh()
    for tp in range(maximum - held):
        got = await register(t, worker(engine_id, dp, tp))
        expect(
            got.status == 200,
            f"registration {held + tp + 1} of {maximum}: expected HTTP 200, got {got.status} "
            f"{got.body!r}",
        )
    past = await register(t, worker(engine_id, dp, maximum - held))
    detail = f"{LIMIT}: {exceeded('registrations', maximum + 1, maximum)}"
    expect(
        past.status == 507 and isinstance(past.body, dict) and past.body.get("detail") == detail,
        f"registration {maximum + 1}: expected HTTP 507 {{'detail': {detail!r}}}, got "
        f"{past.status} {past.body!r}",
    )
    stored = (await query(t)).get(str(dp), {}).get("worker_addr", {})
    expect(str(maximum - held) not in stored, "the refused registration was stored")
