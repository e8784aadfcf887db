"""The fake P: a bootstrap server and P workers that a D under test pulls from.

The bootstrap server is a small FastAPI app served by uvicorn in the harness's own loop; what
its ``/query`` serves is set per case (versions, sizes, missing workers, other engines, a raw
body). Each P worker is one ROUTER on a random loopback port: every message D sends it is kept,
in arrival order, for the case to take (``next``) and answer (``reply``, ``send_raw``). ``write``
puts the fake P's own bytes (random, so never the prompt's KV) into the D blocks a pull names,
with the harness's transfer engine and pdwire's planning, as a real P places them (§10.8).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pdwire import auth, error_strings
from pdwire.codec import decode_cancel, decode_heartbeat, decode_pull, encode_response
from pdwire.errors import DecodeError
from pdwire.messages import (
    Fingerprint,
    LeaseHeartbeat,
    XferCancel,
    XferMetadataV2,
    XferResponseStatus,
    XferResponseV2,
)
from pdwire.planning import Descriptors, PlanError, Region, Side, descriptors, prepare
from pdwire.planning import regions_of_pull as pull_regions
from pdwire.vectors import as_json
from pdwire.versions import CURRENT_VERSION, LEGACY, PDWIRE_2, Capability

from ..case import CaseFailed, WireLog
from ..ports import bind_fresh
from .engine import Engine
from .loop_server import LoopServer, bind
from .rawpack import map_keys

#: What a fake P announces unless a case says otherwise (no ``auth``: it has no key).
DEFAULT_CAPS: Final = frozenset(
    {Capability.CANCEL, Capability.WILL_NOT_SEND, Capability.DEADLINE, Capability.FINGERPRINT}
)
SOURCE_BYTES: Final = 1 << 22
_LayoutKey = tuple[str, int, int, int, int, int]


@dataclasses.dataclass
class Received:
    """One message at a fake P worker's ROUTER: a pull, a cancel, or something undecodable."""

    t: float  # monotonic time of arrival
    worker: tuple[int, int]  # (tp_rank, pp_rank) of the fake P worker
    addr: str
    identity: bytes
    frames: list[bytes]  # as the ROUTER got them: [identity, payload] for one frame sent
    kind: str  # "pull", "cancel", "heartbeat"
    pull: XferMetadataV2 | None = None
    cancel: XferCancel | None = None
    heartbeat: LeaseHeartbeat | None = None
    error: DecodeError | None = None

    @property
    def data(self) -> bytes:
        return self.frames[-1]

    @property
    def keys(self) -> list[str]:
        """The top-level keys of the payload as sent ([] when it is not a map)."""
        return map_keys(self.data)

    @property
    def announced(self) -> bool:
        return self.pull is not None and self.pull.pdwire_version >= 2

    @property
    def auth_tag(self) -> bytes | None:
        """The tag of the pull or cancel, which the tags of its replies cover (8.6-R13)."""
        m: XferMetadataV2 | XferCancel | None = self.pull or self.cancel
        return m.auth_tag if m is not None else None

    @property
    def with_layout(self) -> bool:
        return self.pull is not None and bool(self.pull.kv_caches_base_addr)

    @property
    def sender(self) -> tuple[str, int, int]:
        """The D worker that sent it: (host, transfer-engine port, TP rank)."""
        m: XferMetadataV2 | XferCancel | None = self.pull or self.cancel
        assert m is not None
        return m.remote_hostname, m.remote_port, m.remote_tp_rank

    def d_req(self, transfer_id: str) -> str:
        """D's request id for ``transfer_id`` in this pull."""
        assert self.pull is not None
        for d_req, (tid, _) in self.pull.req_blocks.items():
            if tid == transfer_id:
                return d_req
        raise CaseFailed(
            f"D's pull names no request for transfer_id {transfer_id}: "
            f"{ {d: t for d, (t, _) in self.pull.req_blocks.items()} }"
        )

    def describe(self) -> str:
        if self.error is not None:
            return f"an undecodable {self.kind} ({self.error})"
        if self.cancel is not None:
            return f"a cancel of {self.cancel.cancel_reqs}"
        if self.heartbeat is not None:
            return f"a lease renewal of {self.heartbeat.lease_transfer_ids}"
        assert self.pull is not None
        reqs = {d: t for d, (t, _) in self.pull.req_blocks.items()}
        release = not any(any(groups) for _, groups in self.pull.req_blocks.values())
        what = "a release-only pull" if release else "a pull"
        return f"{what} for {reqs} (pdwire_version {self.pull.pdwire_version})"


@dataclasses.dataclass(frozen=True)
class FakePConfig:
    tp: int = 1
    pp: int = 1
    version: int | None = CURRENT_VERSION  # None: a legacy P, no pdwire/2 field anywhere
    caps: frozenset[str] = DEFAULT_CAPS
    engine_id: str = ""  # "" = a random one
    dp_rank: int = 0
    sizes: bool = True  # pdwire/2: tp_size and pp_size in the /query entry
    fingerprint: Fingerprint | None = None
    health: bool = True  # serve GET /health (a vLLM bootstrap server does not)
    auth_key: bytes | None = None  # sign pdwire/2 replies with it (§8.6), and announce ``auth``
    #: how the workers answer a lease renewal (§3.9): "finish" (a P with a lease), "error" (a
    #: P without one) or "none" (no answer at all)
    heartbeat_reply: str = "finish"


#: Every source byte is ``random & KEEP | SET``: 0x30-0x3F or 0xB0-0xBF. Read as bf16, fp16,
#: fp32 or either fp8 format, such bytes are finite numbers of magnitude about 2^-31 to 2^1,
#: never a NaN or an infinity: a D whose attention reads the unused slots of a block that once
#: held them (a masked product of 0 and NaN is NaN) keeps giving numbers its sampler can take.
KEEP, SET = 0x8F, 0x30


class Source:
    """Registered memory of random bytes (finite as any KV dtype, ``KEEP``) that every fake P
    writes from."""

    def __init__(self, engine: Engine, seed: int = 5) -> None:
        self._engine = engine
        self._rng = np.random.default_rng(seed)
        self.addr, self.size = self._allocate(SOURCE_BYTES)

    def _allocate(self, nbytes: int) -> tuple[int, int]:
        buf, addr = self._engine.allocate(nbytes, 0)
        buf[:] = self._rng.integers(0, 256, nbytes, dtype=np.uint8) & KEEP | SET
        return addr, nbytes

    def reserve(self, nbytes: int) -> int:
        """The address of ``nbytes`` of random source bytes."""
        if nbytes > self.size:
            self.addr, self.size = self._allocate(max(nbytes, 2 * self.size))
        return self.addr


@dataclasses.dataclass
class _Worker:
    tp: int
    pp: int
    sock: zmq.asyncio.Socket
    addr: str
    reader: asyncio.Task[None] | None = None


class FakeP:
    """One fake P engine: its bootstrap server and its TP × PP workers."""

    def __init__(
        self,
        config: FakePConfig,
        *,
        ctx: zmq.asyncio.Context,
        engine: Engine,
        source: Source,
        log: WireLog,
        host: str = "127.0.0.1",
    ) -> None:
        self.config = config
        self.engine_id = config.engine_id or f"fake-p-{uuid.uuid4().hex[:12]}"
        self.log = log
        self.host = host
        self.hold_query = 0.0  # answer each /query this much later
        self.hidden: set[tuple[int, int]] = set()  # workers left out of the /query entry
        self.others: dict[str, dict[str, Any]] = {}  # further /query entries, by dp rank
        self.query_body: Callable[[], Any] | None = None  # serve this instead
        self.queries: list[float] = []  # arrival time of each GET /query
        self.history: list[Received] = []
        #: every lease renewal D sent, answered as ``config.heartbeat_reply`` says and kept out
        #: of the messages a case takes with ``next``
        self.heartbeats: list[Received] = []
        self._ctx = ctx
        self._engine = engine
        self._source = source
        self._inbox: list[Received] = []
        self._arrived = asyncio.Event()
        self._workers: dict[tuple[int, int], _Worker] = {}
        self._layouts: dict[_LayoutKey, tuple[Region, ...]] = {}
        self._server: LoopServer | None = None
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> FakeP:
        self._open_workers()
        self._server = LoopServer(self._app(), bind(host=self.host))
        self.url = self._server.url
        return self

    def stop(self) -> asyncio.Task[None] | None:
        """Close the workers now; the bootstrap server winds down in the returned task."""
        self._close_workers()
        if self._server is None:
            return None
        server, self._server = self._server, None
        return server.stop()

    def _open_workers(self) -> None:
        for pp in range(self.config.pp):
            for tp in range(self.config.tp):
                sock = self._ctx.socket(zmq.ROUTER)
                sock.setsockopt(zmq.LINGER, 0)
                port = bind_fresh(sock, self.host)
                w = _Worker(tp, pp, sock, f"tcp://{self.host}:{port}")
                w.reader = asyncio.create_task(self._read(w))
                self._workers[tp, pp] = w

    def _close_workers(self) -> None:
        for w in self._workers.values():
            if w.reader is not None:
                w.reader.cancel()
            w.sock.close(linger=0)
        self._workers.clear()

    def restart_workers(self) -> None:
        """P restarted: the same engine id, every worker on a new port, no layout cached."""
        old = [w.addr for w in self._workers.values()]
        self._close_workers()
        self._layouts.clear()
        self._open_workers()
        self.log.note(f"fake P restarted its workers: {old} -> {self.addrs()}")

    # -- the bootstrap server ----------------------------------------------------------------

    def addr(self, tp: int = 0, pp: int = 0) -> str:
        return self._workers[tp, pp].addr

    def addrs(self) -> list[str]:
        return [w.addr for w in self._workers.values()]

    def entry(self) -> dict[str, Any]:
        """This engine's /query entry (§4.2)."""
        c = self.config
        workers: dict[str, dict[str, str]] = {}
        for (tp, pp), w in sorted(self._workers.items()):
            if (tp, pp) not in self.hidden:
                workers.setdefault(str(tp), {})[str(pp)] = w.addr
        entry: dict[str, Any] = {"engine_id": self.engine_id, "worker_addr": workers}
        if c.version is not None:
            entry.update(pdwire_version=c.version, pdwire_caps=sorted(c.caps))
            if c.sizes:
                entry.update(tp_size=c.tp, pp_size=c.pp)
            if c.fingerprint is not None:
                entry["fingerprint"] = dataclasses.asdict(c.fingerprint)
        return entry

    def _app(self) -> FastAPI:
        app = FastAPI()
        channel = f"http {self.host} bootstrap"

        @app.get("/query")
        async def query() -> JSONResponse:
            self.queries.append(time.monotonic())
            self.log.received(channel, f"GET /query (#{len(self.queries)})")
            if self.hold_query > 0:
                await asyncio.sleep(self.hold_query)  # a slow server, on purpose
            body = (
                self.query_body()
                if self.query_body is not None
                else {**self.others, str(self.config.dp_rank): self.entry()}
            )
            self.log.sent(channel, "HTTP 200 (the /query reply)", body)
            return JSONResponse(body)

        if self.config.health:

            @app.get("/health")
            async def health() -> dict[str, str]:
                self.log.received(channel, "GET /health")
                return {"status": "ok"}

        return app

    # -- the workers -------------------------------------------------------------------------

    async def _read(self, w: _Worker) -> None:
        channel = f"zmq {w.addr}"
        while True:
            frames = [bytes(f) for f in await w.sock.recv_multipart()]
            rx = _received(w, frames)
            if rx.pull is not None and rx.pull.layout_id and rx.with_layout:
                self._layouts[_layout_key(rx.pull)] = pull_regions(rx.pull)
            msg = rx.pull or rx.cancel or rx.heartbeat
            data = as_json(msg) if msg is not None else [f.hex()[:512] for f in frames[1:]]
            self.log.received(channel, f"{len(frames) - 1} frame(s): {rx.describe()}", data)
            self.history.append(rx)
            if rx.heartbeat is not None:
                self.heartbeats.append(rx)
                await self._renewed(rx)
                continue
            self._inbox.append(rx)
            self._arrived.set()

    async def _renewed(self, rx: Received) -> None:
        how = self.config.heartbeat_reply
        if how == "finish":
            await self.reply(rx, announce=False)
        elif how == "error":
            await self.reply(
                rx, XferResponseStatus.ERROR, announce=False, err_msg=error_strings.LEASE_NOT_SET
            )

    def renewals(self, transfer_id: str) -> list[Received]:
        """The lease renewals D sent that name ``transfer_id``, in arrival order."""
        return [
            rx
            for rx in self.heartbeats
            if rx.heartbeat is not None and transfer_id in rx.heartbeat.lease_transfer_ids
        ]

    async def next(
        self, timeout: float, match: Callable[[Received], bool] | None = None
    ) -> Received | None:
        """The first message not taken yet (that ``match`` accepts), waiting up to ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for i, rx in enumerate(self._inbox):
                if match is None or match(rx):
                    return self._inbox.pop(i)
            left = deadline - loop.time()
            if left <= 0:
                return None
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    def pending(self) -> list[Received]:
        """Messages that arrived and were not taken."""
        return list(self._inbox)

    def holds_layout(self, rx: Received) -> bool:
        """Whether this fake P has the layout of ``rx`` (in it, or cached under its id)."""
        p = rx.pull
        return p is not None and (rx.with_layout or _layout_key(p) in self._layouts)

    async def send_raw(self, rx: Received, data: bytes, what: str, logged: Any = None) -> None:
        """Send ``data`` as the one frame of a reply to ``rx`` (on its identity)."""
        w = self._workers.get(rx.worker)
        if w is None:
            raise CaseFailed(f"the fake P worker {rx.worker} is gone")
        await w.sock.send_multipart([rx.identity, data])
        self.log.sent(f"zmq {w.addr}", what, logged if logged is not None else data.hex()[:512])

    async def reply(
        self,
        rx: Received,
        status: XferResponseStatus = XferResponseStatus.FINISH,
        *,
        announce: bool | None = None,
        **fields: Any,
    ) -> None:
        """Answer ``rx`` as a P would (``response``)."""
        if announce is None:
            announce = self._announces(rx)
        msg = self.response(rx, status, announce=announce, **fields)
        data = encode_response(msg, PDWIRE_2 if announce else LEGACY)
        summary = f"{status.name} ok={msg.ok_reqs} err={msg.err_reqs}"
        await self.send_raw(rx, data, summary, as_json(msg))

    def _announces(self, rx: Received) -> bool:
        return self.config.version is not None and rx.announced

    def response(
        self,
        rx: Received,
        status: XferResponseStatus = XferResponseStatus.FINISH,
        *,
        ok: Sequence[str] = (),
        err: Sequence[str] = (),
        err_msg: str | None = None,
        echo: bool = True,
        layout_id: int | None = None,
        announce: bool | None = None,
        **v2: Any,
    ) -> XferResponseV2:
        """The reply a P would send ``rx``: with this P's version and caps when both sides
        speak pdwire/2 (``announce`` overrides), echoing the layout id when it holds the
        layout, signed when this P has a key (unless ``auth_tag`` is given)."""
        if announce is None:
            announce = self._announces(rx)
        if layout_id is None:
            terminal_ok = status in (XferResponseStatus.FINISH, XferResponseStatus.CONTINUE)
            keep = echo and terminal_ok and rx.pull is not None and self.holds_layout(rx)
            layout_id = rx.pull.layout_id if keep and rx.pull is not None else 0
        fields: dict[str, Any] = {
            "status": status,
            "ok_reqs": list(ok),
            "err_reqs": list(err),
            "err_msg": err_msg,
            "layout_id": layout_id,
        }
        if announce:
            fields.update(
                pdwire_version=self.config.version or CURRENT_VERSION,
                pdwire_caps=sorted(self.config.caps),
            )
        fields.update(v2)
        msg = XferResponseV2(**fields)
        if announce and self.config.auth_key is not None and "auth_tag" not in v2:
            msg = auth.sign(msg, self.config.auth_key, answers=rx.auth_tag)
        return msg

    async def serve(self, rx: Received) -> None:
        """Write every request of the pull, then FINISH listing them ok."""
        assert rx.pull is not None
        self.write(rx)
        await self.reply(rx, ok=list(rx.pull.req_blocks))

    # -- writing D's blocks ------------------------------------------------------------------

    def write(self, rx: Received, reqs: Collection[str] | None = None) -> int:
        """Write random bytes into the D blocks of ``reqs`` (every request of the pull when
        None) where a P of this TP/PP would (§10.7, §10.8); return the bytes written."""
        pull = rx.pull
        if pull is None:
            raise CaseFailed(f"cannot write for {rx.describe()}")
        regions = pull_regions(pull) or self._layouts.get(_layout_key(pull), ())
        if not regions:
            raise CaseFailed("the pull omits its layout and the fake P holds none for its id")
        if any(r.kv_block_len == 0 for r in regions):
            raise CaseFailed("D's pull gives no kv_block_lens: the fake P cannot place bytes")
        d_side = Side(pull.remote_tp_size, pull.remote_tp_rank, pull.remote_pp_size, regions)
        wanted = [
            (d_req, groups)
            for d_req, (_, groups) in pull.req_blocks.items()
            if (reqs is None or d_req in reqs) and any(groups)
        ]
        if not wanted:
            return 0
        depth = max(len(g) for _, groups in wanted for g in groups)
        p_side = self._producer_side(rx.worker, d_side, pull, depth)
        plan = prepare(p_side, d_side)
        if isinstance(plan, PlanError):
            raise CaseFailed(f"D's layout cannot be served: {plan.message}")
        parts = []
        for d_req, groups in wanted:
            d = descriptors(plan, [list(range(len(g))) for g in groups], groups)
            if isinstance(d, PlanError):
                raise CaseFailed(f"D's blocks for {d_req} cannot be served: {d.message}")
            parts.append(d)
        batch = Descriptors.concat(parts)
        peer = f"{pull.remote_hostname}:{pull.remote_port}"
        status = self._engine.write(
            peer, batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()
        )
        self.log.note(
            f"wrote {batch.total_bytes} random bytes in {len(batch)} descriptors into {peer}: "
            f"status {status}"
        )
        if status != 0:
            raise CaseFailed(
                f"the transfer engine could not write into {peer} (status {status}): do "
                "remote_hostname and remote_port name D's transfer engine?"
            )
        return batch.total_bytes

    def _producer_side(
        self, worker: tuple[int, int], d: Side, pull: XferMetadataV2, depth: int
    ) -> Side:
        """A P worker of this fake P's TP/PP whose regions mirror D's: the same layers (its own
        stage's, when the PP sizes differ), with payloads sized for the TP ratio, laid out one
        after another over the random source bytes."""
        c = self.config
        tp_rank, pp_rank = worker
        held = d.regions
        if c.pp > 1 and d.pp_size != c.pp:
            total = pull.fingerprint.num_layers if pull.fingerprint else None
            total = total or 1 + max(r.layer_index for r in d.regions)
            per = -(-total // c.pp)
            stage = range(pp_rank * per, (pp_rank + 1) * per)
            held = tuple(r for r in d.regions if r.layer_index in stage)
        lengths = []
        for r in held:
            length, rest = divmod(r.kv_block_len * d.tp_size, c.tp)
            if rest:
                raise CaseFailed(
                    f"D's payload of {r.kv_block_len} bytes per block at TP {d.tp_size} does not "
                    f"split over the fake P's TP {c.tp}"
                )
            lengths.append(length)
        base = self._source.reserve(depth * sum(lengths))
        regions = []
        for r, length in zip(held, lengths, strict=True):
            regions.append(
                dataclasses.replace(r, base_addr=base, block_len=length, kv_block_len=length)
            )
            base += depth * length
        return Side(c.tp, tp_rank, c.pp, tuple(regions))


def _layout_key(pull: XferMetadataV2) -> _LayoutKey:
    """How a P keys a cached layout (3.7-R9)."""
    return (
        pull.remote_hostname,
        pull.remote_port,
        pull.remote_tp_rank,
        pull.remote_pp_size,
        pull.remote_tp_size,
        pull.layout_id,
    )


def _received(w: _Worker, frames: list[bytes]) -> Received:
    payload = frames[-1] if len(frames) > 1 else b""
    rx = Received(time.monotonic(), (w.tp, w.pp), w.addr, frames[0], frames, "pull")
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        obj = None
    try:
        if isinstance(obj, dict) and "cancel_reqs" in obj:
            rx.kind = "cancel"
            rx.cancel = decode_cancel(payload)
        elif isinstance(obj, dict) and "lease_transfer_ids" in obj:
            rx.kind = "heartbeat"
            rx.heartbeat = decode_heartbeat(payload)
        else:
            rx.pull = decode_pull(payload)
    except DecodeError as exc:
        rx.error = exc
    return rx
