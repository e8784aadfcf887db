"""The consumer session driven by a fuzz program: loads, bootstrap answers (built, or decoded
from fuzz JSON), P's replies (valid, signed, mutated or raw bytes), aborts and time.

After every step: every request is reported at most once (and released only after a failure
that left its blocks busy), a pulling request is listed by exactly as many open pulls as it
waits for, every open pull has a receive timer, every unreported pdwire/2 request a deadline,
and at the end, once the bootstrap answers and time passes, nothing is loading or open.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

from pdwire import (
    DecodeError,
    EngineEntry,
    LocalProtocolError,
    XferCancel,
    XferResponseStatus,
    XferResponseV2,
    decode_cancel,
    decode_json,
    decode_pull,
    encode_response,
)
from pdwire.consumer import ConsumerConfig, ConsumerSession
from pdwire.events import (
    AbortRequested,
    BlocksReleased,
    ClosePull,
    ConsumerInput,
    EngineResolved,
    LoadRequest,
    LoadsRequested,
    QueryBootstrap,
    ReplyReceived,
    RequestFailed,
    RequestLoaded,
    SendPull,
    TimePassed,
)
from pdwire.transitions import LoadState
from pdwire.versions import LEGACY, PDWIRE_2

from . import world
from .producer_target import Bug, check
from .reader import Reader, mutate

L = LoadState
ENGINES: Final = ("e0", "e1")
CODES: Final = (None, "ENGINE_ERROR", "CANCELLED", "LAYOUT_MISS", "NOT-A-CODE")
STATUSES: Final = tuple(XferResponseStatus)


def _entry(r: Reader, engine_id: str) -> EngineEntry | None:
    tp, pp = r.choice(world.TPS), r.choice(world.PPS)
    workers = {
        t: {p: f"tcp://p-{engine_id}-{t}-{p}:{5000 + 16 * p + t}" for p in range(pp)}
        for t in range(tp)
    }
    if r.below(8) == 0 and workers:
        del workers[r.below(tp)]  # an incomplete engine (4.2-R6)
    v2 = r.flag()
    return EngineEntry(
        engine_id=r.choice((engine_id, engine_id, engine_id, "elsewhere")),
        worker_addr=workers,
        pdwire_version=2 if v2 else None,
        pdwire_caps=sorted(world.caps(r)) if v2 else None,
        tp_size=tp if v2 else None,
        pp_size=pp if v2 else None,
    )


class ConsumerRun:
    def __init__(self, r: Reader) -> None:
        self.r = r
        d_side, pp_rank = world.side(r, 1000)
        self.profile = r.choice((PDWIRE_2, PDWIRE_2, LEGACY))
        caps, fingerprint = world.caps(r), r.choice((None, world.FP))
        layout_id, key = r.choice((0, 0x11)), r.choice((None, None, world.KEY))
        self.session = ConsumerSession(
            ConsumerConfig(
                hostname="d0",
                port=1,
                side=d_side,
                pp_rank=pp_rank,
                profile=self.profile,
                caps=caps,
                fingerprint=fingerprint,
                layout_id=layout_id,
                auth_key=key if self.profile == PDWIRE_2 else None,  # 8.6-R14
            )
        )
        self.now = 0.0
        self.ids = itertools.count()
        self.last_reply = b""
        self.live: dict[str, str] = {}  # d_req -> "loading" | "release-only" | "failed-busy"
        self.pulls: dict[int, dict[str, str]] = {}  # open pull id -> its requests
        self.queried: set[str] = set()
        self.used: list[str] = []

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> None:
        r = self.r
        op = r.below(8)
        if op <= 1:
            self.loads()
        elif op == 2:
            engine = r.choice(ENGINES)
            entry = _entry(r, engine) if r.below(4) else None
            self.feed(EngineResolved(engine, entry, "" if entry else "query failed"))
        elif op == 3:
            engine = r.choice(ENGINES)
            try:
                event = EngineResolved(engine, decode_json(EngineEntry, r.blob(200)))
            except DecodeError as e:
                event = EngineResolved(engine, None, str(e))
            self.feed(event)
        elif op <= 5:
            self.reply()
        elif op == 6:
            names = sorted(self.live) or ["nobody"]
            d_req = r.choice(names)
            if self.session.state_of(d_req) is L.RESOLVING:
                self.live[d_req] = "release-only"  # nothing allocated yet: never reported
            self.feed(AbortRequested(d_req))
        else:
            self.now += r.choice(world.STEPS)
            self.feed(TimePassed())

    def loads(self) -> None:
        r = self.r
        reqs = []
        for _ in range(1 + r.below(3)):
            d_req = r.choice(self.used) if self.used and r.below(8) == 0 else self.fresh()
            blocks = r.choice(world.BLOCKS)
            deadline = r.choice((0, 0, 500, 120_000))
            engine = r.choice(ENGINES)
            reqs.append(LoadRequest(d_req, f"x-{d_req}", engine, "http://boot", blocks, deadline))
        counts = Counter(q.d_req_id for q in reqs)
        misuse = any(n > 1 or d in self.live for d, n in counts.items())
        self.feed(LoadsRequested(tuple(reqs)), misuse=misuse, before=reqs)

    def fresh(self) -> str:
        self.used.append(f"d{next(self.ids)}")
        return self.used[-1]

    def reply(self) -> None:
        r = self.r
        if not self.pulls or r.below(8) == 0:
            self.feed(ReplyReceived(10**9, r.blob(32)))
            return
        pull_id = r.choice(sorted(self.pulls))
        if r.below(6) == 0:
            data = mutate(self.last_reply, r) if r.flag() else r.blob(64)
            self.feed(ReplyReceived(pull_id, data))
            return
        names = [*sorted(self.pulls[pull_id]), "stranger"]
        fates = [r.below(3) for _ in names]
        status = r.choice(STATUSES)
        ok = [d for d, f in zip(names, fates, strict=True) if f == 1]
        err = [d for d, f in zip(names, fates, strict=True) if f == 2]
        if status >= XferResponseStatus.ERROR:
            ok = []
        v2 = r.flag()
        reply = XferResponseV2(
            status,
            ok or None,
            err or None,
            err_msg=r.choice((None, "boom")),
            layout_id=r.choice((0, 0x11)),
            pdwire_version=2 if v2 else 0,
            pdwire_caps=sorted(world.caps(r)) if v2 else [],
            err_code=r.choice(CODES) if v2 else None,
            err_codes={d: "ENGINE_ERROR" for d in err} if v2 and err and r.flag() else None,
        )
        data = encode_response(world.signed(r, reply) if v2 else reply, PDWIRE_2 if v2 else LEGACY)
        self.last_reply = data
        self.feed(ReplyReceived(pull_id, data))

    def feed(
        self,
        event: ConsumerInput,
        *,
        misuse: bool = False,
        before: Sequence[LoadRequest] = (),
    ) -> list[Any] | None:
        snapshot = self.summary()
        try:
            out = self.session.handle(event, self.now)
        except LocalProtocolError as e:
            check(misuse, f"unexpected {e!r} on {event}")
            check(self.summary() == snapshot, f"refusing {event} changed the session")
            return None
        check(not misuse, f"{event} was accepted")
        if isinstance(event, EngineResolved):
            self.queried.discard(event.engine_id)
        for q in before:
            self.live[q.d_req_id] = "loading" if any(q.blocks) else "release-only"
        self.check_outputs(out)
        self.check_state()
        return out

    def summary(self) -> tuple[object, ...]:
        s = self.session
        return s.loading, s.open_pulls, s.next_deadline(), tuple(sorted(s._loads))

    # -- invariants --------------------------------------------------------------------------

    def check_outputs(self, out: list[Any]) -> None:
        for o in out:
            if isinstance(o, QueryBootstrap):
                check(o.engine_id not in self.queried, f"second query for {o.engine_id}")
                self.queried.add(o.engine_id)
            elif isinstance(o, SendPull):
                check(o.pull_id not in self.pulls, f"pull id {o.pull_id} reused")
                if isinstance(o.message, XferCancel):
                    check(self.profile == PDWIRE_2, "a legacy D sent a cancel")
                    self.pulls[o.pull_id] = dict(decode_cancel(o.data).cancel_reqs)
                else:
                    msg = decode_pull(o.data)
                    self.pulls[o.pull_id] = {d: t for d, (t, _) in msg.req_blocks.items()}
            elif isinstance(o, ClosePull):
                check(self.pulls.pop(o.pull_id, None) is not None, f"close of {o.pull_id}")
            elif isinstance(o, RequestLoaded | RequestFailed | BlocksReleased):
                self.on_report(o)
            else:
                raise Bug(f"unknown output {o!r}")

    def on_report(self, o: RequestLoaded | RequestFailed | BlocksReleased) -> None:
        state = self.live.get(o.d_req_id)
        if isinstance(o, BlocksReleased):
            check(state == "failed-busy", f"{o} in state {state}")
            del self.live[o.d_req_id]
            return
        check(state == "loading", f"{o} in state {state}")
        if isinstance(o, RequestFailed) and not o.blocks_free:
            self.live[o.d_req_id] = "failed-busy"
        else:
            del self.live[o.d_req_id]

    def check_state(self) -> None:
        s = self.session
        timers = world.live_timers(s)
        check(set(s._pulls) == set(self.pulls), f"pulls {set(s._pulls)} != {set(self.pulls)}")
        for d_req, load in s._loads.items():
            check(load.state in (L.RESOLVING, L.PULLING, L.TIMED_OUT), f"{d_req} {load.state}")
            if load.state is L.RESOLVING:
                waiting = s._waiting.get(load.req.engine_id, [])
                check(sum(q.d_req_id == d_req for q in waiting) == 1, f"{d_req} not waiting once")
                check(load.req.engine_id in self.queried, f"{d_req} waits on no query")
            else:
                listed = sum(d_req in p.reqs for p in s._pulls.values() if not p.cancel)
                check(load.outstanding == listed > 0, f"{d_req} waits {load.outstanding}/{listed}")
            if self.profile == PDWIRE_2 and not load.reported:
                check(("deadline", d_req) in timers, f"{d_req} has no deadline")
        for pull_id, pull in s._pulls.items():
            check(("receive", (pull_id, pull.receive_until)) in timers, f"pull {pull_id} no timer")
        for d_req, state in list(self.live.items()):
            if state != "release-only":
                check(d_req in s._loads, f"{d_req} forgotten without a report")
            elif d_req not in s._loads:
                del self.live[d_req]

    def teardown(self) -> None:
        """The bootstrap answers and time passes: every request ends, reported as it should."""
        for _ in range(6):
            for engine in sorted(self.queried):
                self.queried.discard(engine)
                self.feed(EngineResolved(engine, None, "gone"))
            self.now += 2 * world.T + 200
            self.feed(TimePassed())
        s = self.session
        check((s.loading, s.open_pulls, s.next_deadline()) == (0, 0, None), "not settled")
        left = {d: v for d, v in self.live.items() if v != "release-only"}
        check(not left, f"never reported: {left}")


def consumer_session(data: bytes) -> None:
    """ConsumerSession driven by a program of events; invariants after every step and at the end."""
    r = Reader(data)
    run = ConsumerRun(r)
    for _ in range(world.MAX_STEPS):
        if not r.remaining:
            break
        run.step()
    run.teardown()
