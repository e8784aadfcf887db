"""One P engine and one D engine of real sessions, talking, with real bytes (spec §10.1-§10.3,
§10.8-§10.10).

Every P worker is a ``ProducerSession`` and every D worker a ``ConsumerSession``; their regions
come from ``pdwire.sim.geometry.Geometry`` and are backed by numpy arrays (``kv_memory``). A tiny
synchronous driver carries the sessions' outputs: pulls and replies as encoded bytes, bootstrap
queries answered with an ``EngineEntry``, and each ``StartWrite`` performed as a memcpy from P's
array into the array of the D worker it names. Afterwards every D byte is compared with the KV
its layers and heads must hold, and each P worker's free is checked against the pulls it served.
Freed P blocks are poisoned, as their reuse would, so a write from them would show in D's bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest

from pdwire.consumer import ConsumerConfig, ConsumerSession
from pdwire.events import (
    BlocksReleased,
    ClosePull,
    ConsumerOutput,
    EngineResolved,
    FreeBlocks,
    FreeReason,
    LoadRequest,
    LoadsRequested,
    MessageReceived,
    ProducerOutput,
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
    WriteCompleted,
)
from pdwire.http_models import EngineEntry
from pdwire.messages import XferMetadata
from pdwire.planning import Side, target_ranks
from pdwire.producer import ProducerConfig, ProducerSession
from pdwire.sim.geometry import Geometry
from pdwire.transitions import TransferState
from pdwire.versions import ALL_CAPS, LEGACY, PDWIRE_2, Profile

from .kv_memory import WorkerMemory, model_kv

GEOMETRY = Geometry(
    num_layers=4, num_kv_heads=8, head_dim=8, block_size=4, dtype_bytes=2, num_blocks=32
)
TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 4)
ENGINE = "p0"
BOOTSTRAP = "http://p0:8998"
STEP = 1e-4  # virtual seconds per delivered event: far below every timer


@dataclasses.dataclass(frozen=True)
class Load:
    """One request: P's block ids, D's (P's last ``len(d_blocks)`` go there)."""

    name: str
    p_blocks: tuple[int, ...]
    d_blocks: tuple[int, ...]

    @property
    def transfer_id(self) -> str:
        return f"xfer-{self.name}"

    @property
    def p_req(self) -> str:
        return f"p-{self.name}"

    @property
    def d_req(self) -> str:
        return f"d-{self.name}"


# A: all of P's blocks, runs broken on both sides and a decreasing step on D. B: a partial prefix
# hit, D loads only P's last 4 of 6 blocks. C: contiguous runs, which coalesce (§10.8.13).
LOAD_A = Load("a", (3, 4, 5, 9, 10, 11, 12, 20), (30, 7, 8, 9, 0, 1, 2, 15))
LOAD_B = Load("b", (0, 1, 30, 31, 7, 8), (20, 21, 22, 5))
LOAD_C = Load("c", (13, 14, 15, 16, 17, 18, 19, 21), (23, 24, 25, 26, 27, 28, 29, 31))
LOADS = (LOAD_A, LOAD_B, LOAD_C)


@dataclasses.dataclass
class PWorker:
    index: int
    tp_rank: int
    pp_rank: int
    addr: str
    session: ProducerSession
    memory: WorkerMemory


@dataclasses.dataclass
class DWorker:
    index: int
    tp_rank: int
    pp_rank: int
    peer: str
    session: ConsumerSession
    memory: WorkerMemory


@dataclasses.dataclass
class Log:
    """What happened, with the step at which it happened (one step per delivered event)."""

    served: list[tuple[int, int, int, str]] = dataclasses.field(default_factory=list)
    frees: list[tuple[int, int, FreeBlocks]] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)  # step, P, d_req
    # D worker, P address, d_req, whether the pull carried D's layout
    pulls: list[tuple[int, str, str, bool]] = dataclasses.field(default_factory=list)
    reports: dict[int, list[ConsumerOutput]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    rejected: list[RejectRequest] = dataclasses.field(default_factory=list)
    late_frames: int = 0


class Cluster:
    """One P engine and one D engine, and the driver between them."""

    def __init__(
        self,
        geometry: Geometry,
        profile: Profile,
        p_tp: int,
        p_pp: int,
        d_tp: int,
        d_pp: int,
    ) -> None:
        self.geometry, self.profile = geometry, profile
        self.p_tp, self.p_pp, self.d_tp, self.d_pp = p_tp, p_pp, d_tp, d_pp
        self.kv = model_kv(geometry)
        fingerprint = None
        if profile == PDWIRE_2:
            fingerprint = geometry.fingerprint("interacting")
        self.fingerprint = fingerprint
        rng = np.random.default_rng(p_tp * 1000 + p_pp * 100 + d_tp * 10 + d_pp)
        self.p: list[PWorker] = []
        for tp, pp in itertools.product(range(p_tp), range(p_pp)):
            index = len(self.p)
            side = geometry.side(p_tp, tp, p_pp, pp, index)
            memory = WorkerMemory.allocate(geometry, side, pp, self._zeros(side))
            memory.fill_from(self.kv)
            p_config = ProducerConfig(side=side, profile=profile, fingerprint=fingerprint)
            addr = f"tcp://p{tp}-{pp}:{6000 + index}"
            self.p.append(PWorker(index, tp, pp, addr, ProducerSession(p_config), memory))
        self.d: list[DWorker] = []
        for tp, pp in itertools.product(range(d_tp), range(d_pp)):
            index = len(self.d)
            side = geometry.side(d_tp, tp, d_pp, pp, 100 + index)
            noise = rng.integers(0, 256, self._zeros(side).size, dtype=np.uint8)
            memory = WorkerMemory.allocate(geometry, side, pp, noise)
            d_config = ConsumerConfig(
                hostname=f"d{index}",
                port=7000 + index,
                side=side,
                pp_rank=pp,
                profile=profile,
                fingerprint=fingerprint,
                layout_id=(index + 1) << 8 | 1,
            )
            peer = f"d{index}:{7000 + index}"
            self.d.append(DWorker(index, tp, pp, peer, ConsumerSession(d_config), memory))
        self.initial_d = [w.memory.mem.copy() for w in self.d]
        # How many times each D byte was written: 1 inside the destination blocks, else 0.
        self.coverage = [np.zeros(w.memory.mem.size, dtype=np.int32) for w in self.d]
        self.p_by_addr = {w.addr: w for w in self.p}
        self.d_by_peer = {w.peer: w for w in self.d}
        self.queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self.closed: set[tuple[int, int]] = set()
        self.log = Log()
        self.step = 0

    def _zeros(self, side: Side) -> np.ndarray[Any, np.dtype[np.uint8]]:
        g = self.geometry
        base = min(r.base_addr for r in side.regions)
        end = max(r.base_addr + r.block_len * g.num_blocks for r in side.regions)
        return np.zeros(end - base, dtype=np.uint8)

    @property
    def now(self) -> float:
        return self.step * STEP

    def entry(self) -> EngineEntry:
        addrs: dict[int, dict[int, str]] = {}
        for w in self.p:
            addrs.setdefault(w.tp_rank, {})[w.pp_rank] = w.addr
        if self.profile == LEGACY:
            return EngineEntry(engine_id=ENGINE, worker_addr=addrs)
        return EngineEntry(
            engine_id=ENGINE,
            worker_addr=addrs,
            pdwire_version=2,
            pdwire_caps=sorted(ALL_CAPS),
            tp_size=self.p_tp,
            pp_size=self.p_pp,
            fingerprint=self.fingerprint,
        )

    # -- feeding ------------------------------------------------------------------------------

    def to_p(self, w: PWorker, event: Any) -> None:
        self._p_out(w, w.session.handle(event, self.now))

    def to_d(self, w: DWorker, event: Any) -> None:
        self._d_out(w, w.session.handle(event, self.now))

    def _p_out(self, w: PWorker, out: list[ProducerOutput]) -> None:
        for o in out:
            if isinstance(o, SendReply):
                d_index, pull_id = map(int, o.identity.decode().split("/"))
                for d_req in o.reply.ok_reqs or ():
                    self.log.served.append((self.step, w.index, d_index, d_req))
                self.queue.append(("d", d_index, ReplyReceived(pull_id, o.data)))
            elif isinstance(o, StartWrite):
                self.queue.append(("write", w.index, o))
            elif isinstance(o, FreeBlocks):
                self.log.frees.append((self.step, w.index, o))
                load = next(x for x in LOADS if x.p_req == o.p_req_id)
                w.memory.poison(load.p_blocks)
            else:
                assert isinstance(o, RejectRequest)
                self.log.rejected.append(o)

    def _d_out(self, w: DWorker, out: list[ConsumerOutput]) -> None:
        for o in out:
            if isinstance(o, SendPull):
                if isinstance(o.message, XferMetadata):
                    layout = bool(o.message.kv_caches_base_addr)
                    for d_req in o.message.req_blocks:
                        self.log.pulls.append((w.index, o.addr, d_req, layout))
                ident = f"{w.index}/{o.pull_id}".encode()
                target = self.p_by_addr[o.addr]
                self.queue.append(("p", target.index, MessageReceived(ident, o.data)))
            elif isinstance(o, QueryBootstrap):
                assert (o.engine_id, o.bootstrap_addr) == (ENGINE, BOOTSTRAP)
                self.queue.append(("d", w.index, EngineResolved(ENGINE, self.entry())))
            elif isinstance(o, ClosePull):
                self.closed.add((w.index, o.pull_id))
            else:
                assert isinstance(o, RequestLoaded | RequestFailed | BlocksReleased)
                self.log.reports[w.index].append(o)

    def _write(self, w: PWorker, o: StartWrite) -> None:
        """Perform the batch write: copy every descriptor from P's memory into D's."""
        d = self.d_by_peer[o.peer]
        src_mem, dst_mem = w.memory, d.memory
        for src, dst, length in zip(
            o.descriptors.src.tolist(),
            o.descriptors.dst.tolist(),
            o.descriptors.length.tolist(),
            strict=True,
        ):
            s, t = src_mem.offset(src, length), dst_mem.offset(dst, length)
            dst_mem.mem[t : t + length] = src_mem.mem[s : s + length]
            self.coverage[d.index][t : t + length] += 1
        for d_req in o.d_req_ids:
            self.log.copies.append((self.step, w.index, d_req))
        self.queue.append(("p", w.index, WriteCompleted(o.write_id, 0)))

    def run(self) -> None:
        """Deliver everything queued, in order, until nothing is left."""
        while self.queue:
            self.step += 1
            kind, index, item = self.queue.popleft()
            if kind == "p":
                self.to_p(self.p[index], item)
            elif kind == "write":
                self._write(self.p[index], item)
            else:
                assert isinstance(item, ReplyReceived | EngineResolved)
                if isinstance(item, ReplyReceived) and (index, item.pull_id) in self.closed:
                    self.log.late_frames += 1
                    continue
                self.to_d(self.d[index], item)

    # -- a scenario ---------------------------------------------------------------------------

    def request(self, *loads: Load) -> None:
        for w in self.d:
            reqs = tuple(
                LoadRequest(x.d_req, x.transfer_id, ENGINE, BOOTSTRAP, [list(x.d_blocks)])
                for x in loads
            )
            self.to_d(w, LoadsRequested(reqs))

    def finish(self, load: Load) -> None:
        for w in self.p:
            self.to_p(w, TransferFinished(load.transfer_id, load.p_req, [list(load.p_blocks)]))

    def scenario(self) -> None:
        """A ready and B not yet in the first pulls (a CONTINUE round, then FINISH); C later,
        in second pulls that omit the layout once P echoed its id (§3.7)."""
        for w in self.p:
            for x in LOADS:
                self.to_p(w, TransferStarted(x.transfer_id, x.p_req))
        self.finish(LOAD_A)
        self.finish(LOAD_C)
        self.request(LOAD_A, LOAD_B)
        self.run()
        self.finish(LOAD_B)
        self.run()
        self.request(LOAD_C)
        self.run()

    def staggered_scenario(self) -> None:
        """A, ready, pulled by one D worker at a time: each pull ends before the next starts,
        so a P that frees after the first pull is caught (pulls that overlap hide it, since P
        never frees while a write reads the blocks)."""
        for w in self.p:
            self.to_p(w, TransferStarted(LOAD_A.transfer_id, LOAD_A.p_req))
        self.finish(LOAD_A)
        for w in self.d:
            load = LoadRequest(
                LOAD_A.d_req, LOAD_A.transfer_id, ENGINE, BOOTSTRAP, [list(LOAD_A.d_blocks)]
            )
            self.to_d(w, LoadsRequested((load,)))
            self.run()

    # -- what the spec says should have happened ---------------------------------------------

    def pulled_by(self, d: DWorker) -> set[str]:
        """The P workers D worker ``d`` must pull from (§10.1.2, §10.2.2)."""
        ranks = target_ranks(self.d_tp, d.tp_rank, self.p_tp)
        stages = [d.pp_rank] if self.d_pp == self.p_pp else range(self.p_pp)
        return {w.addr for w in self.p if w.tp_rank in ranks and w.pp_rank in stages}

    def paired_with(self, p: PWorker) -> set[int]:
        """The D workers whose pulls P worker ``p`` must serve before it frees (§10.3)."""
        return {d.index for d in self.d if p.addr in self.pulled_by(d)}


def check(c: Cluster) -> None:
    log = c.log
    assert not log.rejected
    assert log.late_frames == 0
    # D: one pull per paired P worker and request, one RequestLoaded per request, nothing else.
    # The second pulls (C) leave out the layout P echoed the id of (§3.7).
    for d in c.d:
        for x in LOADS:
            pulls = [(a, lay) for (i, a, r, lay) in log.pulls if (i, r) == (d.index, x.d_req)]
            assert sorted(a for a, _ in pulls) == sorted(c.pulled_by(d)), (d.index, x.name)
            assert {lay for _, lay in pulls} == {x is not LOAD_C}, (d.index, x.name)
        loaded = [RequestLoaded(x.d_req) for x in LOADS]
        assert sorted(log.reports[d.index], key=repr) == loaded, d.index
        assert d.session.open_pulls == 0
        assert d.session.loading == 0
    # P: each request freed once, as served, only once every paired D worker's pull was served
    # and after every copy from its blocks.
    for p in c.p:
        frees = [(step, o) for (step, i, o) in log.frees if i == p.index]
        assert sorted(o.p_req_id for _, o in frees) == sorted(x.p_req for x in LOADS), p.index
        paired = c.paired_with(p)
        assert len(paired) == len(target_ranks(c.p_tp, p.tp_rank, c.d_tp)) * (
            c.d_pp if c.d_pp > 1 and c.d_pp != c.p_pp else 1
        )
        for step, o in frees:
            x = next(x for x in LOADS if x.p_req == o.p_req_id)
            assert o.reason is FreeReason.SERVED and o.transfer_id == x.transfer_id
            served = {d for (s, i, d, r) in log.served if (i, r) == (p.index, x.d_req)}
            before = {
                d for (s, i, d, r) in log.served if (i, r) == (p.index, x.d_req) and s <= step
            }
            assert served == before == paired, (p.index, x.name, sorted(before), sorted(paired))
            copies = [s for (s, i, r) in log.copies if i == p.index and r == x.d_req]
            assert all(s < step for s in copies), (p.index, x.name)
            assert p.session.state_of(x.transfer_id) is TransferState.SERVED
        assert p.session.open_pulls == 0
        assert p.session.blocks_held == 0
    # Bytes: every destination block holds its layers' and heads' KV, written exactly once;
    # every other byte is as it was.
    loads = [(x.p_blocks, x.d_blocks) for x in LOADS]
    for d, initial in zip(c.d, c.initial_d, strict=True):
        expected = dataclasses.replace(d.memory, mem=initial).expected(c.kv, loads)
        got = d.memory.mem
        if not np.array_equal(got, expected):
            bad = np.flatnonzero(got != expected)
            pytest.fail(f"D worker {d.index}: {bad.size} bytes differ, first at offset {bad[0]}")
        target = np.zeros_like(got)
        for _, _, region in d.memory.layer_regions():
            view = d.memory.view(region, target)
            for x in LOADS:
                view[list(x.d_blocks)] = 0x0101
        np.testing.assert_array_equal(c.coverage[d.index], target.astype(np.int32))


def run_pair(profile: Profile, p_tp: int, p_pp: int, d_tp: int, d_pp: int) -> Cluster:
    c = Cluster(GEOMETRY, profile, p_tp, p_pp, d_tp, d_pp)
    c.scenario()
    return c


PARALLEL = [
    pytest.param(p_tp, p_pp, d_tp, d_pp, id=f"P{p_tp}x{p_pp}-D{d_tp}x{d_pp}")
    for p_tp, d_tp in itertools.product(TP_SIZES, TP_SIZES)
    for p_pp, d_pp in itertools.product(PP_SIZES, PP_SIZES)
]

LEGACY_PARALLEL = [
    pytest.param(*sizes, id="P{}x{}-D{}x{}".format(*sizes))
    for sizes in (
        (1, 1, 1, 1),
        (1, 1, 2, 1),
        (2, 1, 1, 1),
        (8, 1, 1, 1),
        (1, 1, 8, 1),
        (4, 2, 2, 2),
        (2, 1, 4, 2),
        (4, 2, 8, 1),
        (2, 4, 4, 2),
        (8, 4, 8, 4),
        (1, 2, 2, 4),
        (8, 1, 4, 4),
    )
]


@pytest.mark.parametrize(("p_tp", "p_pp", "d_tp", "d_pp"), PARALLEL)
def test_pdwire2_bytes_land_and_frees_wait(p_tp: int, p_pp: int, d_tp: int, d_pp: int) -> None:
    check(run_pair(PDWIRE_2, p_tp, p_pp, d_tp, d_pp))


@pytest.mark.parametrize(("p_tp", "p_pp", "d_tp", "d_pp"), LEGACY_PARALLEL)
def test_legacy_bytes_land_and_frees_wait(p_tp: int, p_pp: int, d_tp: int, d_pp: int) -> None:
    check(run_pair(LEGACY, p_tp, p_pp, d_tp, d_pp))


def test_the_check_sees_a_misplaced_byte() -> None:
    """The byte comparison is not vacuous: one byte off in one D block fails it."""
    c = run_pair(PDWIRE_2, 2, 1, 1, 1)
    d = c.d[0]
    _, _, region = next(d.memory.layer_regions())
    off = region.base_addr - d.memory.base + LOAD_A.d_blocks[0] * region.block_len + 3
    d.memory.mem[off] ^= 0xFF
    with pytest.raises(pytest.fail.Exception, match="1 bytes differ"):
        check(c)


def freed_after_every_pull(c: Cluster) -> bool:
    """In the staggered scenario: each P worker freed A only after every paired D worker's pull
    of A was served (10.9.1), and every D worker loaded A."""
    for p in c.p:
        frees = [step for (step, i, o) in c.log.frees if i == p.index]
        served = {d: s for (s, i, d, r) in c.log.served if (i, r) == (p.index, LOAD_A.d_req)}
        if len(frees) != 1 or set(served) != c.paired_with(p):
            return False
        if any(s > frees[0] for s in served.values()):
            return False
    return all(c.log.reports[d.index] == [RequestLoaded(LOAD_A.d_req)] for d in c.d)


@pytest.mark.parametrize("mutant", [False, True], ids=["control", "need_send-1"])
def test_the_check_sees_an_early_free(mutant: bool) -> None:
    """The order check is not vacuous: a P that frees after one of two D ranks' pulls fails it,
    the same P unmutated passes it."""

    class Hasty(ProducerSession):
        def _open_pull(self, *args: Any, **kwargs: Any) -> Any:
            pull = super()._open_pull(*args, **kwargs)
            pull.need_send = 1
            return pull

    c = Cluster(GEOMETRY, PDWIRE_2, 1, 1, 2, 1)
    if mutant:
        c.p[0].session = Hasty(c.p[0].session.config)
    c.staggered_scenario()
    assert freed_after_every_pull(c) is not mutant


# A replicated P (TP above the KV heads): only the first P rank of each shard writes (§10.8.7).
REPLICATED = Geometry(
    num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype_bytes=2, num_blocks=32
)


@pytest.mark.parametrize("d_tp", TP_SIZES)
@pytest.mark.parametrize("p_tp", TP_SIZES)
def test_replicated_heads(p_tp: int, d_tp: int) -> None:
    c = Cluster(REPLICATED, PDWIRE_2, p_tp, 1, d_tp, 1)
    c.scenario()
    check(c)
