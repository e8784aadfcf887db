"""The observer: a relay between a real D and a real P that decodes and checks every side-channel
frame as it passes.

The harness, as proxy, gives D a ``remote_bootstrap_addr`` pointing at one of the observer's
bootstrap relays. Its ``GET /query`` answers P's real ``/query`` reply with every worker address
rewritten to a ZMQ ROUTER of the observer (one per P worker and view). Each message D sends there
goes on to the real P worker on a new DEALER per D identity, and each reply comes back to D on
that identity, frames untouched. The KV bytes go straight from P to D over the transfer engine.

A view is what a relay shows D of P, each with its own worker endpoints (D remembers P workers
by address) and its own engine id (D caches an engine's entry by its id, for good in vLLM: under
P's own id, a D that met P before would pull from P directly, or from an observer long gone).
``real`` shows P's entry as it is; a legacy view shows it as a legacy (vLLM) bootstrap server
would, with no pdwire/2 field.

Every problem found is recorded with the requirement it breaks; cases check the ones of their
topic. Records and problems are per case (``begin``); what D learned of P (layout echoes,
versions) lasts the run, as it does in D.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Final

import httpx
import msgspec
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdwire.codec import decode_message, decode_response
from pdwire.errors import DecodeError
from pdwire.messages import (
    LeaseHeartbeat,
    XferCancel,
    XferMetadataV2,
    XferResponseStatus,
    XferResponseV2,
)
from pdwire.vectors import as_json

from ..case import WireLog
from ..ports import bind_fresh
from .http import client

#: The requirement of a problem that is the observer's own failure: every case reports it.
HARNESS: Final = "harness"
REAL: Final = "real"
V2_PULL_KEYS: Final = frozenset(
    {"pdwire_version", "pdwire_caps", "fingerprint", "deadline_ms", "auth_tag"}
)
V2_REPLY_KEYS: Final = frozenset(
    {"pdwire_version", "pdwire_caps", "err_code", "err_codes", "auth_tag"}
)
V2_ENTRY_KEYS: Final = ("pdwire_version", "pdwire_caps", "tp_size", "pp_size", "fingerprint")
TERMINAL: Final = frozenset(
    {XferResponseStatus.FINISH, XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS}
)
Worker = tuple[int, int]  # P's (tp_rank, pp_rank)
DWorker = tuple[str, int, int]  # D's (remote_hostname, remote_port, remote_tp_rank)


@dataclasses.dataclass(frozen=True)
class Problem:
    requirement: str
    detail: str


@dataclasses.dataclass
class Reply:
    """One frame P sent back on a relayed message."""

    t: float  # monotonic
    frames: int
    msg: XferResponseV2 | None
    keys: list[str]
    error: str = ""


@dataclasses.dataclass
class Relayed:
    """One message D sent to a P worker through the relay, with P's replies to it."""

    view: str
    worker: Worker
    identity: bytes
    t: float  # monotonic, when it was forwarded
    frames: int
    kind: str  # "pull", "cancel", "heartbeat", or "" when it did not decode
    msg: XferMetadataV2 | XferCancel | LeaseHeartbeat | None
    keys: list[str]
    error: str = ""
    replies: list[Reply] = dataclasses.field(default_factory=list)
    terminal_at: float | None = None  # monotonic, when the terminal reply was forwarded to D

    @property
    def pull(self) -> XferMetadataV2 | None:
        return self.msg if isinstance(self.msg, XferMetadataV2) else None

    @property
    def announced(self) -> bool:
        m = self.msg
        return isinstance(m, XferMetadataV2 | XferCancel) and m.pdwire_version >= 2

    @property
    def d_worker(self) -> DWorker | None:
        """The D worker it names; a heartbeat names none."""
        m = self.msg
        if not isinstance(m, XferMetadataV2 | XferCancel):
            return None
        return m.remote_hostname, m.remote_port, m.remote_tp_rank

    @property
    def caps(self) -> frozenset[str]:
        return (
            frozenset(self.msg.pdwire_caps) if isinstance(self.msg, XferMetadataV2) else frozenset()
        )

    def requests(self) -> dict[str, str]:
        """d_req_id -> transfer_id of the requests it names."""
        if isinstance(self.msg, XferMetadataV2):
            return {d: tid for d, (tid, _) in self.msg.req_blocks.items()}
        if isinstance(self.msg, XferCancel):
            return dict(self.msg.cancel_reqs)
        return {}

    def blocks(self, d_req: str) -> list[list[int]]:
        pull = self.pull
        return list(pull.req_blocks[d_req][1]) if pull and d_req in pull.req_blocks else []

    def listed(self) -> list[str]:
        """Every d_req_id P's replies listed, in ok_reqs or err_reqs, in order."""
        return [
            r
            for reply in self.replies
            if reply.msg
            for r in [*(reply.msg.ok_reqs or []), *(reply.msg.err_reqs or [])]
        ]


@dataclasses.dataclass
class _Peer:
    """What a D worker can know of a P worker: from the view's entry, then from P's replies."""

    version: int
    caps: frozenset[str]


@dataclasses.dataclass
class _Upstream:
    socket: zmq.asyncio.Socket
    reader: asyncio.Task[None]
    record: Relayed
    case: int  # the case (``begin``) in which D sent the message


@dataclasses.dataclass
class _Endpoint:
    view: str
    dp: int
    worker: Worker
    target: str  # the real P worker's address
    router: zmq.asyncio.Socket
    address: str
    reader: asyncio.Task[None] | None = None
    upstreams: dict[bytes, _Upstream] = dataclasses.field(default_factory=dict)


class _Quiet(uvicorn.Server):
    """uvicorn in the harness's own loop: the harness keeps its signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclasses.dataclass
class _Relay:
    view: str
    url: str
    server: _Quiet
    task: asyncio.Task[None]


def _keys(data: bytes) -> list[str]:
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return []
    return [str(k) for k in obj] if isinstance(obj, dict) else []


def _ended(rec: Relayed) -> bool:
    """Whether P's last reply to ``rec`` ended it (an undecodable one does: D gives up)."""
    last = rec.replies[-1].msg if rec.replies else None
    return last is None or last.status in TERMINAL


def _terminal(frames: list[bytes]) -> bool:
    """Whether the reply ``frames`` ends its message, judged from the payload alone."""
    try:
        return decode_response(frames[-1] if frames else b"").status in TERMINAL
    except DecodeError:
        return True


def _endpoint_of(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Observer:
    """Relays and checks the side channel of one P (its bootstrap at ``bootstrap``) and any D."""

    def __init__(
        self,
        bootstrap: str,
        *,
        host: str = "127.0.0.1",
        timeout: float = 10.0,
    ) -> None:
        self.bootstrap = bootstrap.rstrip("/")
        self.host = host
        self.timeout = timeout
        self.log = WireLog()
        self.records: list[Relayed] = []
        self.problems: list[Problem] = []
        self.queries: list[str] = []  # the views D queried in this case
        self.refused: list[str] = []  # why the relay answered D's query with an error, this case
        #: Seconds to hold every reply of a P worker before passing it on (a slow link).
        self.delays: dict[Worker, float] = {}
        self.real_query: dict[str, Any] = {}  # P's last real /query reply
        self._token = uuid.uuid4().hex[:8]
        self._zmq = zmq.asyncio.Context()
        self._http = client(timeout)
        self._relays: dict[str, _Relay] = {}
        self._legacy: dict[str, bool] = {}  # per view: shown as a legacy bootstrap shows it
        self._endpoints: dict[tuple[str, int, int, int], _Endpoint] = {}
        self._echoed: set[tuple[str, str, DWorker, int]] = set()  # (view, address, D, layout_id)
        self._learned: dict[tuple[str, str, DWorker], _Peer] = {}
        self._d_announces: dict[DWorker, frozenset[str]] = {}  # D workers seen announcing: caps
        self._last_frame = time.monotonic()
        self._frame = asyncio.Event()
        self._case = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            got = await self._http.get(f"{self.bootstrap}/query")
            if got.status_code == 200 and isinstance(got.json(), dict):
                self.real_query = got.json()
        await self.add_view(REAL)

    async def add_view(self, view: str, *, legacy: bool = False) -> None:
        """Serve another view: its own relay, engine id and worker endpoints, so that D knows
        nothing of P under it yet."""
        if view not in self._relays:
            self._legacy[view] = legacy
            self._relays[view] = await self._serve(view)

    async def _serve(self, view: str) -> _Relay:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.bind((self.host, 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app(view), log_level="warning", access_log=False, lifespan="off",
            log_config=None, timeout_graceful_shutdown=1,
        )  # fmt: skip
        server = _Quiet(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"observer relay {view}")
        return _Relay(view, f"http://{_endpoint_of(self.host)}:{port}", server, task)

    async def close(self) -> int:
        """Stop relaying, once every message D sent has had P's terminal reply passed on, or
        after ``timeout``; return how many had not: D holds their blocks until its receive
        timeout."""
        await self._until(lambda: not self._unanswered(), self.timeout)
        unanswered = len(self._unanswered())
        for relay in self._relays.values():
            relay.server.should_exit = True
        tasks = [r.task for r in self._relays.values()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=5.0)
            for task in late:
                task.cancel()
        readers = [up.reader for ep in self._endpoints.values() for up in ep.upstreams.values()]
        for ep in self._endpoints.values():
            self._drop_upstreams(ep, unanswered=True)
            if ep.reader is not None:
                ep.reader.cancel()
                readers.append(ep.reader)
        await asyncio.gather(*tasks, *readers, return_exceptions=True)
        for ep in self._endpoints.values():
            ep.router.close(linger=0)
        self._zmq.destroy(linger=0)
        await self._http.aclose()
        return unanswered

    def begin(self, log: WireLog) -> None:
        """Start a case: its wire log; no records, problems or delays yet. A message of an
        earlier case that P has not answered keeps its way back to D: dropped, its answer would
        leave D holding the request's blocks until its receive timeout."""
        self.log = log
        self.records, self.problems, self.queries, self.refused = [], [], [], []
        self.delays = {}
        self._case += 1
        for ep in self._endpoints.values():
            self._drop_upstreams(ep, unanswered=False)

    def _unanswered(self) -> list[_Upstream]:
        return [
            up
            for ep in self._endpoints.values()
            for up in ep.upstreams.values()
            if up.record.terminal_at is None
        ]

    def _drop_upstreams(self, ep: _Endpoint, *, unanswered: bool) -> None:
        """Close the sockets to P whose message had its terminal reply (``unanswered``: all)."""
        for identity, up in list(ep.upstreams.items()):
            if unanswered or up.record.terminal_at is not None:
                up.reader.cancel()
                up.socket.close(linger=0)
                del ep.upstreams[identity]

    # -- what cases ask ----------------------------------------------------------------------

    def url(self, view: str = REAL) -> str:
        """The ``remote_bootstrap_addr`` to give D for ``view``."""
        return self._relays[view].url

    def engine_id(self, engine_id: str, view: str = REAL) -> str:
        """The ``remote_engine_id`` under which ``view`` shows P's engine ``engine_id``: never
        one D may have cached, with the addresses of P itself or of an earlier observer."""
        return f"{engine_id}+{self._token}-{view}"

    def for_transfer(self, transfer_id: str) -> list[tuple[Relayed, str]]:
        """Every message of this case naming ``transfer_id``, with the d_req_id naming it."""
        return [
            (rec, d_req)
            for rec in self.records
            for d_req, tid in rec.requests().items()
            if tid == transfer_id
        ]

    def pulls_for(self, transfer_id: str) -> list[tuple[Relayed, str]]:
        return [(r, d) for r, d in self.for_transfer(transfer_id) if r.kind == "pull"]

    def problems_of(self, *requirements: str) -> list[Problem]:
        wanted = set(requirements)
        return [p for p in self.problems if p.requirement in wanted]

    async def quiet(self, linger: float = 0.2, limit: float = 2.0) -> None:
        """Return once no frame passed for ``linger`` seconds (or after ``limit``): to see that
        nothing more follows a terminal reply."""
        end = time.monotonic() + limit
        while (now := time.monotonic()) < end:
            idle = now - self._last_frame
            if idle >= linger:
                return
            self._frame.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._frame.wait(), min(linger - idle, end - now))

    async def named(self, transfer_id: str, limit: float) -> list[tuple[Relayed, str]]:
        """The pulls naming ``transfer_id``, once there is one (none after ``limit`` seconds)."""
        await self._until(lambda: bool(self.pulls_for(transfer_id)), limit)
        return self.pulls_for(transfer_id)

    async def ended(self, records: list[Relayed], limit: float) -> bool:
        """Wait until each of ``records`` has had its terminal reply passed on to D (False if
        that takes more than ``limit`` seconds)."""
        return await self._until(lambda: all(r.terminal_at is not None for r in records), limit)

    async def _until(self, done: Callable[[], bool], limit: float) -> bool:
        end = time.monotonic() + limit
        while not done():
            now = time.monotonic()
            if now >= end:
                return False
            self._frame.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._frame.wait(), end - now)
        return True

    def p_version(self) -> int:
        """P's wire version as its real /query entries announce it (0: legacy)."""
        entries = [e for e in self.real_query.values() if isinstance(e, dict)]
        versions = [int(e.get("pdwire_version") or 0) for e in entries]
        return min(versions) if versions else 0

    # -- the bootstrap relay -----------------------------------------------------------------

    def _app(self, view: str) -> FastAPI:
        app = FastAPI(title=f"pdwire observer ({view} view)")

        @app.get("/query")
        async def query() -> Response:
            return await self._query(view)

        if view == REAL:

            @app.get("/health")
            async def health() -> Response:
                try:
                    got = await self._http.get(f"{self.bootstrap}/health")
                except httpx.HTTPError as exc:
                    return JSONResponse({"detail": str(exc)}, status_code=502)
                return Response(got.content, got.status_code, media_type="application/json")

        return app

    async def _query(self, view: str) -> Response:
        channel = f"http GET {self.url(view)}/query (relay, {view} view)"
        self.log.received(channel, "D queried the relay")
        self.queries.append(view)
        try:
            got = await self._real_query()
            data = got.json()
        except (httpx.HTTPError, ValueError) as exc:
            return self._refuse(channel, 502, f"P's bootstrap did not answer /query: {exc!r}")
        if got.status_code != 200 or not isinstance(data, dict):
            return self._refuse(channel, got.status_code, f"P's bootstrap answered {data!r}")
        try:
            shown = {dp: self._rewrite(view, int(dp), entry) for dp, entry in data.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return self._refuse(
                channel, 502, f"P's /query reply has no usable worker_addr: {exc!r}"
            )
        except Exception as exc:  # the harness's own failure: the case fails, naming it
            self._harness_error("P's /query reply (relaying its workers)")
            return self._refuse(channel, 500, f"the relay failed: {exc!r}")
        self.real_query = data
        self.log.sent(channel, "HTTP 200 (P's entry, workers relayed)", shown)
        return JSONResponse(shown)

    async def _real_query(self) -> httpx.Response:
        """P's ``GET /query``, sent again once on a new connection when the first attempt got
        no answer: a pooled connection may be closing as it is reused."""
        url = f"{self.bootstrap}/query"
        try:
            return await self._http.get(url)
        except httpx.TransportError as exc:
            self.log.note(f"P's bootstrap did not answer /query ({exc!r}): asking again")
        async with client(self.timeout) as fresh:
            return await fresh.get(url)

    def _refuse(self, channel: str, status: int, why: str) -> Response:
        """Answer D's query with HTTP ``status``, saying ``why``; the case names it."""
        self.refused.append(f"HTTP {status}: {why}")
        self.log.sent(channel, f"HTTP {status}", why)
        return JSONResponse({"detail": why}, status_code=status)

    def _rewrite(self, view: str, dp: int, entry: dict[str, Any]) -> dict[str, Any]:
        shown = dict(entry)
        shown["worker_addr"] = {
            tp: {
                pp: self._endpoint(view, dp, int(tp), int(pp), str(addr))
                for pp, addr in by_pp.items()
            }
            for tp, by_pp in entry["worker_addr"].items()
        }
        if self._legacy[view]:
            for key in V2_ENTRY_KEYS:
                shown.pop(key, None)
        shown["engine_id"] = self.engine_id(str(entry["engine_id"]), view)
        return shown

    def _endpoint(self, view: str, dp: int, tp: int, pp: int, target: str) -> str:
        key = (view, dp, tp, pp)
        ep = self._endpoints.get(key)
        if ep is None:
            router = self._zmq.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            host = _endpoint_of(self.host)
            if host.startswith("["):
                router.setsockopt(zmq.IPV6, 1)
            port = bind_fresh(router, host)
            ep = _Endpoint(view, dp, (tp, pp), target, router, f"tcp://{host}:{port}")
            ep.reader = asyncio.create_task(self._from_d(ep), name=f"relay {ep.address}")
            self._endpoints[key] = ep
        ep.target = target  # P may have restarted on new ports
        return ep.address

    # -- relaying ----------------------------------------------------------------------------

    def _touch(self) -> None:
        self._last_frame = time.monotonic()
        self._frame.set()

    def _problem(self, requirement: str, detail: str) -> None:
        self.problems.append(Problem(requirement, detail))
        self.log.note(f"PROBLEM ({requirement}): {detail}")

    def _harness_error(self, what: str) -> None:
        self.problems.append(Problem(HARNESS, f"the observer failed to check {what}"))
        self.log.note(f"the observer failed to check {what}", traceback.format_exc())

    async def _from_d(self, ep: _Endpoint) -> None:
        while True:
            frames = [bytes(f) for f in await ep.router.recv_multipart()]
            self._touch()
            identity, rest = frames[0], frames[1:]
            up = ep.upstreams.get(identity)
            try:
                rec = self._inspect_from_d(ep, identity, rest, again=up is not None)
            except Exception:  # the observer's own bug: record it, keep relaying
                self._harness_error("a message from D")
                rec = Relayed(
                    ep.view, ep.worker, identity, time.monotonic(), len(rest), "", None, []
                )
            if up is None:
                sock = self._zmq.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if "[" in ep.target:
                    sock.setsockopt(zmq.IPV6, 1)
                try:
                    sock.connect(ep.target)
                except zmq.ZMQError as exc:
                    self.log.note(f"cannot relay to P worker {ep.worker} at {ep.target}: {exc}")
                    sock.close(linger=0)
                    continue
                reader = asyncio.create_task(self._from_p(ep, identity, sock))
                up = ep.upstreams[identity] = _Upstream(sock, reader, rec, self._case)
            else:
                up.record, up.case = rec, self._case
            await up.socket.send_multipart(rest)

    async def _from_p(self, ep: _Endpoint, identity: bytes, sock: zmq.asyncio.Socket) -> None:
        with contextlib.suppress(zmq.ZMQError):
            while True:
                frames = [bytes(f) for f in await sock.recv_multipart()]
                delay = self.delays.get(ep.worker, 0.0)
                if delay > 0:
                    await asyncio.sleep(delay)  # the slow link the case asked for
                up = ep.upstreams.get(identity)
                earlier = up is not None and up.case != self._case
                if earlier:
                    self.log.note(
                        f"P worker {ep.worker} answered a message of an earlier case: passed "
                        "on to D unchecked"
                    )
                elif up is not None:
                    try:
                        self._inspect_from_p(ep, up.record, frames)
                    except Exception:  # the observer's own bug: record it, keep relaying
                        self._harness_error("a reply from P")
                await ep.router.send_multipart([identity, *frames])
                ended = _terminal(frames) if earlier else up is not None and _ended(up.record)
                if up is not None and up.record.terminal_at is None and ended:
                    up.record.terminal_at = time.monotonic()
                self._touch()

    def _channel(self, ep: _Endpoint, to_p: bool) -> str:
        tp, pp = ep.worker
        arrow = "D -> P" if to_p else "P -> D"
        return f"zmq {arrow} worker tp{tp}/pp{pp} via {ep.address} ({ep.view} view)"

    # -- checks: D to P ----------------------------------------------------------------------

    def _inspect_from_d(
        self, ep: _Endpoint, identity: bytes, frames: list[bytes], *, again: bool
    ) -> Relayed:
        data = frames[-1] if frames else b""
        rec = Relayed(
            ep.view, ep.worker, identity, time.monotonic(), len(frames), "", None, _keys(data)
        )
        try:
            kind, msg = decode_message(data)
        except DecodeError as exc:
            rec.error = str(exc)
        else:
            if isinstance(msg, XferResponseV2):
                rec.error = "D sent a reply (XferResponse) to P"
            else:
                rec.kind, rec.msg = kind, msg
        self.records.append(rec)
        summary = rec.kind or f"undecodable: {rec.error}"
        self.log.received(
            self._channel(ep, True), summary, as_json(rec.msg) if rec.msg else data[:256].hex()
        )
        if len(frames) != 1:
            self._problem(
                "3.1-R3", f"D sent a message of {len(frames)} frames to P worker {ep.worker}"
            )
        if again:
            self._problem(
                "3.1-R3", f"D sent a second message on one socket to P worker {ep.worker}"
            )
        if rec.error:
            self._problem(
                "7.3-R1", f"D sent P worker {ep.worker} a message that does not decode: {rec.error}"
            )
            return rec
        if isinstance(rec.msg, XferMetadataV2):
            self._check_pull(ep, rec, rec.msg)
        elif isinstance(rec.msg, XferCancel):
            self._check_cancel(ep, rec)
        return rec

    def _peer(self, ep: _Endpoint, d: DWorker) -> _Peer:
        """What D can know of the P worker behind ``ep``: its last reply, else the view's entry."""
        learned = self._learned.get((ep.view, ep.address, d))
        if learned is not None:
            return learned
        if self._legacy[ep.view]:
            return _Peer(0, frozenset())
        entry = self.real_query.get(str(ep.dp)) or {}
        return _Peer(
            int(entry.get("pdwire_version") or 0), frozenset(entry.get("pdwire_caps") or ())
        )

    def _check_pull(self, ep: _Endpoint, rec: Relayed, pull: XferMetadataV2) -> None:
        d = (pull.remote_hostname, pull.remote_port, pull.remote_tp_rank)
        tids = [tid for tid, _ in pull.req_blocks.values()]
        if len(tids) != len(set(tids)):
            self._problem("3.2-R6", f"two requests of one pull name the same transfer_id: {tids}")
        peer = self._peer(ep, d)
        announced = rec.announced
        v2_keys = sorted(V2_PULL_KEYS & set(rec.keys))
        if peer.version < 2 and v2_keys:
            how = "its last reply" if (ep.view, ep.address, d) in self._learned else "/query"
            self._problem(
                "8.3-R1",
                f"D sent pdwire/2 fields {v2_keys} to P worker {ep.worker}, which it knows to be "
                f"legacy (from {how})",
            )
        if peer.version >= 2 and not announced and d in self._d_announces:
            self._problem(
                "8.3-R1",
                f"D announced pdwire/2 before, but not to P worker {ep.worker}, which it knows "
                "to speak pdwire/2",
            )
        if announced:
            self._d_announces[d] = rec.caps
            carries = bool(pull.kv_caches_base_addr)
            if "fingerprint" in rec.caps and carries and pull.fingerprint is None:
                self._problem(
                    "3.2-R16", "D announced fingerprint but a pull with its layout has none"
                )
        if not pull.kv_caches_base_addr:
            if pull.layout_id == 0:
                self._problem("3.2-R12", "a pull with layout_id 0 carries no layout")
            elif (ep.view, ep.address, d, pull.layout_id) not in self._echoed:
                self._problem(
                    "9.3-R2",
                    f"D omitted its layout ({pull.layout_id:#x}) to P worker {ep.worker}, which "
                    "has not echoed that layout_id",
                )

    def _check_cancel(self, ep: _Endpoint, rec: Relayed) -> None:
        assert isinstance(rec.msg, XferCancel)
        m = rec.msg
        d = (m.remote_hostname, m.remote_port, m.remote_tp_rank)
        peer = self._peer(ep, d)
        d_caps = self._d_announces.get(d, frozenset())
        if peer.version < 2 or "cancel" not in peer.caps or "cancel" not in d_caps:
            self._problem(
                "8.4-R4",
                f"D sent an XferCancel to P worker {ep.worker} without cancel in use (P version "
                f"{peer.version}, P caps {sorted(peer.caps)}, D caps {sorted(d_caps)})",
            )

    # -- checks: P to D ----------------------------------------------------------------------

    def _inspect_from_p(self, ep: _Endpoint, rec: Relayed, frames: list[bytes]) -> None:
        data = frames[-1] if frames else b""
        reply = Reply(time.monotonic(), len(frames), None, _keys(data))
        try:
            reply.msg = decode_response(data)
        except DecodeError as exc:
            reply.error = str(exc)
        first = not rec.replies
        rec.replies.append(reply)
        summary = reply.msg.status.name if reply.msg else f"undecodable: {reply.error}"
        shown = as_json(reply.msg) if reply.msg else data[:256].hex()
        self.log.received(self._channel(ep, False), summary, shown)
        who = f"P worker {ep.worker}"
        if len(frames) != 1:
            self._problem("3.1-R4", f"{who} sent a reply that reached D as {len(frames)} frames")
        if rec.terminal_at is not None:
            self._problem("3.4-R14", f"{who} replied again after its terminal reply ({summary})")
        if reply.msg is None:
            self._problem("7.3-R1", f"{who} sent a reply that does not decode: {reply.error}")
            return
        if rec.kind == "cancel":
            self._check_cancel_reply(who, rec, reply.msg)
        elif rec.kind == "pull" and rec.pull is not None:
            self._check_reply(ep, who, rec, rec.pull, reply, first)

    def _check_reply(
        self, ep: _Endpoint, who: str, rec: Relayed, pull: XferMetadataV2, reply: Reply, first: bool
    ) -> None:
        msg = reply.msg
        assert msg is not None
        d = (pull.remote_hostname, pull.remote_port, pull.remote_tp_rank)
        names = set(pull.req_blocks)
        if msg.status is XferResponseStatus.LAYOUT_MISS:
            if not first:
                self._problem("3.4-R15", f"{who} sent LAYOUT_MISS after other replies")
            if pull.layout_id == 0 or pull.kv_caches_base_addr:
                self._problem(
                    "3.3-R2",
                    f"{who} sent LAYOUT_MISS to a pull that carried its layout or layout_id 0",
                )
            self._echoed.discard((ep.view, ep.address, d, pull.layout_id))
        listed = rec.listed()
        now = (msg.ok_reqs or []) + (msg.err_reqs or [])
        earlier = listed[: len(listed) - len(now)]
        for r in now:
            if r not in names:
                self._problem("3.4-R18", f"{who} listed {r!r}, which the pull did not name")
        twice = sorted({r for r in now if r in earlier} | {r for r in now if now.count(r) > 1})
        if twice:
            self._problem("3.4-R16", f"{who} listed {twice} more than once over the pull's replies")
        if msg.status is XferResponseStatus.FINISH and not names <= set(listed):
            self._problem(
                "3.4-R17",
                f"{who} ended the pull with FINISH without listing {sorted(names - set(listed))}",
            )
        extra = sorted(V2_REPLY_KEYS & set(reply.keys))
        if extra and not rec.announced:
            self._problem(
                "8.4-R3", f"{who} sent pdwire/2 fields {extra} to a pull that did not announce"
            )
        if rec.announced and self.p_version() >= 2 and msg.pdwire_version < 2:
            self._problem(
                "3.4-R7",
                f"{who} (pdwire/2 at its bootstrap) answered an announcing pull without "
                "pdwire_version",
            )
        if msg.layout_id not in (0, pull.layout_id):
            self._problem(
                "3.4-R3",
                f"{who} echoed layout_id {msg.layout_id:#x}, the pull's is {pull.layout_id:#x}",
            )
        codes = set((msg.err_codes or {}).values())
        if msg.err_code is not None:
            codes.add(msg.err_code)
        agreed = "will-not-send" in rec.caps and "will-not-send" in msg.pdwire_caps
        if "WILL_NOT_SEND" in codes and not agreed:
            self._problem("7.2-R3", f"{who} sent WILL_NOT_SEND without will-not-send agreed")
        served = msg.status in (XferResponseStatus.FINISH, XferResponseStatus.CONTINUE)
        if served and pull.layout_id and msg.layout_id == pull.layout_id:
            self._echoed.add((ep.view, ep.address, d, pull.layout_id))
        key = (ep.view, ep.address, d)
        if msg.pdwire_version >= 2:
            self._learned[key] = _Peer(msg.pdwire_version, frozenset(msg.pdwire_caps))
        elif rec.announced:
            self._learned[key] = _Peer(0, frozenset())

    def _check_cancel_reply(self, who: str, rec: Relayed, msg: XferResponseV2) -> None:
        asked = set(rec.requests())
        if msg.status is not XferResponseStatus.FINISH:
            self._problem("3.5-R8", f"{who} answered a cancel with {msg.status.name}, not FINISH")
        stray = sorted(set(msg.ok_reqs or []) - asked)
        if stray:
            self._problem("3.5-R9", f"{who} listed {stray} in its cancel reply, not in the cancel")
