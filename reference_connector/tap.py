"""``pdwire tap``: a live view of the side channel between a running D and P.

The tap is a bootstrap front (§4) before P's bootstrap server. It answers ``GET /query`` with
P's own reply, each worker address replaced by a relay of the tap's: a ROUTER that D's DEALERs
connect to. For each DEALER of D the relay opens a DEALER of its own to the P worker and moves
every message both ways unchanged, frames and bytes as they came; then it hands a copy to the
``Observer``, which names and decodes it. Every other route is passed to P's bootstrap server
as it is. D is pointed at the tap by one address: its ``remote_bootstrap_addr``, which the
proxy sends (``pdwire proxy --prefill URL@TAP``). The Mooncake writes themselves go from P to D
directly; the tap sees the pulls that order them and the replies that report them.

Everything runs on the HTTP server's event loop: the relays are created by the first ``/query``
that names a worker, and closed when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import httpx
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from pdwire.observer import FINAL, Observer, Seen

from .http_server import AppServer
from .http_tls import client_tls

logger = logging.getLogger(__name__)

#: How long the relay keeps a DEALER to P after it passed that connection's final reply: a P
#: that sends more on it is still seen.
CLOSE_AFTER_FINAL_S: Final = 1.0
_FINAL_NAMES: Final = frozenset(s.name for s in FINAL)
_UPSTREAM_TIMEOUT_S: Final = 10.0

Sink = Callable[[dict[str, Any]], None]


class _Relay:
    """One P worker's relay: a ROUTER for D, a DEALER to the worker per DEALER of D."""

    def __init__(self, tap: TapServer, upstream: str, label: str, host: str) -> None:
        self._tap = tap
        self.upstream = upstream
        self.label = label
        self._front = tap.zmq.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._backs: dict[bytes, tuple[int, zmq.asyncio.Socket, asyncio.Task[None]]] = {}
        self._task = asyncio.create_task(self._from_d(), name=f"tap {label} from D")

    async def _from_d(self) -> None:
        while True:
            identity, *frames = await self._front.recv_multipart()
            at = time.time()
            if identity not in self._backs:
                self._open(identity)
            conn, back, _ = self._backs[identity]
            try:
                await back.send_multipart(frames)
            except zmq.ZMQError as exc:  # D's message is lost as it would be without the tap
                logger.warning("tap %s: not passed on to %s: %s", self.label, self.upstream, exc)
            self._tap.observe(Seen(at, conn, True, self.label, frames))

    def _open(self, identity: bytes) -> None:
        back = self._tap.zmq.socket(zmq.DEALER)
        back.setsockopt(zmq.LINGER, 0)
        back.connect(self.upstream)
        conn = next(self._tap.conns)
        reader = asyncio.create_task(self._from_p(identity, conn, back), name=f"tap conn {conn}")
        self._backs[identity] = (conn, back, reader)

    async def _from_p(self, identity: bytes, conn: int, back: zmq.asyncio.Socket) -> None:
        while True:
            frames = await back.recv_multipart()
            at = time.time()
            try:
                await self._front.send_multipart([identity, *frames])
            except zmq.ZMQError as exc:
                logger.warning("tap %s: reply not passed on to D: %s", self.label, exc)
            record = self._tap.observe(Seen(at, conn, False, self.label, frames))
            if record.get("status") in _FINAL_NAMES:
                asyncio.get_running_loop().call_later(CLOSE_AFTER_FINAL_S, self._close, identity)

    def _close(self, identity: bytes) -> None:
        entry = self._backs.pop(identity, None)
        if entry is not None:
            entry[2].cancel()
            entry[1].close(linger=0)

    def close(self) -> None:
        self._task.cancel()
        for identity in list(self._backs):
            self._close(identity)
        self._front.close(linger=0)


class TapServer(AppServer):
    """The tap: ``start()`` serves the bootstrap front; records go to ``sink`` as they come
    (only those ``follow`` keeps), and ``summary()`` gives the verdict of each transfer."""

    name = "tap"
    lifespan = "on"

    def __init__(
        self,
        upstream: str,
        sink: Sink,
        *,
        follow: str | None = None,
        relay_host: str = "127.0.0.1",
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.observer = Observer(follow)
        self.conns = itertools.count(1)
        self.zmq = zmq.asyncio.Context()
        self._sink = sink
        self._relay_host = relay_host
        self._relays: dict[str, _Relay] = {}
        self._lock = threading.Lock()  # the observer: the loop records, summary() reads
        super().__init__(self._app())

    def observe(self, seen: Seen) -> dict[str, Any]:
        """Record ``seen`` and give its record to the sink; never raises into a relay."""
        try:
            with self._lock:
                record = self.observer.see(seen)
        except Exception as exc:
            logger.exception("tap: the observer failed on a message")
            record = {"t": seen.at, "conn": seen.conn, "kind": "raw", "error": repr(exc)}
            record["frames"] = [f.hex() for f in seen.frames]
        if self.observer.shown(record):
            try:
                self._sink(record)
            except Exception:
                logger.exception("tap: the sink failed on a record")
        return record

    def summary(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.observer.summary(time.time())

    def relay_for(self, addr: str, label: str) -> str:
        """The relay address D is given for the P worker at ``addr`` (on the loop)."""
        if addr not in self._relays:
            self._relays[addr] = _Relay(self, addr, label, self._relay_host)
        return self._relays[addr].address

    def _app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with httpx.AsyncClient(
                timeout=_UPSTREAM_TIMEOUT_S, verify=client_tls()
            ) as client:
                app.state.client = client
                try:
                    yield
                finally:
                    for relay in self._relays.values():
                        relay.close()
                    self._relays.clear()
                    self.zmq.destroy(linger=0)

        app = FastAPI(title="pdwire tap", lifespan=lifespan)

        @app.get("/query")
        async def query(request: Request) -> Response:
            got = await _forward(request, self.upstream, "/query")
            if got.status_code != 200:
                return got
            try:
                entries = _json(got)
                for entry in entries.values():
                    for tp, stages in entry["worker_addr"].items():
                        for pp, addr in stages.items():
                            stages[pp] = self.relay_for(addr, f"tp{tp}/pp{pp}")
            except (ValueError, KeyError, AttributeError, TypeError) as exc:
                detail = f"P's bootstrap server answered /query with {got.body!r}: {exc}"
                return JSONResponse({"detail": detail}, status_code=502)
            return JSONResponse(entries)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def passed(request: Request, path: str) -> Response:
            return await _forward(request, self.upstream, f"/{path}")

        return app


def _json(response: Response) -> dict[str, Any]:
    value = json.loads(bytes(response.body))
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


async def _forward(request: Request, upstream: str, path: str) -> Response:
    """``request`` sent on to ``upstream``; its answer, or 502 naming why there is none."""
    client: httpx.AsyncClient = request.app.state.client
    url = f"{upstream}{path}"
    try:
        got = await client.request(
            request.method,
            url,
            params=request.query_params,
            content=await request.body(),
            headers={k: v for k, v in request.headers.items() if k.lower() == "content-type"},
        )
    except httpx.HTTPError as exc:
        detail = f"P's bootstrap server at {upstream} did not answer: {type(exc).__name__} {exc}"
        return JSONResponse({"detail": detail}, status_code=502)
    kept = {k: v for k, v in got.headers.items() if k.lower() == "content-type"}
    return Response(got.content, status_code=got.status_code, headers=kept)
