"""Faults with real processes' parts: the agents of ``test_agents`` with short timers, and peers
that never answer, vanish mid-transfer, restart elsewhere or are late (spec §6, §10.9-10.11).

Every case ends with every request in a terminal state within a bounded time and no block
leaked: P reports ``on_free`` for every request it finished; D reports ``on_loaded`` or
``on_failed`` (and ``on_released`` when ``blocks_free`` was False) for every load. Waits are
driven by the agents' callbacks and by a watch on P's session; nothing sleeps.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import pytest
import zmq

from pdwire.consumer import ConsumerSession
from pdwire.events import FreeReason, LoadRequest
from pdwire.messages import ErrorCode
from pdwire.producer import ProducerConfig, ProducerSession
from pdwire.transitions import TransferState
from pdwire.versions import ALL_CAPS, LEGACY, PDWIRE_2, Capability, Profile
from reference_connector.bootstrap import BootstrapServer
from reference_connector.consumer_agent import ConsumerAgent
from reference_connector.producer_agent import AgentStartError, ProducerAgent
from reference_connector.transport import MooncakeTransport

from .test_agents import (
    FP,
    WAIT,
    Cluster,
    DWorker,
    Inbox,
    Memories,
    Memory,
    PWorker,
    Req,
    heads_of,
    kv_tensor,
    pattern,
    side_at,
)
from .test_agents import memories as memories  # the module's transfer engines

logger = logging.getLogger(__name__)
SessionT = TypeVar("SessionT", ProducerSession, ConsumerSession)

NO_DEADLINE_CAP = ALL_CAPS - {Capability.DEADLINE.value}
SLACK = 3.0  # how late past its timer a verdict may come on a loaded machine (2 cores, 4 runs)


# -- helpers ---------------------------------------------------------------------------------


class FaultCluster(Cluster):
    """``Cluster`` whose D workers also take ``receive_timeout``, and can gain more D workers
    (each a ``ConsumerAgent`` on a ``Memory`` of the caller's)."""

    def _start_consumer(self, rank: int) -> None:
        self.consumers.append(self.consumer_on(self.memories.get("D", self.d_tp, rank), rank))

    def consumer_on(self, memory: Memory, rank: int = 0) -> DWorker:
        w = DWorker(memory, heads_of(self.d_tp, rank), Inbox())
        w.kv.zero_()
        config = ConsumerAgent.config_for(
            memory.transport,
            side_at(self.d_tp, rank, memory.base),
            profile=self.profile,
            fingerprint=FP if self.v2 else None,
            layout_id=(2 * rank + 1) << 8 | 1,
            deadline=self.options.get("deadline", 60.0),
            receive_timeout=self.options.get("receive_timeout", 540.0),
        )
        w.agent = ConsumerAgent(
            config,
            memory.transport,
            on_loaded=lambda d_req, _s: w.inbox.put(f"loaded:{d_req}"),
            on_failed=lambda d_req, code, why, free: w.inbox.put(
                f"failed:{d_req}", code, why, free
            ),
            on_released=lambda d_req: w.inbox.put(f"released:{d_req}"),
        )
        w.agent.start()
        return w

    def resolve(self, d: DWorker, watch: SessionWatch[ConsumerSession]) -> None:
        """Have D worker ``d`` learn P's workers from the bootstrap server through a request P
        serves (or that fails at D's deadline), so that a later request's deadline is spent at
        P and not on the query: a loaded machine has held the query past a 0.4 s deadline."""
        r = self.new_request()
        self.started([r])
        self.finished([r])
        load_on(self, d, r)
        assert watch.wait(lambda s: s.knows_engine(self.engine_id) and s.loading == 0, WAIT)

    def p_config(self, w: PWorker, rank: int = 0) -> ProducerConfig:
        return ProducerConfig(
            side=side_at(self.p_tp, rank, w.memory.base),
            profile=self.profile,
            fingerprint=FP if self.v2 else None,
            abort_timeout=self.options.get("abort_timeout", 480.0),
            caps=self.options.get("p_caps", ALL_CAPS),
        )


def load_on(
    c: Cluster,
    d: DWorker,
    r: Req,
    *,
    engine_id: str | None = None,
    url: str | None = None,
    deadline_ms: int = 0,
) -> float:
    """D worker ``d`` loads ``r`` (within ``deadline_ms``, else D's own deadline); returns when
    it was asked."""
    assert d.agent is not None
    d.kv[:, :, r.d_blocks] = 0
    t0 = time.perf_counter()
    request = LoadRequest(
        r.d_req,
        r.transfer_id,
        engine_id or c.engine_id,
        url or c.server.url,
        [r.d_blocks],
        deadline_ms,
    )
    d.agent.load([request])
    return t0


def d_fails(d: DWorker, r: Req, timeout: float = WAIT) -> tuple[float, ErrorCode, str, bool]:
    """Wait for ``r``'s ``on_failed`` and, when it held the blocks, its ``on_released``: the
    load is then over. Returns (time of on_failed, code, reason, blocks_free)."""
    key = f"failed:{r.d_req}"
    arrived, (code, reason, free) = d.inbox.wait([key], timeout)[key]
    if not free:
        d.inbox.wait([f"released:{r.d_req}"], timeout)
    assert f"loaded:{r.d_req}" not in d.inbox.reported()
    return arrived, code, reason, free


def p_frees(w: PWorker, r: Req, reasons: set[FreeReason], timeout: float = WAIT) -> FreeReason:
    """Wait until P freed ``r``'s blocks for one of ``reasons``, and only once."""
    keys = {f"{reason}:{r.p_req}": reason for reason in FreeReason}
    with w.inbox._cond:
        if not w.inbox._cond.wait_for(lambda: bool(keys.keys() & w.inbox._items), timeout):
            raise AssertionError(f"P did not free {r.p_req} within {timeout}s")
        freed = [keys[k] for k in keys.keys() & w.inbox._items]
        assert len(freed) == 1 and len(w.inbox._items[f"{freed[0]}:{r.p_req}"]) == 1, freed
    assert freed[0] in reasons, freed
    return freed[0]


class SessionWatch(Generic[SessionT]):
    """Notifies a condition after each event an agent's session handled (timers included), so
    a test waits for a state of the session instead of sleeping. The agent acts on the outputs
    right after, so a state seen here may be a moment ahead of the sockets."""

    def __init__(self, session: SessionT) -> None:
        self.session: SessionT = session
        self._cond = threading.Condition()
        handle: Callable[[Any, float], list[Any]] = session.handle

        def watched(event: Any, now: float) -> list[Any]:
            out = handle(event, now)
            with self._cond:
                self._cond.notify_all()
            return out

        setattr(session, "handle", watched)  # noqa: B010 (mypy: no method assignment)

    def wait(self, predicate: Callable[[SessionT], bool], timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.session), timeout)


def watch_p(w: PWorker) -> SessionWatch[ProducerSession]:
    assert w.agent is not None
    return SessionWatch(w.agent._session)


def watch_d(w: DWorker) -> SessionWatch[ConsumerSession]:
    assert w.agent is not None
    return SessionWatch(w.agent._session)


def no_pulls(session: ProducerSession | ConsumerSession) -> bool:
    return session.open_pulls == 0


@pytest.fixture
def make_cluster(memories: Memories) -> Iterator[Callable[..., FaultCluster]]:
    made: list[FaultCluster] = []

    def make(profile: Profile = PDWIRE_2, **options: Any) -> FaultCluster:
        cluster = FaultCluster(memories, profile, 1, 1, **options)
        made.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


# -- 1. a transfer P never starts ------------------------------------------------------------


def test_unknown_transfer_v2_fails_at_deadline_and_p_forgets_it(
    make_cluster: Callable[..., FaultCluster],
) -> None:
    """pdwire/2: D's deadline fails the load with its blocks held; the cancel releases them
    (P answers for the placeholder it holds); P's placeholder expires, then is forgotten."""
    deadline, abort = 0.4, 0.8
    c = make_cluster(PDWIRE_2, deadline=deadline, abort_timeout=abort, p_caps=NO_DEADLINE_CAP)
    p, d = c.producers[0], c.consumers[0]
    assert p.agent is not None
    watch = watch_p(p)
    d_watch = watch_d(d)
    c.resolve(d, d_watch)
    r = c.new_request()
    t0 = load_on(c, d, r)
    arrived, code, _, free = d_fails(d, r)
    assert code == ErrorCode.DEADLINE_EXCEEDED and not free
    assert deadline <= arrived - t0 < deadline + SLACK
    assert watch.wait(lambda s: s.state_of(r.transfer_id) is not None, WAIT)
    # placeholder -> expired after abort_timeout -> forgotten after another one
    assert watch.wait(lambda s: s.state_of(r.transfer_id) is None, 2 * abort + WAIT)
    assert watch.session.open_pulls == 0 and watch.session.blocks_held == 0
    assert not [k for k in p.inbox.reported() if k.endswith(f":{r.p_req}")]  # P had no blocks
    assert d_watch.wait(no_pulls)


def test_unknown_transfer_legacy_fails_at_receive_timeout(
    make_cluster: Callable[..., FaultCluster],
) -> None:
    """Legacy: no deadline; D gives up when the pull's receive timeout passes, blocks free."""
    receive = 0.6
    c = make_cluster(LEGACY, receive_timeout=receive, abort_timeout=30.0)
    d = c.consumers[0]
    d_watch = watch_d(d)
    r = c.new_request()
    t0 = load_on(c, d, r)
    arrived, code, reason, free = d_fails(d, r)
    assert code == ErrorCode.DEADLINE_EXCEEDED and free, reason
    assert receive <= arrived - t0 < receive + SLACK
    assert d_watch.wait(no_pulls)
    assert not c.producers[0].inbox.reported()


# -- 2. D disappears mid-transfer ------------------------------------------------------------


@pytest.mark.parametrize("profile", [PDWIRE_2, LEGACY])
def test_d_gone_mid_transfer_p_frees_and_keeps_serving(
    make_cluster: Callable[..., FaultCluster], profile: Profile
) -> None:
    """P's pull is waiting for the prefill when its D stops and its transfer engine goes away.
    P's write then fails (or lands in memory no one reads), its reply to the dead DEALER is
    dropped, and the blocks are freed (served, or expired after abort_timeout). A new D on
    another transfer engine then loads from the same P."""
    # P's ready wait is abort_timeout too, and must outlast stopping D's engine (about 1 s),
    # so that the pull is still waiting when the transfer finishes and P does write.
    abort = 3.0
    c = make_cluster(profile, abort_timeout=abort)
    p = c.producers[0]
    assert p.agent is not None
    watch = watch_p(p)
    doomed_transport = MooncakeTransport()
    doomed_kv = kv_tensor(1)  # outlives the engine: a late write must land in live memory
    doomed = c.consumer_on(
        Memory(doomed_transport, doomed_kv, doomed_transport.register(doomed_kv))
    )
    try:
        r = c.new_request()
        c.started([r])
        before = c.pull_counts()
        load_on(c, doomed, r)
        c.wait_pulls(before)
        assert doomed.agent is not None
        doomed.agent.stop()
        doomed_transport.close()
        doomed.agent = None
        del doomed_transport
        gc.collect()
        writes = p.agent.writes
        t0 = time.perf_counter()
        c.finished([r])
        reason = p_frees(p, r, {FreeReason.SERVED, FreeReason.EXPIRED}, abort + WAIT)
        freed_after = time.perf_counter() - t0
        # P tries the write once; it may find the pull expired first, when stopping D's engine
        # outlasted P's ready wait
        tried = p.agent.writes - writes
        assert tried == 1 if reason is FreeReason.SERVED else tried in (0, 1)
        assert watch.wait(lambda s: s.open_pulls == 0 and s.blocks_held == 0, WAIT)
        assert not doomed.inbox.reported()  # a stopped agent reports nothing
        logger.info("%s: D gone, P freed %s after %.2fs", profile, reason, freed_after)
        # P keeps serving: a new D, on another transfer engine
        fresh = c.consumers[0]
        r2 = c.new_request()
        c.started([r2])
        c.finished([r2])
        load_on(c, fresh, r2)
        c.wait_loaded([r2])
        c.check_bytes([r2])
    finally:
        if doomed.agent is not None:
            doomed.agent.stop()
    del doomed_kv


# -- 3. P restarts under the same engine id --------------------------------------------------


def test_p_restart_old_d_fails_in_bounded_time_fresh_d_loads(
    make_cluster: Callable[..., FaultCluster],
) -> None:
    """P serves, stops, and comes back under the same engine id at a new address. The old
    server refuses that (the ranks are registered elsewhere: HTTP 400), so the restarted P
    registers at a fresh server. A D that cached the old entry pulls the dead address: its
    deadline fails the load in bounded time, and its receive timeout releases the blocks (the
    cancel goes to the dead address too). A fresh D that asks the new server loads."""
    deadline, receive, abort = 0.5, 1.5, 1.0
    c = make_cluster(PDWIRE_2, deadline=deadline, receive_timeout=receive, abort_timeout=abort)
    old_p, d = c.producers[0], c.consumers[0]
    assert old_p.agent is not None and d.agent is not None
    r1 = c.new_request()
    c.started([r1])
    c.finished([r1])
    # Only r2 is held to D's short deadline: a first load under a loaded machine can take longer.
    load_on(c, d, r1, deadline_ms=int(WAIT * 1000))
    c.wait_loaded([r1])
    old_addr = old_p.agent.address
    old_p.agent.stop()

    new_p = PWorker(old_p.memory, Inbox())
    # 4.1-R6 on the old server: same ranks, new address
    refused = c.producer_agent(c.p_config(new_p), new_p)
    with pytest.raises(AgentStartError, match="HTTP 400"):
        refused.start(timeout=WAIT)
    server2 = BootstrapServer()
    fresh: ConsumerAgent | None = None
    try:
        server2.start()
        new_p.agent = ProducerAgent(
            c.p_config(new_p),
            new_p.transport,
            bootstrap_url=server2.url,
            engine_id=c.engine_id,
            on_free=lambda p_req, tid, reason: new_p.inbox.put(f"{reason}:{p_req}", tid),
            on_reject=lambda *a: new_p.inbox.put("reject", *a),
        )
        new_p.agent.start(timeout=WAIT)
        assert new_p.agent.address != old_addr
        c.producers.append(new_p)

        # the old D: cached entry, dead address
        r2 = c.new_request()
        new_p.agent.transfer_started(r2.transfer_id, r2.p_req)
        new_p.agent.transfer_finished(r2.transfer_id, r2.p_req, [r2.p_blocks])
        t0 = load_on(c, d, r2, url=server2.url)
        arrived, code, _, free = d_fails(d, r2, receive + WAIT)
        released = time.perf_counter() - t0
        assert code == ErrorCode.DEADLINE_EXCEEDED and not free
        assert deadline <= arrived - t0 < deadline + SLACK
        assert released < deadline + receive + SLACK
        logger.info("old D: failed after %.2fs, released after %.2fs", arrived - t0, released)
        assert new_p.agent.pulls_received == 0
        # nobody pulled r2 from the restarted P: it expires there
        p_frees(new_p, r2, {FreeReason.EXPIRED}, abort + WAIT)

        # a fresh D asks the new server and loads from the restarted P
        d.agent.stop()
        d.agent = None
        fresh_d = c.consumer_on(d.memory)
        fresh = fresh_d.agent
        r3 = c.new_request()
        new_p.agent.transfer_started(r3.transfer_id, r3.p_req)
        new_p.agent.transfer_finished(r3.transfer_id, r3.p_req, [r3.p_blocks])
        load_on(c, fresh_d, r3, url=server2.url, deadline_ms=int(WAIT * 1000))
        fresh_d.inbox.wait([f"loaded:{r3.d_req}"])
        p_frees(new_p, r3, {FreeReason.SERVED})
        src = r3.p_blocks[len(r3.p_blocks) - len(r3.d_blocks) :]
        assert fresh_d.kv[:, :, r3.d_blocks].equal(pattern(src, fresh_d.heads))
    finally:
        if fresh is not None:
            fresh.stop()
        if new_p.agent is not None:
            new_p.agent.stop()
        server2.stop()


# -- 4. a conflicting registration -----------------------------------------------------------


def test_conflicting_register_fails_to_start_and_leaves_nothing(
    make_cluster: Callable[..., FaultCluster],
) -> None:
    c = make_cluster(PDWIRE_2)
    w = c.producers[0]
    assert w.agent is not None
    intruder_w = PWorker(c.memories.get("P", 1, 0), Inbox())
    intruder = c.producer_agent(c.p_config(intruder_w), intruder_w)
    try:
        with pytest.raises(AgentStartError) as info:
            intruder.start(timeout=WAIT)
        message = str(info.value)
        assert "HTTP 400" in message and "is already registered at" in message, message
        assert w.agent.address in message
        # nothing left running: no loop thread, no sender pool, the port is free again
        assert not intruder._thread.alive
        assert intruder._executor._shutdown
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(intruder.address)
            sock.close(linger=0)
        finally:
            ctx.term()
        entry = c.server.app.state.registry.query().root[0]
        assert entry.worker_addr == {0: {0: w.agent.address}}
    finally:
        intruder.stop()
    # the registered P keeps serving
    r = c.new_request()
    c.started([r])
    c.finished([r])
    c.load([r])
    c.wait_loaded([r])


# -- 5. a slow P -----------------------------------------------------------------------------


def test_slow_p_v2_past_d_deadline(make_cluster: Callable[..., FaultCluster]) -> None:
    """pdwire/2, both sides honour the deadline (so they race): D's load fails by its deadline,
    P's late prefill then frees the blocks (cancelled if D's cancel won, else expired)."""
    deadline, abort = 0.4, 1.0
    c = make_cluster(PDWIRE_2, deadline=deadline, abort_timeout=abort)
    p, d = c.producers[0], c.consumers[0]
    assert p.agent is not None
    watch = watch_p(p)
    d_watch = watch_d(d)
    c.resolve(d, d_watch)
    r = c.new_request()
    c.started([r])
    before = c.pull_counts()
    t0 = load_on(c, d, r)
    c.wait_pulls(before)
    arrived, code, _, free = d_fails(d, r)
    assert code == ErrorCode.DEADLINE_EXCEEDED
    assert deadline <= arrived - t0 < deadline + SLACK
    c.finished([r])  # the prefill ends late
    reason = p_frees(p, r, {FreeReason.CANCELLED, FreeReason.EXPIRED}, abort + WAIT)
    logger.info("pdwire/2 slow P: D blocks_free=%s, P freed %s", free, reason)
    assert watch.wait(lambda s: s.open_pulls == 0 and s.blocks_held == 0, WAIT)
    assert d_watch.wait(no_pulls)


def test_slow_p_legacy_past_ready_wait(make_cluster: Callable[..., FaultCluster]) -> None:
    """Legacy: P's ready wait (abort_timeout) ends the pull with an error; D fails with its
    blocks free; the late prefill's blocks expire after abort_timeout."""
    abort = 0.6
    c = make_cluster(LEGACY, abort_timeout=abort, receive_timeout=30.0)
    p, d = c.producers[0], c.consumers[0]
    assert p.agent is not None
    watch = watch_p(p)
    r = c.new_request()
    c.started([r])
    before = c.pull_counts()
    t0 = load_on(c, d, r)
    c.wait_pulls(before)
    arrived, code, reason, free = d_fails(d, r)
    assert free and code == ErrorCode.INTERNAL, reason
    assert abort <= arrived - t0 < abort + SLACK
    late = time.perf_counter()
    c.finished([r])
    p_frees(p, r, {FreeReason.EXPIRED}, abort + WAIT)
    assert abort <= time.perf_counter() - late < abort + SLACK
    assert watch.wait(lambda s: s.open_pulls == 0 and s.blocks_held == 0, WAIT)
    assert watch.session.state_of(r.transfer_id) in (TransferState.EXPIRED, None)
    assert p.agent.writes == 0
