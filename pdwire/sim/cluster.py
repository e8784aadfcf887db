"""A P/D cluster in virtual time: real producer and consumer sessions, a modelled network,
transfer engine and prefill, and injected faults. Deterministic for a given seed."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any, Final

from ..consumer import ConsumerConfig, ConsumerSession
from ..events import (
    AbortRequested,
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
    RequestQueued,
    SendPull,
    SendReply,
    StartWrite,
    TimePassed,
    TransferFinished,
    TransferStarted,
    TransferWillNotSend,
    WriteCompleted,
)
from ..http_models import EngineEntry
from ..messages import XferMetadata
from ..planning import target_ranks
from ..producer import ProducerConfig, ProducerSession
from ..versions import ALL_CAPS, PDWIRE_2, WIRE_VERSION, Profile
from .geometry import Geometry

FAULTS: Final = (
    "lost-message",
    "stage-never-pulls",
    "p-abort",
    "stop-token",
    "duplicate-transfer-id",
    "slow-p",
)


@dataclasses.dataclass(frozen=True)
class SimParams:
    prefill_instances: int = 1
    decode_instances: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_pp: int = 1
    decode_pp: int = 1
    requests: int = 100
    fault_rate: float = 0.0
    seed: int = 0
    profile: Profile = PDWIRE_2
    arrival_rate: float = 200.0  # requests per virtual second
    prompt_tokens: int = 1000
    deadline: float = 60.0  # D's load deadline (pdwire/2) and the SLA late_terminal uses
    abort_timeout: float = 480.0
    net_latency: float = 100e-6
    step_jitter: float = 5e-3  # each D worker starts a load within this of the others
    bandwidth: float = 25e9  # bytes per second per write
    prefill_per_token: float = 50e-6
    slow_prefill: float = 600.0
    #: vLLM 0.34's kv_lease_duration on every P and D (§6.4); None: no lease
    lease: float | None = None
    #: each request waits up to this long (uniformly) in D's queue before its load starts
    d_queue: float = 0.0
    geometry: Geometry = dataclasses.field(default_factory=Geometry)


@dataclasses.dataclass(slots=True)
class Request:
    n: int
    arrival: float
    transfer_id: str
    p_inst: int
    d_inst: int
    fault: str | None
    blocks: list[list[int]]
    reports: int = 0
    failed: bool = False
    terminal: float | None = None


@dataclasses.dataclass(slots=True)
class Worker:
    index: int
    instance: int
    tp_rank: int
    pp_rank: int
    session: Any
    addr: str
    wake_at: float | None = None
    held: dict[str, int] = dataclasses.field(default_factory=dict)  # request -> blocks


@dataclasses.dataclass
class Counters:
    control_messages: int = 0
    early_frees: int = 0
    writes: int = 0
    bytes_written: int = 0
    descriptors: int = 0
    rejected: int = 0


class Cluster:
    """Runs ``params.requests`` requests through the cluster; see ``Report`` for the results."""

    def __init__(self, params: SimParams) -> None:
        self.p = params
        self.rng = random.Random(params.seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.counters = Counters()
        self.requests: list[Request] = []
        self._by_d_req: dict[str, Request] = {}
        self._by_p_req: dict[str, Request] = {}
        self._last_transfer: dict[int, str] = {}
        self._dropped: set[str] = set()  # d_req_ids whose next message is lost
        self._rejected_p: set[str] = set()  # P requests refused for a taken transfer_id
        self.progress: Callable[[int], None] | None = None
        self.fingerprint = params.geometry.fingerprint("sim")
        self.p_workers = self._make_producers()
        self.d_workers = self._make_consumers()
        self._p_by_addr = {w.addr: w for w in self.p_workers}
        self._p_of: dict[int, list[Worker]] = {}
        for w in self.p_workers:
            self._p_of.setdefault(w.instance, []).append(w)
        self._d_of: dict[int, list[Worker]] = {}
        for w in self.d_workers:
            self._d_of.setdefault(w.instance, []).append(w)
        self._d_by_peer = {f"d{w.index}:{w.index + 1}": w for w in self.d_workers}
        # (P worker, P request) -> D workers whose pulls it served or that withdrew them
        self._served: dict[tuple[int, str], set[int]] = {}
        # (P worker, transfer_id) -> the P request whose blocks back it: a duplicate transfer_id
        # is served from the blocks of the request that holds it (10.11.9)
        self._owner: dict[tuple[int, str], str] = {}
        self._expected = self._expected_pulls()

    # -- construction ------------------------------------------------------------------------

    def _make_producers(self) -> list[Worker]:
        p, g = self.p, self.p.geometry
        out: list[Worker] = []
        for inst, tp, pp in itertools.product(
            range(p.prefill_instances), range(p.prefill_tp), range(p.prefill_pp)
        ):
            index = len(out)
            side = g.side(p.prefill_tp, tp, p.prefill_pp, pp, index)
            config = ProducerConfig(
                side=side,
                profile=p.profile,
                fingerprint=self.fingerprint if p.profile == PDWIRE_2 else None,
                abort_timeout=p.abort_timeout,
                lease=p.lease,
            )
            addr = f"tcp://p{inst}-{tp}-{pp}:{5000 + index}"
            out.append(Worker(index, inst, tp, pp, ProducerSession(config), addr))
        return out

    def _make_consumers(self) -> list[Worker]:
        p, g = self.p, self.p.geometry
        out: list[Worker] = []
        for inst, tp, pp in itertools.product(
            range(p.decode_instances), range(p.decode_tp), range(p.decode_pp)
        ):
            index = len(out)
            side = g.side(p.decode_tp, tp, p.decode_pp, pp, 10_000 + index)
            config = ConsumerConfig(
                hostname=f"d{index}",
                port=index + 1,
                side=side,
                pp_rank=pp,
                profile=p.profile,
                fingerprint=self.fingerprint if p.profile == PDWIRE_2 else None,
                layout_id=(2 * index + 1) << 8 | 1,
                receive_timeout=p.abort_timeout + 60,
                deadline=p.deadline,
                lease=p.lease,
            )
            out.append(Worker(index, inst, tp, pp, ConsumerSession(config), f"d{index}"))
        return out

    def _entry(self, inst: int) -> EngineEntry:
        workers = self._p_of[inst]
        addr: dict[int, dict[int, str]] = {}
        for w in workers:
            addr.setdefault(w.tp_rank, {})[w.pp_rank] = w.addr
        v2 = self.p.profile == PDWIRE_2
        return EngineEntry(
            engine_id=f"p{inst}",
            worker_addr=addr,
            pdwire_version=WIRE_VERSION[PDWIRE_2] if v2 else None,
            pdwire_caps=sorted(ALL_CAPS) if v2 else None,
            tp_size=self.p.prefill_tp if v2 else None,
            pp_size=self.p.prefill_pp if v2 else None,
        )

    def _expected_pulls(self) -> int:
        """Pulls each P worker must serve per request (§10.3), for the early-free check."""
        p = self.p
        paired = len(target_ranks(p.prefill_tp, 0, p.decode_tp))
        pp = p.decode_pp
        return paired * (pp if pp > 1 and pp != p.prefill_pp else 1)

    # -- the event loop ----------------------------------------------------------------------

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), fn, args))

    def run(self) -> None:
        gap = 1.0 / self.p.arrival_rate
        t = 0.0
        for n in range(self.p.requests):
            t += self.rng.expovariate(1.0) * gap
            self.at(t, self._arrive, n)
        while self._queue:
            when, _, fn, args = heapq.heappop(self._queue)
            self.now = when
            fn(*args)

    def _feed(self, w: Worker, event: Any) -> None:
        out = w.session.handle(event, self.now)
        if w.session.__class__ is ProducerSession:
            self._on_p_out(w, out)
        else:
            self._on_d_out(w, out)
        deadline = w.session.next_deadline()
        if deadline is not None and (w.wake_at is None or deadline < w.wake_at):
            w.wake_at = deadline
            self.at(deadline, self._wake, w, deadline)

    def _wake(self, w: Worker, when: float) -> None:
        if w.wake_at != when:
            return
        w.wake_at = None
        self._feed(w, TimePassed())

    # -- requests ----------------------------------------------------------------------------

    def _arrive(self, n: int) -> None:
        if self.progress is not None:
            self.progress(n)
        p = self.p
        fault = self.rng.choice(FAULTS) if self.rng.random() < p.fault_rate else None
        p_inst, d_inst = n % p.prefill_instances, n % p.decode_instances
        transfer_id = f"xfer-{n}"
        if fault == "duplicate-transfer-id" and p_inst in self._last_transfer:
            transfer_id = self._last_transfer[p_inst]
        self._last_transfer[p_inst] = transfer_id
        nblocks = -(-p.prompt_tokens // p.geometry.block_size)
        start = self.rng.randrange(p.geometry.num_blocks - nblocks)
        req = Request(
            n, self.now, transfer_id, p_inst, d_inst, fault, [list(range(start, start + nblocks))]
        )
        self.requests.append(req)
        self._by_d_req[f"d-{n}"] = req
        self._by_p_req[f"p-{n}"] = req
        lat = p.net_latency
        for w in self._p_of[p_inst]:
            self.at(self.now + lat, self._feed, w, TransferStarted(transfer_id, f"p-{n}"))
        prefill = p.slow_prefill if fault == "slow-p" else p.prompt_tokens * p.prefill_per_token
        self.at(self.now + lat + prefill / (2 if fault == "p-abort" else 1), self._prefilled, req)
        if fault == "lost-message":
            self._dropped.add(f"d-{n}")
        load = LoadRequest(
            f"d-{n}", transfer_id, f"p{p_inst}", f"http://p{p_inst}:8998", req.blocks
        )
        queued = RequestQueued(load.d_req_id, transfer_id, load.engine_id, load.bootstrap_addr)
        waits = self.rng.uniform(0.0, p.d_queue)  # in D's queue, waiting for blocks
        for w in self._d_of[d_inst]:
            w.held[f"d-{n}"] = nblocks
            self.at(self.now + lat, self._feed, w, queued)
            begins = self.now + lat + waits + self.rng.uniform(0.0, p.step_jitter)
            self.at(begins, self._feed, w, LoadsRequested((load,)))

    def _prefilled(self, req: Request) -> None:
        p_req = f"p-{req.n}"
        for w in self._p_of[req.p_inst]:
            if req.fault in ("p-abort", "stop-token"):
                self._feed(w, TransferWillNotSend(req.transfer_id, p_req, req.fault))
            elif p_req not in self._rejected_p:
                w.held[p_req] = len(req.blocks[0])
                self._owner[(w.index, req.transfer_id)] = p_req
                self._feed(w, TransferFinished(req.transfer_id, p_req, req.blocks))

    # -- producer outputs --------------------------------------------------------------------

    def _on_p_out(self, w: Worker, out: list[ProducerOutput]) -> None:
        lat = self.p.net_latency
        for o in out:  # replies first: a free is checked against what this batch settled
            if isinstance(o, SendReply):
                self.counters.control_messages += 1
                d_index, pull_id = map(int, o.identity.decode().split("/"))
                d = self.d_workers[d_index]
                for d_req in o.reply.ok_reqs or ():
                    self._served.setdefault((w.index, self._p_req_of(w, d_req)), set()).add(d.index)
                if self._lose(o.reply.ok_reqs, o.reply.err_reqs):
                    continue
                self.at(self.now + lat, self._feed, d, ReplyReceived(pull_id, o.data))
        for o in out:
            if isinstance(o, StartWrite):
                self._start_write(w, o)
            elif isinstance(o, FreeBlocks):
                self._p_free(w, o)
            elif isinstance(o, RejectRequest):
                self.counters.rejected += 1
                self._rejected_p.add(o.p_req_id)
                self._abort_decode(self._by_p_req[o.p_req_id])

    def _lose(self, *lists: list[str] | None) -> bool:
        for reqs in lists:
            for d_req in reqs or ():
                if d_req in self._dropped:
                    self._dropped.discard(d_req)
                    return True
        return False

    def _p_req_of(self, w: Worker, d_req: str) -> str:
        req = self._by_d_req[d_req]
        return self._owner.get((w.index, req.transfer_id), f"p-{req.n}")

    def _abort_decode(self, req: Request) -> None:
        """The proxy fails a request whose P leg was refused, and aborts its D leg (10.11.8)."""
        for d in self._d_of[req.d_inst]:
            self.at(self.now + self.p.net_latency, self._feed, d, AbortRequested(f"d-{req.n}"))

    def _start_write(self, w: Worker, o: StartWrite) -> None:
        c = self.counters
        c.writes += 1
        c.descriptors += len(o.descriptors)
        nbytes = o.descriptors.total_bytes
        c.bytes_written += nbytes
        for d_req in o.d_req_ids:
            if self._p_req_of(w, d_req) not in w.held:
                c.early_frees += 1  # a write from blocks P already freed
        d = self._d_by_peer[o.peer]
        done = self.now + self.p.net_latency + nbytes / self.p.bandwidth
        self.at(done, self._write_done, w, d, o)

    def _write_done(self, w: Worker, d: Worker, o: StartWrite) -> None:
        for d_req in o.d_req_ids:
            if d_req not in d.held:
                self.counters.early_frees += 1  # a write into blocks D already freed
        self._feed(w, WriteCompleted(o.write_id, 0))

    def _p_free(self, w: Worker, o: FreeBlocks) -> None:
        if w.held.pop(o.p_req_id, None) is None:
            return
        settled = self._served.pop((w.index, o.p_req_id), set())
        if o.reason is FreeReason.SERVED and len(settled) < self._expected:
            self.counters.early_frees += 1

    # -- consumer outputs --------------------------------------------------------------------

    def _on_d_out(self, w: Worker, out: list[ConsumerOutput]) -> None:
        lat = self.p.net_latency
        for o in out:
            if isinstance(o, SendPull):
                self.counters.control_messages += 1
                req = self._req_of_pull(o)
                silenced = req is not None and req.fault == "stage-never-pulls"
                if silenced and isinstance(o.message, XferMetadata) and self._silent(w):
                    continue
                target = self._p_by_addr[o.addr]
                ident = f"{w.index}/{o.pull_id}".encode()
                self.at(self.now + lat, self._feed, target, MessageReceived(ident, o.data))
            elif isinstance(o, QueryBootstrap):
                entry = self._entry(int(o.engine_id[1:]))
                self.at(self.now + 2 * lat, self._feed, w, EngineResolved(o.engine_id, entry))
            elif isinstance(o, RequestLoaded | RequestFailed):
                self._report(w, o)
            elif isinstance(o, BlocksReleased):
                self._d_free(w, o.d_req_id)
            elif isinstance(o, ClosePull):
                pass

    def _req_of_pull(self, o: SendPull) -> Request | None:
        reqs = getattr(o.message, "req_blocks", None) or getattr(o.message, "cancel_reqs", {})
        for d_req in reqs:
            return self._by_d_req.get(d_req)
        return None

    def _silent(self, w: Worker) -> bool:
        """The D worker that the stage-never-pulls fault silences: TP rank 0 of the last stage."""
        return w.tp_rank == 0 and w.pp_rank == self.p.decode_pp - 1

    def _report(self, w: Worker, o: RequestLoaded | RequestFailed) -> None:
        req = self._by_d_req[o.d_req_id]
        if isinstance(o, RequestFailed):
            req.failed = True
            if o.blocks_free:
                self._d_free(w, o.d_req_id)
        else:
            self._d_free(w, o.d_req_id)
        req.reports += 1
        if req.reports == self.p.decode_tp * self.p.decode_pp:
            req.terminal = self.now

    def _d_free(self, w: Worker, d_req: str) -> None:
        w.held.pop(d_req, None)

    # -- results -----------------------------------------------------------------------------

    def leaked_blocks(self) -> tuple[int, int]:
        p = sum(sum(w.held.values()) for w in self.p_workers)
        d = sum(sum(w.held.values()) for w in self.d_workers)
        return p, d
