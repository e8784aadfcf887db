"""The reference connector's agents at run time, each case against a baseline timed in the same run.

Run from the repository root: ``python -m tests.bench.runtime_ratios [--quick] [--json PATH]``.
One P agent and one D agent (TP1, pdwire/2) over Mooncake on loopback TCP, a bootstrap server
and two registered KV tensors, all in this process:

- transfer: a 63-block request of 36 layers x K/V (32 KiB blocks, contiguous ids: 72
  descriptors of 63 x 32 KiB, the seeds' 148.6 MB), D's ``load()`` to ``on_loaded``, P ready
  first; baseline: the same transport pair's ``raw_write`` of the same descriptors. Rounds
  alternate raw, agent; the ratio is the median of the rounds' agent GB/s / raw GB/s. The
  target is >= 0.9.
- control: a release-only pull (no blocks) from D's ``load()`` until D closes the pull on P's
  FINISH; baseline: a fresh DEALER's round trip of a frame of the pull's size to a ROUTER echo.
  Also timed against the same echo: the agents' thread hops alone (``Skeleton``), so that the
  report tells the cost of the threads and sockets apart from the cost of the protocol's work.
- throughput: 4-block requests (72 descriptors), 8 loads in flight from one D; baseline: as many
  ``raw_write`` calls of the same descriptor sets back to back.
- query: D's query of the bootstrap server (``bootstrap_client.query``: a client per query, as
  the agents make it); baseline: a GET of ``/query`` on a client whose connection is open.

Nothing here asserts timings; a failed or short transfer raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import resource
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import httpx
import torch
import zmq
import zmq.asyncio

from pdwire.events import LoadRequest, SendPull
from pdwire.messages import ErrorCode
from pdwire.planning import Descriptors, Plan, Side, descriptors, prepare
from pdwire.producer import ProducerConfig
from pdwire.sim.geometry import Geometry
from pdwire.versions import ALL_CAPS, PDWIRE_2
from reference_connector import bootstrap_client
from reference_connector.bootstrap import BootstrapServer
from reference_connector.consumer_agent import ConsumerAgent
from reference_connector.loop_thread import LoopThread
from reference_connector.producer_agent import ProducerAgent
from reference_connector.transport import OK, MooncakeTransport

from .codec_ratios import QUICK, Settings, bench_main

#: The seeds' geometry (Qwen3-8B, TP1: 36 layers; 8 KV heads x 128 x 16 tokens x bf16 = 32 KiB
#: per layer's K or V of one block): a 63-block request is the seeds' 148.6 MB.
GEOM: Final = Geometry(
    num_layers=36, num_kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2, num_blocks=128
)
FP: Final = GEOM.fingerprint("bench")
BIG_BLOCKS: Final = 63  # blocks of the transfer case's requests (a 1000-token prompt)
SMALL_BLOCKS: Final = 4  # blocks of the throughput case's requests
CONCURRENCY: Final = 8  # loads in flight in the throughput case
SMALL_BASE: Final = 64  # the throughput case's slots use blocks from here on
WAIT: Final = 30.0  # seconds any single wait may take before the run fails


@dataclasses.dataclass(frozen=True)
class Scale:
    transfer_rounds: int
    transfer_requests: int  # per round, each way
    control_rounds: int
    control_pulls: int  # per round, each way
    throughput_rounds: int
    throughput_requests: int  # per round, each way
    query_rounds: int
    queries: int  # per round, each way


FULL_SCALE: Final = Scale(9, 6, 9, 60, 5, 400, 9, 40)
QUICK_SCALE: Final = Scale(2, 2, 2, 10, 2, 40, 2, 5)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the rig: two engines, two tensors, a bootstrap server, one P agent, one D agent -----------


def kv_tensor() -> torch.Tensor:
    g = GEOM
    shape = (g.num_layers, 2, g.num_blocks, g.num_kv_heads, g.block_size, g.head_dim)
    return torch.zeros(shape, dtype=torch.bfloat16)


def side_at(base: int) -> Side:
    """``GEOM.side``'s TP1 regions, moved into the tensor registered at ``base``."""
    side = GEOM.side(1, 0, 1, 0, worker=0)
    origin = side.regions[0].base_addr
    regions = tuple(
        dataclasses.replace(r, base_addr=base + r.base_addr - origin) for r in side.regions
    )
    return dataclasses.replace(side, regions=regions)


class BenchConsumer(ConsumerAgent):
    """A D agent that also says when it closes a pull (a release-only request is never reported
    through the public callbacks, §10.10.9) and how long its last pull frame was."""

    def __init__(self, *args: Any, on_closed: Callable[[int], None], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_closed = on_closed
        self.last_pull_bytes = 0

    def _send_pull(self, pull: SendPull) -> None:
        self.last_pull_bytes = len(pull.data)
        super()._send_pull(pull)

    def _close_pull(self, pull_id: int) -> None:
        super()._close_pull(pull_id)
        self._on_closed(pull_id)


class BenchProducer(ProducerAgent):
    """A P agent that can say when its loop has run the calls made to it before."""

    def settled(self) -> None:
        self._thread.submit(asyncio.sleep(0)).result(WAIT)


class Rig:
    """Everything the cases share. ``start`` and ``stop`` pair up: ``stop`` undoes whatever part
    of ``start`` got done, in reverse order."""

    def __init__(self) -> None:
        self.engine_id = f"bench-{uuid.uuid4().hex[:8]}"
        self._undo: list[Callable[[], None]] = []
        self._cond = threading.Condition()
        self._loaded: dict[str, float] = {}
        self._closed = 0
        self._closed_at = 0.0
        self._failures: list[str] = []
        self._count = itertools.count(1)
        self.on_loaded_hook: Callable[[str], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Rig:
        self.p_transport = MooncakeTransport()
        self._undo.append(self.p_transport.close)
        self.d_transport = MooncakeTransport()
        self._undo.append(self.d_transport.close)
        self.p_kv = kv_tensor()
        gen = torch.Generator().manual_seed(20_240_601)
        self.p_kv.copy_(torch.randn(self.p_kv.shape, generator=gen, dtype=torch.bfloat16))
        self.d_kv = kv_tensor()
        self.p_side = side_at(self.p_transport.register(self.p_kv))
        self.d_side = side_at(self.d_transport.register(self.d_kv))
        plan = prepare(self.p_side, self.d_side)
        if not isinstance(plan, Plan):
            raise RuntimeError(f"no plan between the bench's P and D: {plan}")
        self.plan = plan
        self.server = BootstrapServer()
        self.server.start()
        self._undo.append(self.server.stop)
        # D's workers are handed the address as a string (kv_transfer_params); formatting it
        # from the server's host on every load would be timed with the pull.
        self.bootstrap_url = self.server.url
        config = ProducerConfig(
            side=self.p_side, profile=PDWIRE_2, fingerprint=FP, abort_timeout=480.0, caps=ALL_CAPS
        )
        self.p = BenchProducer(
            config,
            self.p_transport,
            bootstrap_url=self.bootstrap_url,
            engine_id=self.engine_id,
            on_free=lambda p_req, tid, reason: None,
            on_reject=lambda p_req, tid, code, msg: self._fail(f"P rejected {p_req}: {msg}"),
        )
        self._undo.append(self.p.stop)
        self.p.start()
        d_config = ConsumerAgent.config_for(
            self.d_transport,
            self.d_side,
            profile=PDWIRE_2,
            fingerprint=FP,
            layout_id=1 << 8 | 1,
            deadline=60.0,
        )
        self.d = BenchConsumer(
            d_config,
            self.d_transport,
            on_loaded=self._on_loaded,
            on_failed=self._on_failed,
            on_released=lambda d_req: None,
            on_closed=self._on_closed,
        )
        self._undo.append(self.d.stop)
        self.d.start()
        return self

    def stop(self) -> None:
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # keep undoing the rest
                _progress(f"runtime_ratios: error while stopping: {exc!r}")

    # -- callbacks (agents' loop threads) ----------------------------------------------------

    def _on_loaded(self, d_req: str, _pull_s: float) -> None:
        now = time.perf_counter()
        hook = self.on_loaded_hook
        if hook is not None:
            hook(d_req)
        with self._cond:
            self._loaded[d_req] = now
            self._cond.notify_all()

    def _on_failed(self, d_req: str, code: ErrorCode, reason: str, free: bool) -> None:
        self._fail(f"D request {d_req} failed: {code!r} {reason}")

    def _on_closed(self, pull_id: int) -> None:
        now = time.perf_counter()
        with self._cond:
            self._closed += 1
            self._closed_at = now
            self._cond.notify_all()

    def _fail(self, message: str) -> None:
        with self._cond:
            self._failures.append(message)
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding ``_cond``) until ``ready()``; raise on a failure or after ``WAIT``."""
        if not self._cond.wait_for(lambda: bool(self._failures) or ready(), WAIT):
            raise RuntimeError(f"{what}: nothing within {WAIT}s")
        if self._failures:
            raise RuntimeError(f"{what}: {self._failures}")

    # -- requests ----------------------------------------------------------------------------

    def ready_at_p(self, p_blocks: list[int]) -> tuple[str, str]:
        """A request P has prefilled into ``p_blocks``: returns (D's id, transfer id)."""
        n = next(self._count)
        tid = f"xfer-{uuid.uuid4()}"
        self.p.transfer_started(tid, f"p-{n}")
        self.p.transfer_finished(tid, f"p-{n}", [p_blocks])
        return f"d-{n}", tid

    def p_settled(self) -> None:
        """Return once P's loop has run the calls made to P before. In a deployment P knows a
        request is ready well before D's pull for it comes: the proxy sends D its leg after P's
        answer."""
        self.p.settled()

    def load(self, d_req: str, tid: str, d_blocks: list[int]) -> None:
        self.d.load([LoadRequest(d_req, tid, self.engine_id, self.bootstrap_url, [d_blocks])])

    def wait_loaded(self, d_req: str) -> float:
        with self._cond:
            self._wait(lambda: d_req in self._loaded, f"load of {d_req}")
            return self._loaded.pop(d_req)

    def closed_count(self) -> int:
        with self._cond:
            return self._closed

    def wait_closed(self, count: int) -> float:
        with self._cond:
            self._wait(lambda: self._closed >= count, "release-only pull")
            return self._closed_at

    def forget_loaded(self) -> None:
        with self._cond:
            self._loaded.clear()

    # -- the baseline's writes ---------------------------------------------------------------

    def descriptors(self, blocks: list[int]) -> Descriptors:
        descs = descriptors(self.plan, [blocks], [blocks])
        if not isinstance(descs, Descriptors):
            raise RuntimeError(f"no descriptors for blocks {blocks}: {descs}")
        return descs

    def raw_writer(self, descs: Descriptors) -> Callable[[], None]:
        """One ``raw_write`` of ``descs`` from P's engine into D's, its lists made beforehand."""
        peer = self.d_transport.session
        src, dst, lengths = descs.src.tolist(), descs.dst.tolist(), descs.length.tolist()
        raw_write = self.p_transport.raw_write

        def write() -> None:
            ret = raw_write(peer, src, dst, lengths)
            if ret != OK:
                raise RuntimeError(f"raw_write returned {ret}")

        return write

    def check_copied(self, blocks: list[int]) -> None:
        if not torch.equal(self.d_kv[:, :, blocks], self.p_kv[:, :, blocks]):
            raise RuntimeError(f"D's blocks {blocks} differ from P's")

    def clear(self, blocks: list[int]) -> None:
        self.d_kv[:, :, blocks] = 0


# -- case 1: transfer efficiency ---------------------------------------------------------------


def _agent_transfer(rig: Rig, blocks: list[int]) -> float:
    """Seconds from D's load() to on_loaded for one request whose KV P holds ready."""
    d_req, tid = rig.ready_at_p(blocks)
    rig.p_settled()
    t0 = time.perf_counter()
    rig.load(d_req, tid, blocks)
    return rig.wait_loaded(d_req) - t0


def transfer_case(rig: Rig, scale: Scale) -> dict[str, Any]:
    blocks = list(range(BIG_BLOCKS))
    descs = rig.descriptors(blocks)
    nbytes = descs.total_bytes
    raw = rig.raw_writer(descs)
    rig.clear(blocks)
    _agent_transfer(rig, blocks)  # warm: resolves the engine, opens Mooncake's connection
    rig.check_copied(blocks)
    rig.clear(blocks)
    raw()
    rig.check_copied(blocks)
    written_before = rig.p.bytes_written
    agent_gbps: list[float] = []
    raw_gbps: list[float] = []
    raw_cpu_s = raw_wall_s = 0.0
    for r in range(scale.transfer_rounds):
        _progress(f"[transfer {r + 1}/{scale.transfer_rounds}]")
        raw_s = 0.0
        for _ in range(scale.transfer_requests):
            c0 = _process_cpu_s()
            t0 = time.perf_counter()
            raw()
            raw_s += time.perf_counter() - t0
            raw_cpu_s += _process_cpu_s() - c0
        raw_wall_s += raw_s
        agent_s = sum(_agent_transfer(rig, blocks) for _ in range(scale.transfer_requests))
        raw_gbps.append(scale.transfer_requests * nbytes / raw_s / 1e9)
        agent_gbps.append(scale.transfer_requests * nbytes / agent_s / 1e9)
    written = rig.p.bytes_written - written_before
    expected = scale.transfer_rounds * scale.transfer_requests * nbytes
    if written != expected:
        raise RuntimeError(f"P wrote {written} bytes, not {expected}")
    return {
        "case": "transfer",
        "unit": "GB/s",
        "pdwire": statistics.median(agent_gbps),
        "baseline": statistics.median(raw_gbps),
        "baseline_name": "raw_write",
        "ratio": statistics.median(a / b for a, b in zip(agent_gbps, raw_gbps, strict=True)),
        "target": ">= 0.9",
        "rounds": scale.transfer_rounds,
        "requests_per_round": scale.transfer_requests,
        "bytes_per_request": nbytes,
        "descriptors": len(descs),
        # both engines' threads are in this process: the cores a write at the raw speed takes
        "raw_cores": raw_cpu_s / raw_wall_s,
    }


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- case 2: per-pull control overhead ---------------------------------------------------------


def _agent_release(rig: Rig) -> float:
    """Seconds from D's load() of a release-only request until D closes its pull."""
    d_req, tid = rig.ready_at_p([0])
    rig.p_settled()
    before = rig.closed_count()
    t0 = time.perf_counter()
    rig.load(d_req, tid, [])
    return rig.wait_closed(before + 1) - t0


@contextlib.contextmanager
def router_echo(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[str]:
    """A ROUTER on loopback that sends every message back to its sender, on its own thread."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                sock.send_multipart(sock.recv_multipart())

    thread = threading.Thread(target=serve, name="bench-echo", daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5.0)
        sock.close(linger=0)


def _echo_round_trip(ctx: zmq.Context[zmq.Socket[bytes]], addr: str, frame: bytes) -> float:
    t0 = time.perf_counter()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(frame)
        if not sock.poll(int(WAIT * 1000)):
            raise RuntimeError(f"no echo from {addr} within {WAIT}s")
        sock.recv()
    finally:
        sock.close(linger=0)
    return time.perf_counter() - t0


class Skeleton:
    """A release-only pull's thread hops and sockets, without the protocol: the caller hands the
    pull to a loop thread (D's), which sends the frame on a fresh asyncio DEALER to the asyncio
    ROUTER of a second loop thread (P's); that one sends it back at once, and D's loop notes the
    time when it reads the answer, as the agents' case notes it when D closes the pull."""

    def __init__(self, frame: bytes) -> None:
        self._frame = frame
        self._p = LoopThread("bench-skeleton-p")
        self._d = LoopThread("bench-skeleton-d")
        self._ctx = zmq.asyncio.Context()
        self._addr = ""
        self._ended = 0.0
        self._done = threading.Event()
        # the loops' tasks, kept so that they are not collected while pending (one pull at a time)
        self._tasks: dict[str, asyncio.Future[Any]] = {}

    def __enter__(self) -> Skeleton:
        self._p.start()
        self._d.start()
        self._addr = self._p.submit(self._bind()).result(WAIT)
        return self

    def __exit__(self, *exc: object) -> None:
        self._d.stop()
        self._p.stop()
        self._ctx.destroy(linger=0)

    async def _bind(self) -> str:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self._tasks["echo"] = asyncio.ensure_future(self._echo(sock))
        return f"tcp://127.0.0.1:{port}"

    async def _echo(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                await sock.send_multipart(await sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def _pull(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._addr)
        self._tasks["send"] = asyncio.ensure_future(sock.send(self._frame))
        self._tasks["read"] = asyncio.ensure_future(self._read(sock))

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        try:
            await sock.recv()
            self._ended = time.perf_counter()
        finally:
            sock.close(linger=0)
        self._done.set()

    def round_trip(self) -> float:
        self._done.clear()
        t0 = time.perf_counter()
        self._d.call(self._pull)
        if not self._done.wait(WAIT):
            raise RuntimeError(f"no answer from the skeleton's ROUTER within {WAIT}s")
        return self._ended - t0


def per_item_case(
    case: str,
    unit: str,
    baseline_name: str,
    rounds: int,
    one_round: Callable[[], tuple[list[float], list[float]]],
    **extra: Any,
) -> dict[str, Any]:
    """A case timed per item: ``rounds`` calls of ``one_round`` -> (pdwire's seconds, the
    baseline's seconds); the ratio is the median over rounds of their medians' quotient."""
    pdwire_all: list[float] = []
    baseline_all: list[float] = []
    ratios: list[float] = []
    for r in range(rounds):
        _progress(f"[{case} {r + 1}/{rounds}]")
        ours, theirs = one_round()
        ratios.append(statistics.median(ours) / statistics.median(theirs))
        pdwire_all += ours
        baseline_all += theirs
    return {
        "case": case,
        "unit": unit,
        "pdwire": statistics.median(pdwire_all) * 1e6,
        "baseline": statistics.median(baseline_all) * 1e6,
        "baseline_name": baseline_name,
        "ratio": statistics.median(ratios),
        "target": "",
        "rounds": rounds,
        "pdwire_p90_us": sorted(pdwire_all)[int(len(pdwire_all) * 0.9)] * 1e6,
        **extra,
    }


def control_case(rig: Rig, scale: Scale) -> dict[str, Any]:
    for _ in range(3):  # warm
        _agent_release(rig)
    frame = bytes(rig.d.last_pull_bytes)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pulls = scale.control_pulls
    hops: list[float] = []
    hop_ratios: list[float] = []
    try:
        with router_echo(ctx) as addr, Skeleton(frame) as skeleton:
            for _ in range(3):
                _echo_round_trip(ctx, addr, frame)
                skeleton.round_trip()

            def one_round() -> tuple[list[float], list[float]]:
                echo = [_echo_round_trip(ctx, addr, frame) for _ in range(pulls)]
                bare = [skeleton.round_trip() for _ in range(pulls)]
                hops.extend(bare)
                hop_ratios.append(statistics.median(bare) / statistics.median(echo))
                return [_agent_release(rig) for _ in range(pulls)], echo

            case = per_item_case(
                "control", "us/pull", "zmq DEALER->ROUTER echo", scale.control_rounds,
                one_round, pulls_per_round=pulls, frame_bytes=len(frame),
            )  # fmt: skip
    finally:
        ctx.destroy(linger=0)
    return {
        **case,
        "skeleton_us": statistics.median(hops) * 1e6,
        "skeleton_ratio": statistics.median(hop_ratios),
    }


# -- case 3: requests per second through one P -------------------------------------------------


def _slot_blocks(slot: int) -> list[int]:
    first = SMALL_BASE + slot * SMALL_BLOCKS
    return list(range(first, first + SMALL_BLOCKS))


def _agent_requests(rig: Rig, count: int) -> float:
    """Seconds to load ``count`` small requests with ``CONCURRENCY`` loads in flight."""
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for slot in range(CONCURRENCY):
        free.put(slot)
    slot_of: dict[str, int] = {}
    rig.on_loaded_hook = lambda d_req: free.put(slot_of.pop(d_req))

    def next_slot() -> int:
        try:
            return free.get(timeout=WAIT)
        except queue.Empty:
            raise RuntimeError(
                f"no load finished within {WAIT}s; failures: {rig._failures}"
            ) from None

    try:
        t0 = time.perf_counter()
        for _ in range(count):
            slot = next_slot()
            blocks = _slot_blocks(slot)
            d_req, tid = rig.ready_at_p(blocks)
            slot_of[d_req] = slot
            rig.load(d_req, tid, blocks)
        for _ in range(CONCURRENCY):
            next_slot()
        elapsed = time.perf_counter() - t0
    finally:
        rig.on_loaded_hook = None
        rig.forget_loaded()
    return elapsed


def throughput_case(rig: Rig, scale: Scale) -> dict[str, Any]:
    writers = [rig.raw_writer(rig.descriptors(_slot_blocks(s))) for s in range(CONCURRENCY)]
    count = scale.throughput_requests
    every = [b for s in range(CONCURRENCY) for b in _slot_blocks(s)]
    rig.clear(every)
    _agent_requests(rig, CONCURRENCY)  # warm
    rig.check_copied(every)
    agent_rps: list[float] = []
    raw_rps: list[float] = []
    for r in range(scale.throughput_rounds):
        _progress(f"[throughput {r + 1}/{scale.throughput_rounds}]")
        t0 = time.perf_counter()
        for i in range(count):
            writers[i % CONCURRENCY]()
        raw_rps.append(count / (time.perf_counter() - t0))
        agent_rps.append(count / _agent_requests(rig, count))
    return {
        "case": "throughput",
        "unit": "req/s",
        "pdwire": statistics.median(agent_rps),
        "baseline": statistics.median(raw_rps),
        "baseline_name": "raw_write back to back",
        "ratio": statistics.median(a / b for a, b in zip(agent_rps, raw_rps, strict=True)),
        "target": "",
        "rounds": scale.throughput_rounds,
        "requests_per_round": count,
        "concurrency": CONCURRENCY,
        "descriptors": len(rig.descriptors(_slot_blocks(0))),
    }


# -- case 4: a D's query of the bootstrap server -----------------------------------------------


async def _queries(url: str, count: int) -> tuple[list[float], list[float]]:
    """Seconds of ``count`` queries as D's agent makes them, and of as many GETs of ``/query``
    on one client whose connection is open, alternating."""
    agent: list[float] = []
    bare: list[float] = []
    async with httpx.AsyncClient(timeout=WAIT) as http:
        (await http.get(f"{url}/query")).raise_for_status()  # opens the connection
        for _ in range(count):
            t0 = time.perf_counter()
            reply = await bootstrap_client.query(url, timeout=WAIT)
            agent.append(time.perf_counter() - t0)
            if not reply.root:
                raise RuntimeError(f"the bootstrap server at {url} lists no engine")
            t0 = time.perf_counter()
            (await http.get(f"{url}/query")).raise_for_status()
            bare.append(time.perf_counter() - t0)
    return agent, bare


def query_case(rig: Rig, scale: Scale) -> dict[str, Any]:
    url = rig.bootstrap_url
    asyncio.run(_queries(url, 3))  # warm
    return per_item_case(
        "query", "us/query", "GET /query on an open connection", scale.query_rounds,
        lambda: asyncio.run(_queries(url, scale.queries)), queries_per_round=scale.queries,
    )  # fmt: skip


CASES: Final = (transfer_case, control_case, throughput_case, query_case)
CASE_NAMES: Final = ("transfer", "control", "throughput", "query")


def run_all(settings: Settings) -> list[dict[str, Any]]:
    scale = QUICK_SCALE if settings == QUICK else FULL_SCALE
    rig = Rig()
    try:
        _progress("starting two Mooncake engines, a bootstrap server and the agents")
        rig.start()
        return [case(rig, scale) for case in CASES]
    finally:
        rig.stop()


# -- output -----------------------------------------------------------------------------------

COLUMNS: Final = (("case", 11), ("unit", 8), ("pdwire", 10), ("baseline", 10), ("ratio", 7))


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    def row(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))
        )

    lines = [row([title for title, _ in COLUMNS]), row(["-" * w for _, w in COLUMNS])]
    for c in cases:
        cells = [c["case"], c["unit"], f"{c['pdwire']:.2f}", f"{c['baseline']:.2f}"]
        lines.append(row([*cells, f"{c['ratio']:.3f}"]))
    lines += [
        f"a raw write of the transfer case kept {c['raw_cores']:.2f} cores busy (P's and D's "
        "engines, CPU time over its time)"
        for c in cases
        if "raw_cores" in c
    ]
    lines += [
        f"the control case's thread hops and sockets alone (two loop threads, a fresh DEALER, "
        f"no protocol) took {c['skeleton_us']:.2f} us a pull, {c['skeleton_ratio']:.3f} of the "
        "echo"
        for c in cases
        if "skeleton_us" in c
    ]
    lines.append(
        "baselines: transfer = raw_write of the same descriptors; control = fresh-DEALER echo "
        "of a pull-sized frame; throughput = raw_write calls back to back; query = GET /query "
        "on an open connection. ratio = median over rounds of pdwire / baseline (for control "
        "and query, time: higher is slower); transfer target >= 0.9"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(
        argv,
        "python -m tests.bench.runtime_ratios",
        "Time the reference connector's P and D agents over Mooncake on loopback against bare "
        "baselines timed in the same run (raw transfer-engine writes, a ZMQ echo), and print "
        "the ratios.",
        run_all,
        format_table,
    )


if __name__ == "__main__":
    sys.exit(main())
