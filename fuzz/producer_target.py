"""The producer session driven by a fuzz program: pulls and cancels (valid, signed, mutated or
raw bytes) from a few D workers, P's request events, write completions and time.

After every step the session's books must agree with what it said (no write from a transfer
whose blocks are not held, no block freed twice or while written, one terminal reply per pull),
its own state must be coherent (every open pull has a live timer or a write in flight, every
remembered transfer has a retention timer), and at the end, once writes complete and time
passes, nothing is held and no pull is open.
"""

from __future__ import annotations

import itertools
from typing import Any, Final

from pdwire import (
    LocalProtocolError,
    XferResponseStatus,
    decode_response,
    encode_cancel,
    encode_pull,
)
from pdwire.events import (
    FreeBlocks,
    MessageReceived,
    ProducerInput,
    RejectRequest,
    SendReply,
    StartWrite,
    TimePassed,
    TransferFinished,
    TransferStarted,
    TransferWillNotSend,
    WriteCompleted,
)
from pdwire.messages import ErrorCode
from pdwire.producer import ProducerConfig, ProducerSession
from pdwire.transitions import TransferState
from pdwire.versions import LEGACY, PDWIRE_2

from . import world
from .reader import Reader, mutate

S = TransferState
TIDS: Final = ("x0", "x1", "x2", "u0")
D_REQS: Final = ("r0", "r1", "r2", "r3")
REMEMBERED: Final = frozenset({S.PLACEHOLDER, S.CANCELLED, S.SERVED, S.EXPIRED, S.NOT_SENT})


class Bug(AssertionError):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Bug(what)


class ProducerRun:
    def __init__(self, r: Reader) -> None:
        self.r = r
        p_side, _ = world.side(r, 0)
        profile = r.choice((PDWIRE_2, PDWIRE_2, LEGACY))
        caps, fingerprint = world.caps(r), r.choice((None, world.FP))
        key = r.choice((None, None, world.KEY))
        self.session = ProducerSession(
            ProducerConfig(
                side=p_side,
                profile=profile,
                caps=caps,
                fingerprint=fingerprint,
                auth_key=key if profile == PDWIRE_2 else None,  # 8.6-R14
            )
        )
        self.peers = [
            world.DWorker(*world.side(r, 1000 + 100 * i), host=f"d{i}", port=i + 1)
            for i in range(2)
        ]
        self.now = 0.0
        self.ids = itertools.count()
        self.last_frame = b""
        self.cur: dict[str, str] = {}  # tid -> P request started and not ended
        self.held: dict[str, str] = {}  # tid -> P request whose blocks P holds
        self.freed: set[str] = set()
        self.writes: set[int] = set()
        self.replied: set[bytes] = set()  # identities that got their terminal reply

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> None:
        r = self.r
        op = r.below(9)
        if op <= 1:
            peer = r.choice(self.peers)
            reqs = {
                r.choice(D_REQS): (r.choice(TIDS), r.choice(world.BLOCKS))
                for _ in range(1 + r.below(3))
            }
            msg = peer.pull(r, reqs)
            self.frame(encode_pull(msg, PDWIRE_2 if hasattr(msg, "pdwire_version") else LEGACY))
        elif op == 2:
            peer = r.choice(self.peers)
            cancels = {r.choice(D_REQS): r.choice(TIDS) for _ in range(1 + r.below(3))}
            self.frame(encode_cancel(peer.cancel(r, cancels), PDWIRE_2))
        elif op == 3:
            self.frame(mutate(self.last_frame, r) if r.flag() else r.blob(64))
        elif op == 4:
            tid = r.choice(TIDS)
            p_req = self.fresh()
            out = self.feed(TransferStarted(tid, p_req))
            if out is not None and not any(isinstance(o, RejectRequest) for o in out):
                self.cur.setdefault(tid, p_req)
        elif op == 5:
            tid = r.choice(TIDS)
            p_req = self.p_req_for(tid)
            self.finish(tid, p_req, r.choice(world.BLOCKS))
        elif op == 6:
            tid = r.choice(TIDS)
            ready = self.session.state_of(tid) is S.READY
            if self.feed(TransferWillNotSend(tid, self.p_req_for(tid)), misuse=ready) is not None:
                self.cur.pop(tid, None)
        elif op == 7:
            if self.writes and r.below(8):
                write_id = r.choice(sorted(self.writes))
                self.writes.discard(write_id)
                self.feed(WriteCompleted(write_id, r.choice((0, 0, 7))))
            else:
                self.feed(WriteCompleted(10**9, 0), misuse=True)
        else:
            self.now += r.choice(world.STEPS)
            self.feed(TimePassed())

    def fresh(self) -> str:
        return f"p{next(self.ids)}"

    def p_req_for(self, tid: str) -> str:
        return self.cur[tid] if tid in self.cur and self.r.flag() else self.fresh()

    def frame(self, data: bytes) -> None:
        self.last_frame = data
        self.feed(MessageReceived(b"id-%d" % next(self.ids), data))

    def finish(self, tid: str, p_req: str, blocks: list[list[int]]) -> None:
        ready = self.session.state_of(tid) is S.READY
        held_before = self.held.get(tid)
        self.held[tid] = p_req  # a waiting pull's write may start in this very step
        out = self.feed(TransferFinished(tid, p_req, blocks), misuse=ready)
        if out is None or any(isinstance(o, RejectRequest) for o in out):
            self.held.pop(tid, None)
            if held_before is not None:
                self.held[tid] = held_before
        elif self.cur.get(tid) == p_req or tid not in self.cur:
            self.cur.pop(tid, None)

    def feed(self, event: ProducerInput, *, misuse: bool = False) -> list[Any] | None:
        """Hand ``event`` to the session; None when it was refused as the misuse predicted."""
        before = self.summary()
        try:
            out = self.session.handle(event, self.now)
        except LocalProtocolError as e:
            check(misuse, f"unexpected {e!r} on {event}")
            check(self.summary() == before, f"refusing {event} changed the session")
            return None
        check(not misuse, f"{event} was accepted")
        self.check_outputs(out)
        self.check_state()
        return out

    def summary(self) -> tuple[object, ...]:
        s = self.session
        states = {tid: s.state_of(tid) for tid in TIDS}
        return s.blocks_held, s.open_pulls, s.next_deadline(), tuple(states.items())

    # -- invariants --------------------------------------------------------------------------

    def check_outputs(self, out: list[Any]) -> None:
        for o in out:
            if isinstance(o, SendReply):
                reply = decode_response(o.data)
                check(o.identity not in self.replied, f"reply after the terminal one: {reply}")
                if reply.status is not XferResponseStatus.CONTINUE:
                    self.replied.add(o.identity)
            elif isinstance(o, StartWrite):
                check(o.write_id not in self.writes, f"write id {o.write_id} reused")
                self.writes.add(o.write_id)
                for d_req in o.d_req_ids:
                    check(d_req in D_REQS, f"write for unknown request {d_req}")
            elif isinstance(o, FreeBlocks):
                check(o.p_req_id not in self.freed, f"{o.p_req_id} freed twice")
                self.freed.add(o.p_req_id)
                if self.held.get(o.transfer_id) == o.p_req_id:
                    del self.held[o.transfer_id]
            elif isinstance(o, RejectRequest):
                check(o.code is ErrorCode.DUPLICATE_TRANSFER_ID, f"reject {o}")
            else:
                raise Bug(f"unknown output {o!r}")

    def check_state(self) -> None:
        s = self.session
        timers = world.live_timers(s)
        check(set(s._writes) == self.writes, f"writes {set(s._writes)} != {self.writes}")
        check(s.blocks_held == len(self.held), f"held {s.blocks_held} != {self.held}")
        for tid, t in s._transfers.items():
            check(t.state is not None and t.state is not S.FORGOTTEN, f"{tid} in {t.state}")
            check((t.state is S.READY) == (t.blocks is not None), f"{tid} {t.state} {t.blocks}")
            check(t.writing >= 0 and (t.writing == 0 or t.state is S.READY), f"{tid} writing")
            check(t.waiting <= set(s._pulls), f"{tid} waited on by closed pulls")
            if t.state in REMEMBERED or (t.state is S.READY and not t.writing):
                check(("transfer", tid) in timers, f"{tid} in {t.state} with no timer")
        for write_id, key in s._writes.items():
            pull = s._pulls.get(key)
            check(pull is not None and pull.round is not None, f"write {write_id} of no round")
            check(pull is None or pull.round is None or pull.round.write_id == write_id, "round")
        for key, pull in s._pulls.items():
            if pull.round is None:
                check(bool(pull.pending), f"open pull {key} waits on nothing")
                check(("pull", (key, pull.generation)) in timers, f"pull {key} has no timer")

    def teardown(self) -> None:
        """Writes complete and time passes: everything P held is freed, every pull answered."""
        for _ in range(10):
            for write_id in sorted(self.writes):
                self.writes.discard(write_id)
                self.feed(WriteCompleted(write_id, 0))
            self.now += 3 * world.T + 1
            self.feed(TimePassed())
            if not self.writes and self.session.next_deadline() is None:
                break
        s = self.session
        check(not self.writes, "writes never end")
        check((s.blocks_held, s.open_pulls) == (0, 0), "blocks held or pulls open at the end")
        check(not self.held, f"never freed: {self.held}")
        left = {tid: t.state for tid, t in s._transfers.items() if t.state is not S.RECORDED}
        check(not left, f"remembered for ever: {left}")


def producer_session(data: bytes) -> None:
    """ProducerSession driven by a program of events; invariants after every step and at the end."""
    r = Reader(data)
    run = ProducerRun(r)
    for _ in range(world.MAX_STEPS):
        if not r.remaining:
            break
        run.step()
    run.teardown()
