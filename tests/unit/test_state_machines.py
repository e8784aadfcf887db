"""The state machines of §10.12: the transition tables as data, and Hypothesis stateful tests that
drive ProducerSession and ConsumerSession through random interleavings and check the protocol's
invariants after every step and at teardown (everything settles once the timers have run).

"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Final, NamedTuple, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pdwire import (
    LocalProtocolError,
    XferCancel,
    XferResponseStatus,
    decode_pull,
    decode_response,
)
from pdwire.consumer import ConsumerSession
from pdwire.events import (
    AbortRequested,
    BlocksReleased,
    ClosePull,
    EngineResolved,
    FreeBlocks,
    LoadRequest,
    LoadsRequested,
    MessageReceived,
    QueryBootstrap,
    RejectRequest,
    ReplyReceived,
    RequestFailed,
    RequestLoaded,
    SendPull,
    SendReply,
    StartWrite,
    TransferFinished,
    TransferStarted,
    TransferWillNotSend,
    WriteCompleted,
)
from pdwire.producer import ProducerSession
from pdwire.transitions import (
    LOAD_TRANSITIONS,
    TRANSFER_TRANSITIONS,
    LoadEvent,
    LoadState,
    TransferEvent,
    TransferState,
)
from pdwire.versions import ALL_CAPS, LEGACY, PDWIRE_2

from .sessions_helpers import (
    LEGACY_PULL_KEYS,
    LEGACY_REPLY_KEYS,
    DPeer,
    Driver,
    T,
    consumer,
    d_side,
    entry,
    producer,
    reply_bytes,
    wire_keys,
)

FINISH, CONTINUE = XferResponseStatus.FINISH, XferResponseStatus.CONTINUE
ERROR, LAYOUT_MISS = XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS
TS, TE = TransferState, TransferEvent
LS, LE = LoadState, LoadEvent

# -- (a) the tables ------------------------------------------------------------------------------

#: §10.12, P per transfer_id, written out from the spec's prose and table (not from the code).
_DONE = (TS.SERVED, TS.EXPIRED, TS.NOT_SENT)
EXPECTED_TRANSFER: Final[dict[tuple[TransferState | None, TransferEvent], TransferState]] = {
    (None, TE.PULL_NAMED): TS.PLACEHOLDER,
    (None, TE.STARTED): TS.RECORDED,
    (None, TE.FINISHED): TS.READY,
    (None, TE.WILL_NOT_SEND): TS.NOT_SENT,
    (None, TE.CANCELLED): TS.CANCELLED,
    (TS.PLACEHOLDER, TE.PULL_NAMED): TS.PLACEHOLDER,
    (TS.PLACEHOLDER, TE.STARTED): TS.RECORDED,
    (TS.PLACEHOLDER, TE.FINISHED): TS.READY,
    (TS.PLACEHOLDER, TE.WILL_NOT_SEND): TS.NOT_SENT,
    (TS.PLACEHOLDER, TE.CANCELLED): TS.PLACEHOLDER,
    (TS.PLACEHOLDER, TE.TIMER_FIRED): TS.EXPIRED,
    (TS.RECORDED, TE.PULL_NAMED): TS.RECORDED,
    (TS.RECORDED, TE.FINISHED): TS.READY,
    (TS.RECORDED, TE.WILL_NOT_SEND): TS.NOT_SENT,
    (TS.RECORDED, TE.CANCELLED): TS.RECORDED,
    (TS.READY, TE.PULL_NAMED): TS.READY,
    (TS.READY, TE.CANCELLED): TS.READY,
    (TS.READY, TE.ALL_SETTLED): TS.SERVED,
    (TS.READY, TE.TIMER_FIRED): TS.EXPIRED,
    (TS.CANCELLED, TE.PULL_NAMED): TS.CANCELLED,
    (TS.CANCELLED, TE.STARTED): TS.RECORDED,
    (TS.CANCELLED, TE.FINISHED): TS.READY,
    (TS.CANCELLED, TE.WILL_NOT_SEND): TS.NOT_SENT,
    (TS.CANCELLED, TE.CANCELLED): TS.CANCELLED,
    (TS.CANCELLED, TE.TIMER_FIRED): TS.FORGOTTEN,
    **{(s, TE.PULL_NAMED): s for s in _DONE},
    **{(s, TE.CANCELLED): s for s in _DONE},
    **{(s, TE.TIMER_FIRED): TS.FORGOTTEN for s in _DONE},
    **{(s, TE.STARTED): TS.RECORDED for s in _DONE},
    **{(s, TE.FINISHED): TS.READY for s in _DONE},
    **{(s, TE.WILL_NOT_SEND): TS.NOT_SENT for s in _DONE},
}

#: §10.12, D per request it loads.
EXPECTED_LOAD: Final[dict[tuple[LoadState | None, LoadEvent], LoadState]] = {
    (None, LE.ENGINE_KNOWN): LS.PULLING,
    (None, LE.ENGINE_UNKNOWN): LS.RESOLVING,
    (LS.RESOLVING, LE.ENGINE_KNOWN): LS.PULLING,
    (LS.RESOLVING, LE.ALL_SETTLED_FAILED): LS.FAILED,
    (LS.RESOLVING, LE.DEADLINE): LS.FAILED,
    (LS.PULLING, LE.PULL_SETTLED): LS.PULLING,
    (LS.PULLING, LE.ALL_LOADED): LS.LOADED,
    (LS.PULLING, LE.ALL_SETTLED_FAILED): LS.FAILED,
    (LS.PULLING, LE.DEADLINE): LS.TIMED_OUT,
    (LS.TIMED_OUT, LE.PULL_SETTLED): LS.TIMED_OUT,
    (LS.TIMED_OUT, LE.ALL_LOADED): LS.FAILED,
    (LS.TIMED_OUT, LE.ALL_SETTLED_FAILED): LS.FAILED,
    (LS.TIMED_OUT, LE.DEADLINE): LS.TIMED_OUT,
}

K = TypeVar("K")
V = TypeVar("V")


class Table(NamedTuple):
    table: Mapping[tuple[Any, Any], Any]
    expected: Mapping[tuple[Any, Any], Any]
    states: list[Any]  # None (nothing held) first
    events: list[Any]
    present: int  # pairs of the product in the table
    absent: int  # pairs of the product not in it


TABLES = {
    "transfer": Table(TRANSFER_TRANSITIONS, EXPECTED_TRANSFER, [None, *TS], list(TE), 43, 20),
    "load": Table(LOAD_TRANSITIONS, EXPECTED_LOAD, [None, *LS], list(LE), 13, 23),
}


@pytest.mark.parametrize("name", TABLES)
def test_transition_table_over_the_whole_product(name: str) -> None:
    """§10.12: for every (state, event) of the enums' product, a pair the spec lists yields its
    next state through the table, and a pair it does not list is absent; the counts are pinned
    so the test fails if the table grows or shrinks silently."""
    t = TABLES[name]
    product = list(itertools.product(t.states, t.events))
    present = absent = 0
    for pair in product:
        assert t.table.get(pair) == t.expected.get(pair), pair
        if pair in t.expected:
            present += 1
        else:
            absent += 1
            assert pair not in t.table
    assert (present, absent) == (t.present, t.absent)
    assert len(t.table) == t.present and set(t.table) <= set(product)


def test_terminal_states_have_no_way_out_but_the_listed_ones() -> None:
    """§10.12: forgotten, loaded and failed are final (no transition leaves them), and every
    remembered end of a transfer is forgotten when its timer fires."""
    assert not [k for k in TRANSFER_TRANSITIONS if k[0] is TS.FORGOTTEN]
    assert not [k for k in LOAD_TRANSITIONS if k[0] in (LS.LOADED, LS.FAILED)]
    for done in (*_DONE, TS.CANCELLED):
        assert TRANSFER_TRANSITIONS[done, TE.TIMER_FIRED] is TS.FORGOTTEN


def _reachable(table: Mapping[tuple[K | None, Any], V]) -> dict[K | None, set[K | None]]:
    """State -> every state reachable from it in zero or more transitions of ``table``."""
    edges: dict[Any, set[Any]] = defaultdict(set)
    for (src, _), dst in table.items():
        edges[src].add(dst)
    out: dict[Any, set[Any]] = {}
    for start in {s for s, _ in table} | set(table.values()):
        seen, todo = {start}, [start]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        out[start] = seen
    return out


TRANSFER_REACH = _reachable(TRANSFER_TRANSITIONS)
LOAD_REACH = _reachable(LOAD_TRANSITIONS)


def transfer_move_ok(before: TransferState | None, after: TransferState | None) -> bool:
    """Whether the session may go from ``before`` to ``after`` in one step. A forgotten state is
    dropped, which reads as None, and from None the table starts again (a deferred cancel may
    recreate a transfer in the step that forgot it)."""
    if before == after:
        return True
    targets = set(TRANSFER_REACH.get(before, {before}))
    if TS.FORGOTTEN in targets:
        targets |= TRANSFER_REACH[None]
    return (TS.FORGOTTEN if after is None else after) in targets


def load_move_ok(before: LoadState | None, after: LoadState | None) -> bool:
    """Loaded and failed requests are dropped by the session, so they read as None."""
    if before == after:
        return True
    targets = LOAD_REACH.get(before, {before})
    if after is None:
        return before is None or bool(targets & {LS.LOADED, LS.FAILED})
    return after in targets


# -- (b) ProducerSession -------------------------------------------------------------------------

MACHINE_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TIDS: Final = ("x0", "x1", "x2")
UNKNOWN_TID: Final = "u0"  # named by pulls, never started by P
#: P TP1 pairs with both ranks of a D TP2: need_send is 2 for every transfer.
PEERS: Final = (DPeer(side=d_side(2, 0), port=1), DPeer(side=d_side(2, 1), port=2))
P_BLOCKS: Final = ([[1, 2, 3]], [[1]])  # the second is fewer than D asks for
BAD_FRAMES: Final = (
    b"\x00garbage",
    b"",
    b"\x91\xa1x",
    PEERS[0].pull({"r-x0": ("x0", [[5]])})[:-4],
    PEERS[0].cancel({"r-x0": "x0"})[:-2],
)


def d_req_of(tid: str, dup: bool) -> str:
    """D's request id for ``tid``: both D ranks use the same one (one D request per transfer);
    ``dup`` names another D request for the same transfer_id."""
    return f"r-{tid}-dup" if dup else f"r-{tid}"


class ProducerMachine(RuleBasedStateMachine):
    """Random interleavings of pulls, cancels, P's request events, write completions and time."""

    def __init__(self) -> None:
        super().__init__()
        self.p: Driver[ProducerSession] = Driver(producer())
        self.p_reqs = itertools.count()
        self.idents = itertools.count()
        self.cur: dict[str, str] = {}  # tid -> its P request (started, not ended yet)
        self.held: dict[str, str] = {}  # tid -> P request whose blocks P holds
        self.freed: set[str] = set()
        self.writes: dict[int, tuple[bytes, int, frozenset[str]]] = {}  # id -> pull, peer, tids
        self.pulls: dict[bytes, dict[str, Any]] = {}  # identity -> what it asked, what it got
        self.cancels: dict[bytes, dict[str, Any]] = {}
        self.bad: dict[bytes, int] = {}  # identity of a bad frame -> replies
        self.ok_peers: dict[str, set[int]] = defaultdict(set)  # tid -> peers served ok
        self.withdrawn: set[tuple[int, str]] = set()  # (peer, tid) named by a cancel
        self.states: dict[str, TransferState | None] = dict.fromkeys((*TIDS, UNKNOWN_TID))

    # -- feeding and checking ------------------------------------------------------------------

    def feed(self, event: object, dt: float = 0.0) -> list[object]:
        out = self.p(event, self.p.now + dt)
        self.check(out)
        return out

    def check(self, out: list[object]) -> None:
        for o in out:
            if isinstance(o, SendReply):
                self.on_reply(o)
            elif isinstance(o, StartWrite):
                self.on_write(o)
            elif isinstance(o, FreeBlocks):
                self.on_free(o)
            elif isinstance(o, RejectRequest):
                assert o.transfer_id in TIDS

    def on_write(self, w: StartWrite) -> None:
        # Two peers' pulls may name the same d_req_id: the write's peer tells them apart.
        owners = [
            i
            for i, p in self.pulls.items()
            if not p["done"]
            and set(w.d_req_ids) <= p["open"]
            and w.peer == f"{PEERS[p['peer']].hostname}:{PEERS[p['peer']].port}"
        ]
        assert owners, f"write {w} for no open pull"
        ident = owners[-1]
        pull = self.pulls[ident]
        tids = frozenset(pull["reqs"][d] for d in w.d_req_ids)
        for tid in tids:
            assert tid in self.held, f"write from {tid}, whose blocks P does not hold"
        self.writes[w.write_id] = (ident, pull["peer"], tids)
        pull["writing_reqs"] = w.d_req_ids

    def on_free(self, f: FreeBlocks) -> None:
        assert f.p_req_id not in self.freed, f"{f.p_req_id} freed twice"
        self.freed.add(f.p_req_id)
        for _, _, tids in self.writes.values():
            assert f.transfer_id not in tids, f"{f} while a write of it is in flight (10.9.2)"
        if self.held.get(f.transfer_id) == f.p_req_id:
            del self.held[f.transfer_id]

    def on_reply(self, o: SendReply) -> None:
        reply = decode_response(o.data)  # 3.4-R22..R25 are checked by the decoder
        ok, err = reply.ok_reqs or [], reply.err_reqs or []
        assert not set(ok) & set(err)
        if reply.status >= ERROR:
            assert not ok
        if o.identity in self.bad:
            assert reply.status is ERROR and self.bad[o.identity] == 0
            self.bad[o.identity] += 1
            return
        if o.identity in self.cancels:
            c = self.cancels[o.identity]
            assert not c["answered"] and reply.status in (FINISH, ERROR)
            assert set(ok) <= set(c["reqs"])
            c["answered"] = True
            return
        pull = self.pulls[o.identity]
        assert not pull["done"], "reply after the terminal one (3.4-R14)"
        if not pull["v2"]:
            assert wire_keys(o.data) <= LEGACY_REPLY_KEYS
        listed = set(ok) | set(err)
        assert len(ok) + len(err) == len(listed)
        assert listed <= pull["open"], "a request listed twice or not in the pull (3.4-R16/R18)"
        assert reply.status is not LAYOUT_MISS  # every pull carries its layout
        pull["open"] -= listed
        for d in ok:
            self.ok_peers[pull["reqs"][d]].add(pull["peer"])
        if reply.status is FINISH:
            assert not pull["open"], "FINISH left requests unreported (3.4-R17)"
        if reply.status in (FINISH, ERROR):
            pull["done"] = True

    # -- P's request events --------------------------------------------------------------------

    @rule(tid=st.sampled_from(TIDS))
    def start(self, tid: str) -> None:
        p_req = f"p{next(self.p_reqs)}"
        out = self.feed(TransferStarted(tid, p_req))
        rejected = [o for o in out if isinstance(o, RejectRequest)]
        if rejected:
            assert rejected == [RejectRequest(p_req, tid, rejected[0].code, rejected[0].message)]
            assert self.p.session.state_of(tid) in (TS.RECORDED, TS.READY)
        else:
            assert self.p.session.state_of(tid) is TS.RECORDED
            self.cur[tid] = p_req

    @rule(tid=st.sampled_from(TIDS), fresh=st.booleans(), blocks=st.sampled_from(P_BLOCKS))
    def finish(self, tid: str, fresh: bool, blocks: list[list[int]]) -> None:
        p_req = f"p{next(self.p_reqs)}" if fresh or tid not in self.cur else self.cur.pop(tid)
        before = self.p.session.state_of(tid)
        held_before, ok_before = self.held.get(tid), self.ok_peers[tid]
        self.held[tid] = p_req  # before feeding: a waiting pull's write may start at once
        self.ok_peers[tid] = set()
        try:
            out = self.feed(TransferFinished(tid, p_req, blocks))
            rejected = any(isinstance(o, RejectRequest) for o in out)
        except LocalProtocolError:
            assert before is TS.READY  # finishing a transfer twice: documented misuse
            rejected = True
        if rejected:  # the transfer stays with the request that held it
            assert before in (TS.READY, TS.RECORDED)
            self.held.pop(tid, None)
            if held_before is not None:
                self.held[tid] = held_before
            self.ok_peers[tid] = ok_before
            return
        self.cur.pop(tid, None)

    @rule(tid=st.sampled_from(TIDS), fresh=st.booleans())
    def will_not_send(self, tid: str, fresh: bool) -> None:
        before = self.p.session.state_of(tid)
        p_req = f"p{next(self.p_reqs)}" if fresh or tid not in self.cur else self.cur.pop(tid)
        try:
            self.feed(TransferWillNotSend(tid, p_req))
        except LocalProtocolError:
            assert before is TS.READY
            return
        self.cur.pop(tid, None)

    # -- D's messages --------------------------------------------------------------------------

    def _open_for(self, peer: int, tid: str) -> bool:
        return any(
            not p["done"] and p["peer"] == peer and tid in {p["reqs"][d] for d in p["open"]}
            for p in self.pulls.values()
        )

    @rule(
        peer=st.sampled_from((0, 1)),
        tids=st.lists(st.sampled_from((*TIDS, UNKNOWN_TID)), min_size=1, max_size=3),
        dup=st.booleans(),
        release_only=st.booleans(),
        v2=st.booleans(),
        deadline_ms=st.sampled_from((0, 0, 3_000)),
    )
    def pull(
        self, peer: int, tids: list[str], dup: bool, release_only: bool, v2: bool, deadline_ms: int
    ) -> None:
        reqs: dict[str, tuple[str, list[list[int]]]] = {}
        for n, tid in enumerate(tids):
            blocks: list[list[int]] = [] if release_only else [[5, 6]]
            reqs[d_req_of(tid, dup and n > 0)] = (tid, blocks)
        if not reqs:
            return
        ident = b"pull-%d" % next(self.idents)
        d = PEERS[peer]
        d = DPeer(side=d.side, port=d.port, v2=v2)
        data = d.pull(reqs, deadline_ms=deadline_ms if v2 else 0)
        self.pulls[ident] = {
            "peer": peer,
            "reqs": {k: t for k, (t, _) in reqs.items()},
            "open": set(reqs),
            "done": False,
            "v2": v2,
            "writing_reqs": (),
        }
        self.feed(MessageReceived(ident, data))

    @rule(
        peer=st.sampled_from((0, 1)),
        tids=st.sets(st.sampled_from((*TIDS, UNKNOWN_TID)), min_size=1),
    )
    def cancel(self, peer: int, tids: set[str]) -> None:
        reqs = {d_req_of(t, False): t for t in sorted(tids)}
        mine = [(self.pulls[i], written) for i, p, written in self.writes.values() if p == peer]
        if any(set(reqs) & set(pull["writing_reqs"]) for pull, _ in mine) and len(mine) > 1:
            return  # held back behind one write (3.5-R10); the model follows one
        ident = b"cancel-%d" % next(self.idents)
        self.withdrawn |= {(peer, t) for t in tids}
        self.cancels[ident] = {"reqs": reqs, "answered": False, "peer": peer}
        self.feed(MessageReceived(ident, PEERS[peer].cancel(reqs)))

    @precondition(lambda self: bool(self.writes))
    @rule(data=st.data())
    def cancel_during_write(self, data: st.DataObject) -> None:
        """3.5-R10: a cancel naming a request being written is answered after the write."""
        write_id = data.draw(st.sampled_from(sorted(self.writes)))
        ident, peer, _ = self.writes[write_id]
        pull = self.pulls[ident]
        self.cancel(peer, {pull["reqs"][d] for d in pull["writing_reqs"]})

    @rule(frame=st.sampled_from(BAD_FRAMES))
    def bad_frame(self, frame: bytes) -> None:
        ident = b"bad-%d" % next(self.idents)
        self.bad[ident] = 0
        before = (self.p.session.blocks_held, self.p.session.open_pulls)
        out = self.feed(MessageReceived(ident, frame))
        assert self.bad[ident] == 1 and len(out) == 1
        assert (self.p.session.blocks_held, self.p.session.open_pulls) == before

    # -- the transfer engine and the clock -----------------------------------------------------

    @precondition(lambda self: bool(self.writes))
    @rule(data=st.data(), status=st.sampled_from((0, 0, 0, 7)))
    def complete_write(self, data: st.DataObject, status: int) -> None:
        write_id = data.draw(st.sampled_from(sorted(self.writes)))
        self.complete(write_id, status)

    @precondition(lambda self: bool(self.writes))
    @rule(data=st.data())
    def slow_write(self, data: st.DataObject) -> None:
        """6.3-R1, 10.9.2: the retention timer passes while a write is in flight."""
        write_id = data.draw(st.sampled_from(sorted(self.writes)))
        self.check(self.p.advance(self.p.now + T + 20))
        self.complete(write_id, 0)

    def complete(self, write_id: int, status: int) -> None:
        ident, _, _ = self.writes.pop(write_id)
        self.pulls[ident]["writing_reqs"] = ()
        self.feed(WriteCompleted(write_id, status))

    @rule()
    def unknown_write(self) -> None:
        with pytest.raises(LocalProtocolError):
            self.p(WriteCompleted(10**9, 0), self.p.now)

    @rule(dt=st.sampled_from((0.5, 5.0, 100.0, T + 20)))
    def wait(self, dt: float) -> None:
        self.check(self.p.advance(self.p.now + dt))

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def books_agree(self) -> None:
        s = self.p.session
        assert s.blocks_held == len(self.held), (s.blocks_held, self.held)
        assert s.open_pulls == sum(not p["done"] for p in self.pulls.values())
        for tid, before in self.states.items():
            after = s.state_of(tid)
            assert transfer_move_ok(before, after), (tid, before, after)
            self.states[tid] = after
        # A cancel goes unanswered only while a write for one of its requests is in flight.
        for c in self.cancels.values():
            if not c["answered"]:
                assert any(peer == c["peer"] for _, peer, _ in self.writes.values())

    def teardown(self) -> None:
        for _ in range(10):
            for write_id in sorted(self.writes):
                self.complete(write_id, 0)
            self.check(self.p.advance(self.p.now + 3 * T + 1))
            if not self.writes:
                break
        s = self.p.session
        assert not self.writes
        assert (s.blocks_held, s.open_pulls) == (0, 0)
        assert all(p["done"] for p in self.pulls.values())
        assert all(c["answered"] for c in self.cancels.values())
        assert not self.held


ProducerMachine.TestCase.settings = MACHINE_SETTINGS
test_producer_machine = ProducerMachine.TestCase


def test_machine_tells_apart_two_peers_writes_of_one_d_req_id() -> None:
    """Both D peers pull x0 under the same d_req_id; the cancel of one waits for its own
    write, which the model must attribute to that peer (a sequence the machine once found)."""
    m = ProducerMachine()
    for peer in (1, 0):
        m.pull(peer=peer, tids=["x0"], dup=False, release_only=False, v2=False, deadline_ms=0)
    m.finish("x0", fresh=False, blocks=[[1, 2, 3]])
    assert sorted(peer for _, peer, _ in m.writes.values()) == [0, 1]
    m.cancel(peer=1, tids={"x0"})
    m.books_agree()
    m.teardown()


# -- (b) ConsumerSession -------------------------------------------------------------------------

ENGINES: Final = ("e0", "e1")
DEADLINE: Final = 60.0
RECEIVE: Final = T + 60


class ConsumerMachine(RuleBasedStateMachine):
    """Random interleavings of loads, bootstrap answers, P's replies, aborts and time."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()
        self.loads: dict[str, dict[str, Any]] = {}  # d_req -> what we know
        self.open: dict[int, dict[str, Any]] = {}  # pull_id -> its requests, still unreported
        self.closed: set[int] = set()
        self.queried: set[str] = set()  # engines with a query out
        self.states: dict[str, LoadState | None] = {}

    @initialize(
        profile=st.sampled_from((PDWIRE_2, LEGACY)),
        peer=st.sampled_from(("v2", "v2-no-cancel", "legacy")),
        p_tp=st.sampled_from((1, 2)),
        layout_id=st.sampled_from((0, 0x11)),
    )
    def configure(self, profile: str, peer: str, p_tp: int, layout_id: int) -> None:
        self.profile, self.peer, self.layout_id = profile, peer, layout_id
        self.c: Driver[ConsumerSession] = Driver(consumer(profile=profile, layout_id=layout_id))
        caps = ALL_CAPS - {"cancel"} if peer == "v2-no-cancel" else ALL_CAPS
        self.entries = {e: entry(e, tp=p_tp, v2=peer != "legacy", caps=caps) for e in ENGINES}
        self.caps = caps
        self.cancel_ok = profile == PDWIRE_2 and peer == "v2"

    # -- feeding and checking ------------------------------------------------------------------

    def feed(self, event: object, dt: float = 0.0) -> list[object]:
        out = self.c(event, self.c.now + dt)
        self.check(out)
        return out

    def check(self, out: list[object]) -> None:
        for o in out:
            if isinstance(o, QueryBootstrap):
                assert o.engine_id not in self.queried, "a second query for one engine"
                self.queried.add(o.engine_id)
            elif isinstance(o, SendPull):
                self.on_send(o)
            elif isinstance(o, ClosePull):
                assert o.pull_id in self.open, "ClosePull of a pull that is not open"
                self.closed.add(o.pull_id)
                del self.open[o.pull_id]
            elif isinstance(o, RequestLoaded | RequestFailed | BlocksReleased):
                self.on_report(o)

    def on_send(self, o: SendPull) -> None:
        if isinstance(o.message, XferCancel):
            assert self.cancel_ok, "XferCancel to a P that did not agree cancel (8.4-R4)"
            reqs = dict(o.message.cancel_reqs)
            self.open[o.pull_id] = {"reqs": reqs, "cancel": True, "lean": False}
            return
        msg = decode_pull(o.data)
        if self.profile == LEGACY or self.peer == "legacy":
            assert wire_keys(o.data) <= LEGACY_PULL_KEYS
        for d in msg.req_blocks:
            info = self.loads[d]
            # 6.3-R6: no pull for a request whose deadline has passed.
            assert self.profile == LEGACY or self.c.now < info["at"] + DEADLINE
        self.open[o.pull_id] = {
            "reqs": {d: t for d, (t, _) in msg.req_blocks.items()},
            "cancel": False,
            "lean": not msg.kv_caches_base_addr,
        }

    def on_report(self, o: object) -> None:
        info = self.loads[o.d_req_id]  # type: ignore[attr-defined]
        assert not info["release_only"], f"release-only request reported: {o}"
        if isinstance(o, BlocksReleased):
            assert info["report"] is not None and not info["report"].blocks_free
            assert not info["released"]
            info["released"] = True
        else:
            assert info["report"] is None, f"second report {o} after {info['report']}"
            info["report"] = o

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        engine=st.sampled_from(ENGINES),
        kinds=st.lists(st.sampled_from(("load", "load", "release")), min_size=1, max_size=2),
    )
    def request(self, engine: str, kinds: list[str]) -> None:
        reqs = []
        for kind in kinds:
            d_req = f"d{next(self.ids)}"
            blocks: list[list[int]] = [] if kind == "release" else [[1, 2]]
            reqs.append(LoadRequest(d_req, f"x-{d_req}", engine, "http://boot", blocks))
            self.loads[d_req] = {
                "release_only": kind == "release",
                "report": None,
                "released": False,
                "at": self.c.now,
            }
            self.states[d_req] = None
        self.feed(LoadsRequested(tuple(reqs)))

    @precondition(lambda self: bool(self.queried))
    @rule(data=st.data(), ok=st.booleans())
    def resolve(self, data: st.DataObject, ok: bool) -> None:
        engine = data.draw(st.sampled_from(sorted(self.queried)))
        self.queried.discard(engine)
        event = EngineResolved(engine, self.entries[engine] if ok else None, "" if ok else "boom")
        self.feed(event)

    @precondition(lambda self: bool(self.open))
    @rule(
        data=st.data(),
        kind=st.sampled_from(("finish", "finish", "continue", "error", "layout-miss", "garbage")),
        echo=st.booleans(),
    )
    def reply(self, data: st.DataObject, kind: str, echo: bool) -> None:
        pull_id = data.draw(st.sampled_from(sorted(self.open)))
        pull = self.open[pull_id]
        reqs = sorted(pull["reqs"])
        v2 = self.peer != "legacy"
        if pull["cancel"]:
            ok = data.draw(st.lists(st.sampled_from(reqs), unique=True)) if reqs else []
            self.feed(ReplyReceived(pull_id, reply_bytes(FINISH, ok, v2=True, caps=self.caps)))
            return
        if kind == "layout-miss":
            self.feed(
                ReplyReceived(
                    pull_id, reply_bytes(LAYOUT_MISS, err_msg="miss", v2=v2, caps=self.caps)
                )
            )
            return
        if kind == "garbage":
            self.feed(ReplyReceived(pull_id, b"\x00garbage"))
            return
        if kind == "error":
            self.feed(
                ReplyReceived(pull_id, reply_bytes(ERROR, err_msg="boom", v2=v2, caps=self.caps))
            )
            return
        fate = data.draw(
            st.lists(st.sampled_from(("ok", "err", "none")), min_size=len(reqs), max_size=len(reqs))
        )
        ok = [d for d, f in zip(reqs, fate, strict=True) if f == "ok"]
        err = [d for d, f in zip(reqs, fate, strict=True) if f == "err"]
        status = FINISH if kind == "finish" else CONTINUE
        layout_id = self.layout_id if echo else 0
        msg = reply_bytes(
            status,
            ok,
            err,
            err_msg="bad" if err else None,
            layout_id=layout_id,
            v2=v2,
            caps=self.caps,
            err_code="ENGINE_ERROR" if err and v2 else None,
        )
        for d in ok + err:
            pull["reqs"].pop(d)
        self.feed(ReplyReceived(pull_id, msg))

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        d_req = data.draw(st.sampled_from(sorted(self.loads)))
        if self.c.session.state_of(d_req) is LS.RESOLVING:
            self.loads[d_req]["release_only"] = True  # nothing allocated yet: never reported
        self.feed(AbortRequested(d_req))

    @rule(dt=st.sampled_from((1.0, 30.0, DEADLINE + 1, 300.0, RECEIVE + 1)))
    def wait(self, dt: float) -> None:
        self.check(self.c.advance(self.c.now + dt))

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def books_agree(self) -> None:
        s = getattr(self, "c", None)
        if s is None:
            return
        assert s.session.open_pulls == len(self.open)
        for d_req, before in self.states.items():
            after = s.session.state_of(d_req)
            assert load_move_ok(before, after), (d_req, before, after)
            self.states[d_req] = after
            info = self.loads[d_req]
            if after in (LS.PULLING, LS.RESOLVING):
                assert info["report"] is None

    def teardown(self) -> None:
        if not hasattr(self, "c"):
            return
        for engine in sorted(self.queried):  # every query gets an answer in the end
            self.queried.discard(engine)
            self.feed(EngineResolved(engine, self.entries[engine]))
        for _ in range(5):
            self.check(self.c.advance(self.c.now + DEADLINE + 3 * RECEIVE))
            if self.c.session.next_deadline() is None:
                break
        s = self.c.session
        assert (s.loading, s.open_pulls, s.next_deadline()) == (0, 0, None)
        for d_req, info in self.loads.items():
            if info["release_only"]:
                assert info["report"] is None, d_req
                continue
            report = info["report"]
            assert isinstance(report, RequestLoaded | RequestFailed), (d_req, info)
            needs_release = isinstance(report, RequestFailed) and not report.blocks_free
            assert info["released"] is needs_release, (d_req, info)


ConsumerMachine.TestCase.settings = MACHINE_SETTINGS
test_consumer_machine = ConsumerMachine.TestCase
