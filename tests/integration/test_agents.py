"""The producer and consumer agents end to end, in one process, with real parts: the Mooncake
transfer engine over loopback TCP, ZMQ sockets, a uvicorn bootstrap server and torch tensors.

Each P and D worker has its own transfer engine and one KV tensor laid out as
``Geometry.side`` lays out its regions (layer, K/V, block, head, token, channel); the regions'
base addresses are addresses inside that tensor. P's tensors hold a pattern of (layer, K/V,
head, token, channel), so D's blocks can be checked byte for byte after a load. Every wait is
bounded and driven by the agents' callbacks; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from pdwire import decode_response
from pdwire.events import FreeReason, LoadRequest, RequestQueued
from pdwire.messages import ErrorCode, XferResponseStatus
from pdwire.planning import Side, target_ranks
from pdwire.producer import ProducerConfig
from pdwire.sim.geometry import Geometry
from pdwire.versions import ALL_CAPS, LEGACY, PDWIRE_2, Capability, Profile
from reference_connector.bootstrap import BootstrapServer
from reference_connector.consumer_agent import ConsumerAgent
from reference_connector.producer_agent import AgentStartError, ProducerAgent
from reference_connector.transport import MooncakeTransport, TransportUnavailable

logger = logging.getLogger(__name__)

GEOM = Geometry(
    num_layers=4, num_kv_heads=8, head_dim=16, block_size=4, dtype_bytes=2, num_blocks=32
)
FP = GEOM.fingerprint("tiny")
WAIT = 10.0  # seconds any single wait may take before the test fails
SILENCE = 0.3  # how long a socket is watched to show that no reply comes


# -- KV tensors ------------------------------------------------------------------------------


def kv_tensor(tp: int) -> torch.Tensor:
    heads = GEOM.num_kv_heads // tp
    shape = (GEOM.num_layers, 2, GEOM.num_blocks, heads, GEOM.block_size, GEOM.head_dim)
    return torch.zeros(shape, dtype=torch.bfloat16)


def heads_of(tp: int, rank: int) -> range:
    per = GEOM.num_kv_heads // tp
    return range(rank * per, (rank + 1) * per)


def pattern(blocks: Sequence[int], heads: range) -> torch.Tensor:
    """P's KV for ``blocks`` and global ``heads``: integers < 251, exact in bf16."""
    g = GEOM
    layer = torch.arange(g.num_layers).view(-1, 1, 1, 1, 1, 1)
    kv = torch.arange(2).view(1, -1, 1, 1, 1, 1)
    block = torch.tensor(list(blocks)).view(1, 1, -1, 1, 1, 1)
    head = torch.tensor(list(heads)).view(1, 1, 1, -1, 1, 1)
    slot = torch.arange(g.block_size).view(1, 1, 1, 1, -1, 1)
    channel = torch.arange(g.head_dim).view(1, 1, 1, 1, 1, -1)
    token = block * g.block_size + slot
    value = (layer * 31 + kv * 17 + head * 7 + token * 3 + channel) % 251
    return value.to(torch.bfloat16)


def side_at(tp: int, rank: int, base: int) -> Side:
    """``Geometry.side``'s regions, moved into the tensor registered at ``base``."""
    side = GEOM.side(tp, rank, 1, 0, worker=0)
    origin = side.regions[0].base_addr
    regions = tuple(
        dataclasses.replace(r, base_addr=base + r.base_addr - origin) for r in side.regions
    )
    return dataclasses.replace(side, regions=regions)


# -- what the callbacks report ---------------------------------------------------------------


class Inbox:
    """Callback reports by key ("loaded:d-1", "served:p-1", ...), each with its arrival time."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[str, list[tuple[float, tuple[Any, ...]]]] = {}

    def put(self, key: str, *payload: Any) -> None:
        with self._cond:
            self._items.setdefault(key, []).append((time.perf_counter(), payload))
            self._cond.notify_all()

    def wait(self, keys: Sequence[str], timeout: float = WAIT) -> dict[str, tuple[float, tuple]]:
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._items for k in keys), timeout):
                missing = [k for k in keys if k not in self._items]
                raise AssertionError(f"no report for {missing} within {timeout}s: {self._items}")
            return {k: self._items[k][0] for k in keys}

    def reported(self) -> set[str]:
        with self._cond:
            return set(self._items)


@dataclasses.dataclass
class Memory:
    """One worker's transfer engine and its registered KV tensor."""

    transport: MooncakeTransport
    kv: torch.Tensor
    base: int


class Memories:
    """The module's transfer engines, one per (side, TP size, rank), made on first use and
    shared by the clusters of every test: a Mooncake engine takes about a second to shut down.
    Each cluster stops its agents, and so every write, before the next one starts."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, int, int], Memory] = {}

    def get(self, side: str, tp: int, rank: int) -> Memory:
        key = (side, tp, rank)
        if key not in self._made:
            transport = MooncakeTransport()
            kv = kv_tensor(tp)
            self._made[key] = Memory(transport, kv, transport.register(kv))
        return self._made[key]

    def close(self) -> None:
        for memory in self._made.values():
            memory.transport.close()


@dataclasses.dataclass
class PWorker:
    memory: Memory
    inbox: Inbox
    agent: ProducerAgent | None = None

    @property
    def transport(self) -> MooncakeTransport:
        return self.memory.transport


@dataclasses.dataclass
class DWorker:
    memory: Memory
    heads: range
    inbox: Inbox
    agent: ConsumerAgent | None = None

    @property
    def kv(self) -> torch.Tensor:
        return self.memory.kv


@dataclasses.dataclass
class Req:
    n: int
    transfer_id: str
    p_blocks: list[int]
    d_blocks: list[int]

    @property
    def p_req(self) -> str:
        return f"p-{self.n}"

    @property
    def d_req(self) -> str:
        return f"d-{self.n}"


# -- the cluster -----------------------------------------------------------------------------


class Cluster:
    """One P engine of TP ``p_tp`` and one D instance of TP ``d_tp``, with their bootstrap."""

    def __init__(
        self, memories: Memories, profile: Profile, p_tp: int, d_tp: int, **options: Any
    ) -> None:
        self.memories = memories
        self.profile, self.p_tp, self.d_tp = profile, p_tp, d_tp
        self.options = options
        self.engine_id = f"engine-{uuid.uuid4().hex[:8]}"
        self.server = BootstrapServer()
        self.producers: list[PWorker] = []
        self.consumers: list[DWorker] = []
        self._rng = random.Random(p_tp * 10 + d_tp)
        # D blocks are handed out round-robin: no two requests in flight share one.
        self._d_blocks = collections.deque(
            self._rng.sample(range(GEOM.num_blocks), GEOM.num_blocks)
        )
        self._count = 0

    @property
    def v2(self) -> bool:
        return self.profile == PDWIRE_2

    def start(self) -> Cluster:
        self.server.start()
        for rank in range(self.p_tp):
            self._start_producer(rank)
        for rank in range(self.d_tp):
            self._start_consumer(rank)
        return self

    def _start_producer(self, rank: int) -> None:
        w = PWorker(self.memories.get("P", self.p_tp, rank), Inbox())
        self.producers.append(w)
        w.memory.kv.copy_(pattern(range(GEOM.num_blocks), heads_of(self.p_tp, rank)))
        config = ProducerConfig(
            side=side_at(self.p_tp, rank, w.memory.base),
            profile=self.profile,
            fingerprint=FP if self.v2 else None,
            abort_timeout=self.options.get("abort_timeout", 480.0),
            lease=self.options.get("p_lease", self.options.get("lease")),
            caps=self.options.get("p_caps", ALL_CAPS),
        )
        w.agent = self.producer_agent(config, w)
        w.agent.start()

    def producer_agent(self, config: ProducerConfig, w: PWorker, **kw: Any) -> ProducerAgent:
        return ProducerAgent(
            config,
            w.transport,
            bootstrap_url=self.server.url,
            engine_id=self.engine_id,
            tp_rank=config.side.tp_rank,
            on_free=lambda p_req, tid, reason: w.inbox.put(f"{reason}:{p_req}", tid),
            on_reject=lambda p_req, tid, code, msg: w.inbox.put(f"reject:{p_req}", code, msg),
            **kw,
        )

    def _start_consumer(self, rank: int) -> None:
        w = DWorker(self.memories.get("D", self.d_tp, rank), heads_of(self.d_tp, rank), Inbox())
        self.consumers.append(w)
        w.kv.zero_()
        config = ConsumerAgent.config_for(
            w.memory.transport,
            side_at(self.d_tp, rank, w.memory.base),
            profile=self.profile,
            fingerprint=FP if self.v2 else None,
            layout_id=(2 * rank + 1) << 8 | 1,
            deadline=self.options.get("deadline", 60.0),
            lease=self.options.get("lease"),
        )
        w.agent = ConsumerAgent(
            config,
            w.memory.transport,
            on_loaded=lambda d_req, _s: w.inbox.put(f"loaded:{d_req}"),
            on_failed=lambda d_req, code, why, free: w.inbox.put(
                f"failed:{d_req}", code, why, free
            ),
            on_released=lambda d_req: w.inbox.put(f"released:{d_req}"),
        )
        w.agent.start()

    def stop(self) -> None:
        for worker in [*self.consumers, *self.producers]:
            if worker.agent is not None:
                worker.agent.stop()
        self.server.stop()

    # -- requests ----------------------------------------------------------------------------

    def new_request(self, nblocks: int = 3, p_extra: int = 0) -> Req:
        """A request of ``nblocks`` D blocks; P holds ``p_extra`` more (D had a prefix)."""
        self._count += 1
        p_blocks = self._rng.sample(range(GEOM.num_blocks), nblocks + p_extra)
        d_blocks = [self._d_blocks.popleft() for _ in range(nblocks)]
        self._d_blocks.extend(d_blocks)
        for d in self.consumers:
            d.kv[:, :, d_blocks] = 0
        return Req(self._count, f"xfer-{uuid.uuid4()}", p_blocks, d_blocks)

    def agents_p(self) -> list[ProducerAgent]:
        return [w.agent for w in self.producers if w.agent is not None]

    def started(self, reqs: Sequence[Req]) -> None:
        for agent in self.agents_p():
            for r in reqs:
                agent.transfer_started(r.transfer_id, r.p_req)

    def finished(self, reqs: Sequence[Req]) -> None:
        for agent in self.agents_p():
            for r in reqs:
                agent.transfer_finished(r.transfer_id, r.p_req, [r.p_blocks])

    def queue(self, reqs: Sequence[Req]) -> None:
        """D received ``reqs``, which wait in its queue before their loads."""
        for d in self.consumers:
            assert d.agent is not None
            for r in reqs:
                d.agent.queue(
                    RequestQueued(r.d_req, r.transfer_id, self.engine_id, self.server.url)
                )

    def load(self, reqs: Sequence[Req], engine_id: str | None = None) -> None:
        for d in self.consumers:
            assert d.agent is not None
            d.agent.load(
                [
                    LoadRequest(
                        r.d_req,
                        r.transfer_id,
                        engine_id or self.engine_id,
                        self.server.url,
                        [r.d_blocks],
                    )
                    for r in reqs
                ]
            )

    def pull_counts(self) -> list[int]:
        return [a.pulls_received for a in self.agents_p()]

    def wait_pulls(self, before: Sequence[int], batches: int = 1) -> None:
        """Wait until every P worker received the pulls of ``batches`` more load batches."""
        for rank, (agent, seen) in enumerate(zip(self.agents_p(), before, strict=True)):
            per_batch = len(target_ranks(self.p_tp, rank, self.d_tp))
            assert agent.wait_pulls(seen + per_batch * batches, WAIT), "pull did not arrive"

    def wait_loaded(self, reqs: Sequence[Req]) -> None:
        for d in self.consumers:
            d.inbox.wait([f"loaded:{r.d_req}" for r in reqs])
            assert not any(k.startswith("failed:") for k in d.inbox.reported())
        for p in self.producers:
            p.inbox.wait([f"{FreeReason.SERVED}:{r.p_req}" for r in reqs])

    def check_bytes(self, reqs: Sequence[Req]) -> None:
        for d in self.consumers:
            for r in reqs:
                src = r.p_blocks[len(r.p_blocks) - len(r.d_blocks) :]
                assert torch.equal(d.kv[:, :, r.d_blocks], pattern(src, d.heads)), r


@pytest.fixture(scope="module")
def memories() -> Iterator[Memories]:
    made = Memories()
    try:
        made.get("P", 1, 0)
    except TransportUnavailable as exc:
        pytest.skip(f"Mooncake transfer engine unavailable: {exc}")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def make_cluster(memories: Memories) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(profile: Profile = PDWIRE_2, p_tp: int = 1, d_tp: int = 1, **options: Any) -> Cluster:
        cluster = Cluster(memories, profile, p_tp, d_tp, **options)
        made.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


# -- transfers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "p_tp", "d_tp"),
    [(PDWIRE_2, 1, 1), (LEGACY, 1, 1), (PDWIRE_2, 2, 1), (PDWIRE_2, 1, 2), (LEGACY, 2, 1)],
)
def test_pull_before_ready_loads_every_d_rank(
    make_cluster: Callable[..., Cluster], profile: Profile, p_tp: int, d_tp: int
) -> None:
    """P admits, D pulls, then P finishes: every D rank gets its heads' bytes, every P rank
    frees as served. A batch of three in one pull, then two single pulls (layout omitted)."""
    c = make_cluster(profile, p_tp, d_tp)
    batch = [c.new_request(), c.new_request(p_extra=1), c.new_request(nblocks=1)]
    singles = [[c.new_request()], [c.new_request(nblocks=5, p_extra=2)]]
    for reqs in [batch, *singles]:
        c.started(reqs)
        before = c.pull_counts()
        c.load(reqs)
        c.wait_pulls(before)
        c.finished(reqs)
        c.wait_loaded(reqs)
        c.check_bytes(reqs)
    for p in c.agents_p():
        assert p.writes >= 3 and p.bytes_written > 0


@pytest.mark.parametrize("profile", [PDWIRE_2, LEGACY])
def test_round_trip_of_a_ready_request(
    make_cluster: Callable[..., Cluster], profile: Profile
) -> None:
    """P ready first: the time from D's load to on_loaded is one pull's round trip."""
    c = make_cluster(profile)
    warm = c.new_request()
    c.started([warm])
    c.finished([warm])
    c.load([warm])
    c.wait_loaded([warm])  # the engine's entry is cached from here on
    times: list[float] = []
    d = c.consumers[0]
    for _ in range(30):
        r = c.new_request(nblocks=1)
        c.started([r])
        c.finished([r])
        t0 = time.perf_counter()
        c.load([r])
        arrived, _ = d.inbox.wait([f"loaded:{r.d_req}"])[f"loaded:{r.d_req}"]
        times.append(arrived - t0)
        c.check_bytes([r])
    times.sort()
    logger.info(
        "%s 1-request pull, load to on_loaded: median %.0f us, p90 %.0f us, max %.0f us",
        profile,
        statistics.median(times) * 1e6,
        times[int(len(times) * 0.9)] * 1e6,
        times[-1] * 1e6,
    )


def test_a_pull_goes_on_a_dealer_connected_ahead_of_it(
    make_cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its first pull to a P worker, D keeps one new DEALER connected to that address and
    sends the next message there on it: a pull opens no socket on its way, only the next spare
    after it. Beyond SPARE_ADDRS addresses the least recently used one's spare is closed, and
    one unused for SPARE_IDLE_S is closed too."""
    c = make_cluster(PDWIRE_2)
    agent = c.consumers[0].agent
    assert agent is not None
    opened: list[str] = []
    dealer = ConsumerAgent._dealer

    def counted(self: ConsumerAgent, addr: str) -> zmq.asyncio.Socket:
        opened.append(addr)
        return dealer(self, addr)

    monkeypatch.setattr(ConsumerAgent, "_dealer", counted)
    p_addr = c.agents_p()[0].address
    spares: list[zmq.asyncio.Socket] = []
    for n in range(3):
        r = c.new_request(nblocks=1)
        c.started([r])
        c.finished([r])
        c.load([r])
        c.wait_loaded([r])
        c.check_bytes([r])
        # the pull's close, then its restock, ran on D's loop before a no-op submitted now
        agent._thread.submit(asyncio.sleep(0)).result(WAIT)
        assert agent.spare_addrs == [p_addr]
        spares.append(agent._spares[p_addr])
        # the first pull opens its own socket and the spare; each later one takes the spare
        # and opens only the next
        assert opened == [p_addr] * (n + 2), opened
    assert len({id(s) for s in spares}) == 3 and spares[0].closed and spares[1].closed
    monkeypatch.setattr("reference_connector.consumer_agent.SPARE_ADDRS", 1)
    elsewhere = "tcp://127.0.0.1:9"  # no P there: the spare only waits, unused
    agent._thread.submit(_restock(agent, elsewhere)).result(WAIT)
    assert agent.spare_addrs == [elsewhere] and spares[-1].closed
    monkeypatch.setattr("reference_connector.consumer_agent.SPARE_ADDRS", 16)
    monkeypatch.setattr("reference_connector.consumer_agent.SPARE_IDLE_S", 0.0)
    agent._thread.submit(_restock(agent, p_addr)).result(WAIT)
    agent._thread.submit(asyncio.sleep(0)).result(WAIT)  # the retirement, due at once, ran
    assert agent.spare_addrs == [elsewhere]  # still within its own 10 s


async def _restock(agent: ConsumerAgent, addr: str) -> None:
    agent._restock(addr)


def test_writes_to_one_d_worker_run_in_turn_and_a_held_one_holds_up_no_other(
    make_cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """P writes to one D worker one batch at a time, and to two side by side: while its first
    write to D rank 0 is held in the engine, the pulls that follow it get no write to rank 0
    started, and D rank 1 loads every request."""
    c = make_cluster(PDWIRE_2, 1, 2)
    transport = c.producers[0].transport
    held_peer = c.consumers[0].memory.transport.session
    held = threading.Event()
    release = threading.Event()
    lock = threading.Lock()
    spans: list[tuple[str, float, float]] = []
    started: collections.Counter[str] = collections.Counter()
    real_write = transport.write

    def write(peer: str, descriptors: Any) -> int:
        t0 = time.perf_counter()
        with lock:
            started[peer] += 1
        if peer == held_peer:
            held.set()
            assert release.wait(WAIT), "the held writes were never released"
        status = real_write(peer, descriptors)
        with lock:
            spans.append((peer, t0, time.perf_counter()))
        return status

    monkeypatch.setattr(transport, "write", write)
    reqs = [c.new_request() for _ in range(3)]
    c.started(reqs)
    c.finished(reqs)
    try:
        for r in reqs:  # a pull each from each D worker, one after another
            before = c.pull_counts()
            c.load([r])
            c.wait_pulls(before)
            c.consumers[1].inbox.wait([f"loaded:{r.d_req}"])
            assert held.wait(WAIT), "no write to D rank 0 started"
        with lock:
            assert started[held_peer] == 1, started
    finally:
        release.set()
    c.wait_loaded(reqs)
    c.check_bytes(reqs)
    with lock:
        for peer in {p for p, _, _ in spans}:
            mine = sorted((t0, t1) for p, t0, t1 in spans if p == peer)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine)), f"{peer} overlapped"


# -- requests P will not send ----------------------------------------------------------------


@pytest.mark.parametrize("profile", [PDWIRE_2, LEGACY])
@pytest.mark.parametrize("pull_first", [True, False])
def test_stop_token_is_answered_at_once(
    make_cluster: Callable[..., Cluster], profile: Profile, pull_first: bool
) -> None:
    """P answers a request it will not send without waiting for its ready timer (480 s here,
    against the inbox's 10 s wait)."""
    c = make_cluster(profile, 2, 1)
    r = c.new_request()
    c.started([r])
    if pull_first:
        before = c.pull_counts()
        c.load([r])
        c.wait_pulls(before)
    for agent in c.agents_p():
        agent.transfer_will_not_send(r.transfer_id, r.p_req, "stop token")
    if not pull_first:
        c.load([r])
    _, (code, reason, blocks_free) = c.consumers[0].inbox.wait([f"failed:{r.d_req}"])[
        f"failed:{r.d_req}"
    ]
    assert blocks_free
    assert code == (ErrorCode.WILL_NOT_SEND if c.v2 else ErrorCode.INTERNAL), reason
    for p in c.producers:
        p.inbox.wait([f"{FreeReason.WILL_NOT_SEND}:{r.p_req}"])


# -- timers (the one re-armed timer of each agent) -------------------------------------------


def test_d_deadline_fails_cancels_and_releases(make_cluster: Callable[..., Cluster]) -> None:
    """pdwire/2: D's deadline fails the request with its blocks held, the cancel releases them,
    and P frees as cancelled once its prefill ends. P does not announce ``deadline``: were it to
    honour deadline_ms, its own timer would race D's cancel (and a cancel that P handles after
    the prefill ended frees the blocks as served)."""
    # The deadline must outlast D's query and pull (else it fails the request before there is a
    # pull to cancel), also on a loaded machine.
    c = make_cluster(PDWIRE_2, deadline=1.5, p_caps=ALL_CAPS - {Capability.DEADLINE.value})
    r = c.new_request()
    c.started([r])
    c.load([r])
    d = c.consumers[0]
    _, (code, _, blocks_free) = d.inbox.wait([f"failed:{r.d_req}"])[f"failed:{r.d_req}"]
    assert code == ErrorCode.DEADLINE_EXCEEDED and not blocks_free
    d.inbox.wait([f"released:{r.d_req}"])
    c.finished([r])
    c.producers[0].inbox.wait([f"{FreeReason.CANCELLED}:{r.p_req}"])


def test_p_expiry_frees_and_answers_a_late_pull(make_cluster: Callable[..., Cluster]) -> None:
    """P keeps an expired transfer's tombstone for its abort timeout: a pull that comes within
    it gets EXPIRED (a timeout long enough for D's query and pull on a loaded machine)."""
    c = make_cluster(PDWIRE_2, abort_timeout=2.0)
    r = c.new_request()
    c.started([r])
    c.finished([r])
    c.producers[0].inbox.wait([f"{FreeReason.EXPIRED}:{r.p_req}"])
    c.load([r])
    _, (code, _, _) = c.consumers[0].inbox.wait([f"failed:{r.d_req}"])[f"failed:{r.d_req}"]
    assert code == ErrorCode.EXPIRED


@pytest.mark.parametrize("profile", [LEGACY, PDWIRE_2])
def test_renewals_keep_a_queued_request_past_its_lease(
    make_cluster: Callable[..., Cluster], profile: Profile
) -> None:
    """§6.4: a request that waits in D's queue for two leases keeps P's blocks, renewed by the
    heartbeats each D worker sends every lease/6, and then loads byte for byte."""
    lease = 1.2
    c = make_cluster(profile, p_tp=2, d_tp=1, lease=lease)
    r = c.new_request()
    c.started([r])
    c.finished([r])
    before = c.pull_counts()
    c.queue([r])
    # Twelve renewals reach each P worker: two leases' worth.
    for agent, seen in zip(c.agents_p(), before, strict=True):
        assert agent.wait_pulls(seen + 12, WAIT), "D sent too few renewals"
    assert not any(k.startswith("expired:") for p in c.producers for k in p.inbox.reported())
    c.load([r])
    c.wait_loaded([r])
    c.check_bytes([r])


def test_without_renewals_the_lease_ends_and_a_late_pull_fails_at_once(
    make_cluster: Callable[..., Cluster],
) -> None:
    """6.4-R1, 6.4-R5: a D without a lease renews nothing; P frees at lease end, and the
    pull that comes later fails at once with vLLM 0.34's message."""
    c = make_cluster(LEGACY, p_lease=1.0)
    r = c.new_request()
    c.started([r])
    c.finished([r])
    c.producers[0].inbox.wait([f"{FreeReason.EXPIRED}:{r.p_req}"])
    c.load([r])
    failed = c.consumers[0].inbox.wait([f"failed:{r.d_req}"])[f"failed:{r.d_req}"]
    assert failed[1][1] == "KV expired on P side before the pull."


# -- bootstrap -------------------------------------------------------------------------------


def test_unknown_engine_fails_the_batch(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(LEGACY)
    r = c.new_request()
    c.load([r], engine_id="no-such-engine")
    _, (_, reason, free) = c.consumers[0].inbox.wait([f"failed:{r.d_req}"])[f"failed:{r.d_req}"]
    assert (
        reason == f"remote engine_id no-such-engine not found from bootstrap server {c.server.url}"
    )
    assert free


def test_failed_registration_raises(make_cluster: Callable[..., Cluster]) -> None:
    """A second worker at the same ranks is refused by the server (4.1-R6)."""
    c = make_cluster()
    w = c.producers[0]
    assert w.agent is not None
    config = ProducerConfig(side=side_at(1, 0, 1 << 40), fingerprint=FP)
    intruder = c.producer_agent(config, w)
    try:
        with pytest.raises(AgentStartError, match="is already registered at"):
            intruder.start(timeout=WAIT)
    finally:
        intruder.stop()


# -- malformed input on P's ROUTER -----------------------------------------------------------


@pytest.fixture
def raw_dealer() -> Iterator[Callable[[str], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []

    def connect(addr: str) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        sockets.append(sock)
        return sock

    try:
        yield connect
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def _reply(sock: zmq.Socket[bytes], timeout: float) -> bytes | None:
    return sock.recv() if sock.poll(int(timeout * 1000)) else None


def _serves(c: Cluster) -> None:
    r = c.new_request()
    c.started([r])
    c.finished([r])
    c.load([r])
    c.wait_loaded([r])
    c.check_bytes([r])


def test_malformed_frame_gets_an_error_and_p_keeps_serving(
    make_cluster: Callable[..., Cluster], raw_dealer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    c = make_cluster()
    p = c.agents_p()[0]
    sock = raw_dealer(p.address)
    sock.send(b"\x00garbage")
    data = _reply(sock, WAIT)
    assert data is not None
    reply = decode_response(data)
    assert reply.status is XferResponseStatus.ERROR
    assert reply.err_msg and "malformed" in reply.err_msg
    _serves(c)


def test_malformed_pdwire2_pull_gets_bad_message_code(
    make_cluster: Callable[..., Cluster], raw_dealer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    """2.4-R2: P can read pdwire_version = 2, so the error carries BAD_MESSAGE."""
    c = make_cluster()
    sock = raw_dealer(c.agents_p()[0].address)
    sock.send(msgspec.msgpack.encode({"pdwire_version": 2, "remote_hostname": 5}))
    data = _reply(sock, WAIT)
    assert data is not None
    reply = decode_response(data)
    assert reply.status is XferResponseStatus.ERROR
    assert reply.err_code == ErrorCode.BAD_MESSAGE


def test_three_frames_are_dropped_and_p_keeps_serving(
    make_cluster: Callable[..., Cluster], raw_dealer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    """3.1-R5: [identity, a, b] gets no reply. The frame sent after it on the same socket gets
    the only reply: ZMQ keeps a pipe's order, so a reply to the first would come first."""
    c = make_cluster()
    p = c.agents_p()[0]
    sock = raw_dealer(p.address)
    sock.send_multipart([b"\x00one", b"\x00two"])
    assert _reply(sock, SILENCE) is None
    sock.send(b"\x00garbage")
    first = _reply(sock, WAIT)
    assert first is not None and decode_response(first).status is XferResponseStatus.ERROR
    assert _reply(sock, SILENCE) is None
    assert p.pulls_received == 1 and p.replies_sent == 1
    _serves(c)
