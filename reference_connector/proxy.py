"""The disaggregation proxy (spec §5.4): each client completion goes to a P engine for the prompt
(``max_tokens`` 1) and, at the same time, to a D engine that loads P's KV and answers the client.

Unlike vLLM's example proxy (wire facts §3.2), it retries P's readiness until it succeeds, reports
a failed P leg to the client (HTTP 502, or an SSE ``event: error`` frame once D's stream has
started) and aborts the D leg, and sends ``Authorization`` only when it has a key.

``create_app`` starts its readiness task and its HTTP clients in the app's lifespan, so serve it
with lifespan on; ``ProxyServer`` does (uvicorn in a daemon thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdwire import http_models
from pdwire.http_models import (
    CLIENT_KEEPALIVE_S,
    DecodeParams,
    PrefillParams,
    QueryResponse,
    bootstrap_url,
)
from pdwire.versions import LEGACY, WIRE_VERSION, check_profile

from . import bootstrap_client
from .body_limit import COMPLETION_BODY_LIMIT, BodyLimit
from .bootstrap_client import BootstrapError
from .http_server import AppServer
from .http_tls import client_tls
from .metrics import CONTENT_TYPE, Counts, render

logger = logging.getLogger(__name__)

POLL_INTERVAL_S: Final = 1.0  # vLLM's proxy polls P's /health every second (5.4-R1)
HEALTH_TIMEOUT_S: Final = 2.0
BOOTSTRAP_TIMEOUT_S: Final = 2.0
CONNECT_TIMEOUT_S: Final = 10.0  # connecting to an upstream, when completions have no timeout
EXCERPT_CHARS: Final = 500  # of an upstream's error body, in the message to the client
SSE_MEDIA_TYPE: Final = "text/event-stream"
T = TypeVar("T")


@dataclass(frozen=True)
class Prefill:
    """A P engine: its OpenAI server and its bootstrap server (default ``http://<host>:8998``)."""

    url: str
    bootstrap: str = ""

    def __post_init__(self) -> None:
        if urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"prefill URL must be http(s)://host:port, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        bootstrap = self.bootstrap.rstrip("/") or bootstrap_url(self.url)
        object.__setattr__(self, "bootstrap", bootstrap)


def parse_prefill(spec: str) -> Prefill:
    """``URL[@BOOTSTRAP]`` (``pdwire.http_models.parse_prefill``)."""
    return Prefill(*http_models.parse_prefill(spec))


@dataclass(frozen=True)
class Target:
    """One P DP rank a P leg can go to."""

    prefill: Prefill
    dp_rank: int
    engine_id: str
    pdwire_version: int | None


@dataclass(frozen=True)
class _Legs:
    """What one client request was routed to."""

    path: str
    request_id: str
    transfer_id: str
    target: Target
    decode: str


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})


def _outcome(response: Response) -> str:
    """``ok``, or the ``type`` of the proxy's own error, or ``decode_status`` for an error of
    D's that the proxy relays: by the start of the response (a stream may still end badly)."""
    if response.status_code < 400:
        return "ok"
    try:
        kind = json.loads(bytes(response.body))["error"]["type"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return "decode_status"
    return {"service_unavailable": "unavailable", "invalid_request_error": "bad_request"}.get(
        kind, kind if kind in ("prefill_error", "decode_error") else "decode_status"
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _sse_error(message: str, kind: str, tail: bytes) -> bytes:
    """An SSE ``event: error`` frame; a blank line first ends a partly relayed event."""
    data = json.dumps({"error": {"message": message, "type": kind}})
    clean = not tail or tail.endswith((b"\n\n", b"\r\n\r\n"))
    return (b"" if clean else b"\n\n") + f"event: error\ndata: {data}\n\n".encode()


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    return await anext(chunks, None)


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait for it; a response it produced meanwhile is closed."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        result = task.result()
        if isinstance(result, httpx.Response):
            await result.aclose()


async def _race(work: asyncio.Task[T], prefill: asyncio.Task[str | None]) -> str | None:
    """Wait for ``work`` unless the P leg fails first: then cancel ``work`` and return P's failure.

    A P failure found together with ``work`` done is left for the next call.
    """
    try:
        if not prefill.done():
            await asyncio.wait({work, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            failure = prefill.result()
            if failure is not None:
                await _cancel(work)
                return failure
            await asyncio.wait({work})
    except asyncio.CancelledError:  # the client went away, or the server stops
        work.cancel()
        raise
    return None


class Readiness:
    """Start-up: wait for each P's ``/health``, then read its engines from its bootstrap server
    (5.4-R1), retrying every ``poll_interval`` seconds until every P has at least one engine."""

    def __init__(self, prefills: list[Prefill], poll_interval: float) -> None:
        self.prefills = prefills
        self.poll_interval = poll_interval
        self.targets: list[Target] = []
        self.waiting: dict[str, str] = {p.url: "not checked yet" for p in prefills}

    @property
    def ready(self) -> bool:
        return bool(self.targets)

    def reason(self) -> str:
        waiting = [f"waiting for prefill {url}: {why}" for url, why in self.waiting.items()]
        return "; ".join(waiting) or "starting"

    async def run(self, clients: dict[str, httpx.AsyncClient]) -> None:
        found = await asyncio.gather(*(self._wait_for(p, clients[p.url]) for p in self.prefills))
        self.targets = [t for targets in found for t in targets]
        logger.info("proxy ready: %d prefill DP ranks", len(self.targets))

    async def _wait_for(self, prefill: Prefill, client: httpx.AsyncClient) -> list[Target]:
        while True:
            try:
                outcome = await self._check(prefill, client)
            except Exception as exc:  # keep trying whatever happens (vLLM's task dies here)
                logger.exception("readiness check of %s failed", prefill.url)
                outcome = f"check failed: {_describe(exc)}"
            if isinstance(outcome, list):
                self.waiting.pop(prefill.url, None)
                return outcome
            if self.waiting.get(prefill.url) != outcome:
                logger.info("waiting for prefill %s: %s", prefill.url, outcome)
                self.waiting[prefill.url] = outcome
            await asyncio.sleep(self.poll_interval)

    async def _check(self, prefill: Prefill, client: httpx.AsyncClient) -> list[Target] | str:
        """The prefill's DP ranks, or why it is not ready."""
        try:
            health = await client.get("/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"GET {prefill.url}/health failed: {_describe(exc)}"
        if health.status_code != 200:
            return f"GET {prefill.url}/health answered {health.status_code}"
        try:
            engines = await bootstrap_client.query(
                prefill.bootstrap, timeout=BOOTSTRAP_TIMEOUT_S, attempts=1
            )
        except (BootstrapError, httpx.HTTPError) as exc:
            return f"bootstrap {prefill.bootstrap}: {exc}"
        if not engines.root:
            return f"bootstrap {prefill.bootstrap} has no engine yet"
        return _targets(prefill, engines)


def _targets(prefill: Prefill, engines: QueryResponse) -> list[Target]:
    targets = [
        Target(prefill, dp, entry.engine_id, entry.pdwire_version)
        for dp, entry in sorted(engines.root.items())
    ]
    for t in targets:
        logger.info(
            "prefill %s dp_rank %d: engine %s (pdwire_version %s)",
            prefill.url,
            t.dp_rank,
            t.engine_id,
            t.pdwire_version,
        )
    return targets


class Proxy:
    """The proxy's state and request handling; ``create_app`` wires it to routes."""

    def __init__(
        self,
        prefills: list[Prefill],
        decodes: list[str],
        *,
        profile: str,
        api_key: str | None,
        client_timeout: float | None,
        poll_interval: float,
    ) -> None:
        if not prefills or not decodes:
            raise ValueError("the proxy needs at least one prefill and one decode")
        self.profile = check_profile(profile)
        self.version = None if self.profile == LEGACY else WIRE_VERSION[self.profile]
        self.decodes = [d.rstrip("/") for d in decodes]
        self.api_key = api_key or None
        self.client_timeout = client_timeout
        self.readiness = Readiness(prefills, poll_interval)
        self.prefill_failures = 0
        self.counts = Counts()
        self.clients: dict[str, httpx.AsyncClient] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._targets: Iterator[Target] | None = None
        self._decode_cycle = itertools.cycle(self.decodes)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(
            self.client_timeout, connect=self.client_timeout or CONNECT_TIMEOUT_S
        )
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=CLIENT_KEEPALIVE_S
        )
        for url in [p.url for p in self.readiness.prefills] + self.decodes:
            if url not in self.clients:
                self.clients[url] = httpx.AsyncClient(
                    base_url=url, timeout=timeout, limits=limits, verify=client_tls()
                )
        self._spawn(self.readiness.run(self.clients))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for client in self.clients.values():
            await client.aclose()

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- routes ---------------------------------------------------------------------------

    def health(self) -> JSONResponse:
        if self.readiness.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            status_code=503, content={"status": "starting", "reason": self.readiness.reason()}
        )

    async def models(self) -> Response:
        try:
            r = await self.clients[self.decodes[0]].get("/v1/models", headers=self._auth())
        except httpx.HTTPError as exc:
            return _error(502, f"decode failed: {_describe(exc)}", "decode_error")
        return _relay_response(r)

    async def completion(self, request: Request, path: str) -> Response:
        response = await self._completion(request, path)
        self.counts.inc("pdwire_proxy_requests_total", _outcome(response))
        return response

    async def _completion(self, request: Request, path: str) -> Response:
        if not self.readiness.ready:  # 5.4-R2
            return _error(503, self.readiness.reason(), "service_unavailable")
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(400, f"the body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        legs = self._route(path, request.headers.get("x-request-id"))
        prefill = self._spawn(self._prefill_leg(legs, body))  # 5.4-R7: both legs at once
        if body.get("stream") is True:
            return await self._streaming(legs, body, prefill)
        return await self._unary(legs, body, prefill)

    # -- one request ----------------------------------------------------------------------

    def _route(self, path: str, request_id: str | None) -> _Legs:
        if self._targets is None:
            self._targets = itertools.cycle(self.readiness.targets)
        return _Legs(
            path=path,
            request_id=request_id or str(uuid.uuid4()),  # 5.4-R8
            transfer_id=f"xfer-{uuid.uuid4()}",  # 5.4-R3, R4
            target=next(self._targets),
            decode=next(self._decode_cycle),
        )

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}  # 5.4-R10, R11

    def prefill_body(self, legs: _Legs, body: dict[str, Any]) -> dict[str, Any]:
        """The P leg's body (5.4-R5, 5.1-R1)."""
        out = {k: v for k, v in body.items() if k != "stream_options"}
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        out["stream"] = False
        params = PrefillParams(transfer_id=legs.transfer_id, pdwire_version=self.version)
        out["kv_transfer_params"] = params.dump()
        return out

    def decode_body(self, legs: _Legs, body: dict[str, Any]) -> dict[str, Any]:
        """The D leg's body: the client's, with D's ``kv_transfer_params`` (5.4-R6, 5.2-R1)."""
        params = DecodeParams(
            remote_bootstrap_addr=legs.target.prefill.bootstrap,
            remote_engine_id=legs.target.engine_id,
            transfer_id=legs.transfer_id,
            pdwire_version=self.version,
        )
        return {**body, "kv_transfer_params": params.dump()}

    async def _prefill_leg(self, legs: _Legs, body: dict[str, Any]) -> str | None:
        """Send the P leg; None when P answered 2xx, else the failure for the client."""
        target = legs.target
        headers = {
            "X-Request-Id": legs.request_id,
            "X-data-parallel-rank": str(target.dp_rank),  # 5.4-R9
            **self._auth(),
        }
        client = self.clients[target.prefill.url]
        try:
            r = await client.post(legs.path, json=self.prefill_body(legs, body), headers=headers)
        except httpx.HTTPError as exc:
            return self._prefill_failed(legs, _describe(exc))
        if not r.is_success:
            return self._prefill_failed(legs, f"{r.status_code} {r.text[:EXCERPT_CHARS]}".strip())
        return None

    def _prefill_failed(self, legs: _Legs, what: str) -> str:
        self.prefill_failures += 1
        logger.warning(
            "request %s (%s): P leg to %s dp_rank %d failed (%d so far): %s",
            legs.request_id,
            legs.transfer_id,
            legs.target.prefill.url,
            legs.target.dp_rank,
            self.prefill_failures,
            what,
        )
        return f"prefill failed: {what}"

    def _decode_request(self, legs: _Legs, body: dict[str, Any]) -> httpx.Request:
        headers = {"X-Request-Id": legs.request_id, **self._auth()}
        client = self.clients[legs.decode]
        return client.build_request(
            "POST", legs.path, json=self.decode_body(legs, body), headers=headers
        )

    async def _unary(
        self, legs: _Legs, body: dict[str, Any], prefill: asyncio.Task[str | None]
    ) -> Response:
        client = self.clients[legs.decode]
        decode = asyncio.create_task(client.send(self._decode_request(legs, body)))
        failure = await _race(decode, prefill)
        if failure is not None:  # 5.4-R14, R15
            return _error(502, failure, "prefill_error")
        try:
            return _relay_response(decode.result())
        except httpx.HTTPError as exc:
            return _decode_failed(legs, exc)

    async def _streaming(
        self, legs: _Legs, body: dict[str, Any], prefill: asyncio.Task[str | None]
    ) -> Response:
        client = self.clients[legs.decode]
        send = asyncio.create_task(client.send(self._decode_request(legs, body), stream=True))
        failure = await _race(send, prefill)
        if failure is not None:
            return _error(502, failure, "prefill_error")
        try:
            response = send.result()
        except httpx.HTTPError as exc:
            return _decode_failed(legs, exc)
        if not response.is_success:
            await response.aread()
            return _relay_response(response)
        return await self._start_stream(legs, response, prefill)

    async def _start_stream(
        self, legs: _Legs, response: httpx.Response, prefill: asyncio.Task[str | None]
    ) -> Response:
        """Commit to streaming on D's first bytes: a P failure before them is still a 502."""
        chunks = response.aiter_bytes()
        first = asyncio.create_task(_next_chunk(chunks))
        failure = await _race(first, prefill)
        if failure is not None:
            await response.aclose()
            return _error(502, failure, "prefill_error")
        try:
            chunk = first.result()
        except httpx.HTTPError as exc:
            await response.aclose()
            return _decode_failed(legs, exc)
        stream = _relay_stream(chunk, chunks, response, prefill)
        return StreamingResponse(
            stream, status_code=response.status_code, media_type=SSE_MEDIA_TYPE
        )


def _relay_response(r: httpx.Response) -> Response:
    media_type = r.headers.get("content-type", "application/json")
    return Response(content=r.content, status_code=r.status_code, media_type=media_type)


def _decode_failed(legs: _Legs, exc: BaseException) -> JSONResponse:
    logger.warning("request %s: D leg to %s failed: %r", legs.request_id, legs.decode, exc)
    return _error(502, f"decode failed: {_describe(exc)}", "decode_error")


async def _relay_stream(
    first: bytes | None,
    chunks: AsyncIterator[bytes],
    response: httpx.Response,
    prefill: asyncio.Task[str | None],
) -> AsyncIterator[bytes]:
    """D's SSE bytes as they come; a P failure ends the stream with an ``event: error`` frame."""
    chunk, tail = first, b""
    try:
        while chunk is not None:
            yield chunk
            tail = (tail + chunk)[-4:]
            following = asyncio.create_task(_next_chunk(chunks))
            failure = await _race(following, prefill)
            if failure is not None:
                yield _sse_error(failure, "prefill_error", tail)
                return
            chunk = following.result()
    except httpx.HTTPError as exc:
        logger.warning("D's stream broke off: %r", exc)
        yield _sse_error(f"decode failed: {_describe(exc)}", "decode_error", tail)
    finally:
        with anyio.CancelScope(shield=True):
            await response.aclose()


def create_app(
    prefills: list[Prefill],
    decodes: list[str],
    *,
    profile: str = "pdwire/2",
    api_key: str | None = None,
    client_timeout: float | None = None,
    poll_interval: float = POLL_INTERVAL_S,
) -> FastAPI:
    """The proxy app; its state is ``app.state.proxy`` (a ``Proxy``).

    Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (503 until ready, 502
    ``prefill_error`` when the P leg fails before D's response is complete), ``GET /health``
    (200 once ready, else 503 with the reason), ``GET /v1/models`` (from the first decode).
    ``client_timeout`` bounds each completion leg (None: no bound, as vLLM's proxy).
    """
    proxy = Proxy(
        prefills,
        decodes,
        profile=profile,
        api_key=api_key,
        client_timeout=client_timeout,
        poll_interval=poll_interval,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="pdwire proxy", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=COMPLETION_BODY_LIMIT)
    app.state.proxy = proxy

    @app.get("/health")
    async def health() -> JSONResponse:
        return proxy.health()

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(proxy.counts.snapshot(), {}), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.completion(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.completion(request, "/v1/chat/completions")

    return app


class ProxyServer(AppServer):
    """``create_app`` served by uvicorn (lifespan on) in a daemon thread."""

    name = "proxy"
    lifespan = "on"

    def __init__(
        self,
        prefills: list[Prefill],
        decodes: list[str],
        *,
        profile: str = "pdwire/2",
        api_key: str | None = None,
        client_timeout: float | None = None,
        poll_interval: float = POLL_INTERVAL_S,
    ) -> None:
        super().__init__(
            create_app(
                prefills,
                decodes,
                profile=profile,
                api_key=api_key,
                client_timeout=client_timeout,
                poll_interval=poll_interval,
            )
        )
        self.proxy: Proxy = self.app.state.proxy

    def wait_ready(self, timeout: float) -> None:
        """Wait until every prefill is ready; ``TimeoutError`` with the reason otherwise."""
        deadline = time.monotonic() + timeout
        while not self.proxy.readiness.ready:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"proxy not ready after {timeout}s: {self.proxy.readiness.reason()}"
                )
            time.sleep(0.02)
