"""The fake backends a proxy under test is pointed at (§5.4): P's and D's OpenAI API servers and
P's bootstrap server.

Each is a small FastAPI app served by uvicorn in the harness's own loop on a loopback port.
Every request is kept as a ``Hit`` (headers, body, when it arrived, when it was answered, whether
the caller went away first) and written to the case's wire log. How each answers is set per case:
health, a delay, an HTTP error, D's streamed chunks; ``stop`` makes a server refuse connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..case import WireLog
from .loop_server import LoopServer, bind

MODEL: Final = "pdwire-fake"
POLL_S: Final = 0.02  # how often a held answer checks whether its caller went away


@dataclasses.dataclass
class Hit:
    """One request a fake backend received."""

    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: Any  # the decoded JSON body (None when there is none)
    arrived: float  # monotonic
    answered: float | None = None  # when its answer (or a stream's first bytes) was sent
    finished: float | None = None  # when the whole answer was sent
    aborted: float | None = None  # when the caller went away before the answer was complete
    answer: Any = None  # the body answered, when not streamed
    status: int | None = None  # the HTTP status answered, when not streamed
    chunks: list[tuple[float, bytes]] = dataclasses.field(default_factory=list)  # streamed

    @property
    def params(self) -> dict[str, Any]:
        """The body's ``kv_transfer_params`` ({} when it has none)."""
        p = self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        return p if isinstance(p, dict) else {}

    @property
    def prompt(self) -> Any:
        return self.body.get("prompt") if isinstance(self.body, dict) else None

    def streamed(self) -> bytes:
        return b"".join(c for _, c in self.chunks)


class Backend:
    """A recording FastAPI server; subclasses add the routes."""

    name = "backend"

    def __init__(self, log: WireLog) -> None:
        self.log = log
        self.hits: list[Hit] = []
        self.url = ""
        self._arrived = asyncio.Condition()
        self._server: LoopServer | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def start(self, sock: socket.socket | None = None) -> None:
        self._server = LoopServer(self._app(), sock or bind())
        self.url = self._server.url

    async def stop(self) -> None:
        """Stop serving and close the port: connections to it are refused from now on."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await server.stop()
        self.log.note(f"fake {self.name} at {self.url} stopped: it refuses connections now")

    def _app(self) -> FastAPI:
        raise NotImplementedError

    async def record(self, request: Request) -> Hit:
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        hit = Hit(
            request.method,
            request.url.path,
            {k.lower(): v for k, v in request.headers.items()},
            body,
            time.monotonic(),
        )
        self.hits.append(hit)
        self.log.received(
            f"http fake {self.name} {request.method} {request.url.path}",
            "request",
            {"headers": hit.headers, "body": body},
        )
        async with self._arrived:
            self._arrived.notify_all()
        return hit

    def answered(self, hit: Hit, status: int, body: Any) -> None:
        hit.answered = hit.finished = time.monotonic()
        hit.answer, hit.status = body, status
        self.log.sent(f"http fake {self.name} {hit.method} {hit.path}", f"HTTP {status}", body)

    async def wait(self, match: Callable[[Hit], bool], timeout: float) -> Hit | None:
        """The first hit ``match`` accepts, waiting up to ``timeout`` seconds for it."""

        def found() -> Hit | None:
            return next((h for h in self.hits if match(h)), None)

        async with self._arrived:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait_for(lambda: found() is not None), timeout)
        return found()

    def of(self, path: str) -> list[Hit]:
        return [h for h in self.hits if h.path == path]


async def hold(request: Request, hit: Hit, seconds: float) -> bool:
    """Wait ``seconds`` before answering; False (and ``hit.aborted`` set) when the caller went
    away meanwhile."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if await request.is_disconnected():
            hit.aborted = time.monotonic()
            return False
        await asyncio.sleep(min(POLL_S, left))
    return True


class FakeAPI(Backend):
    """An engine's OpenAI API as vLLM's API server answers: P's (``role`` prefill: one token,
    ``kv_transfer_params`` null, §5.3) or D's (the text, streamed when asked)."""

    def __init__(self, role: str, log: WireLog) -> None:
        super().__init__(log)
        self.role = role
        self.name = f"{'P' if role == 'prefill' else 'D'} API"
        self.reset()

    def reset(self) -> None:
        """The default behaviour: healthy, answering at once."""
        self.health = 200  # the status of GET /health
        self.delay = 0.0  # seconds before a completion's answer starts
        self.fail_status: int | None = None  # answer completions with this HTTP status
        self.fail_message = ""  # the error message of such an answer
        self.chunks = 4  # data events of a streamed answer, before [DONE]
        self.chunk_delay = 0.0  # seconds between them

    def completion_body(self, hit: Hit) -> dict[str, Any]:
        tokens = 1 if self.role == "prefill" else 4
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {"index": 0, "text": self._text(0), "logprobs": None, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens},
            "kv_transfer_params": None,
        }

    def _text(self, i: int) -> str:
        return f" {self.role}-{i}-{uuid.uuid4().hex[:8]}"

    def _event(self, i: int) -> bytes:
        body = {
            "id": "cmpl-stream",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": self._text(i), "finish_reason": None}],
        }
        return f"data: {json.dumps(body)}\n\n".encode()

    def _app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health(request: Request) -> Response:
            hit = await self.record(request)
            self.answered(hit, self.health, None)
            return Response(status_code=self.health)

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            hit = await self.record(request)
            body = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            self.answered(hit, 200, body)
            return JSONResponse(body)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._complete(request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._complete(request)

        return app

    async def _complete(self, request: Request) -> Response:
        hit = await self.record(request)
        if not await hold(request, hit, self.delay):
            self.log.note(f"the proxy closed its {self.name} leg before the answer")
            return Response(status_code=499)
        if self.fail_status is not None:
            error = {"error": {"message": self.fail_message, "type": "fake_error"}}
            self.answered(hit, self.fail_status, error)
            return JSONResponse(error, status_code=self.fail_status)
        if isinstance(hit.body, dict) and hit.body.get("stream") is True:
            hit.answered = time.monotonic()
            return StreamingResponse(self._stream(hit), media_type="text/event-stream")
        body = self.completion_body(hit)
        self.answered(hit, 200, body)
        return JSONResponse(body)

    async def _stream(self, hit: Hit) -> AsyncIterator[bytes]:
        channel = f"http fake {self.name} {hit.method} {hit.path}"
        try:
            for i in range(self.chunks + 1):
                if i:
                    await asyncio.sleep(self.chunk_delay)
                data = self._event(i) if i < self.chunks else b"data: [DONE]\n\n"
                hit.chunks.append((time.monotonic(), data))
                self.log.sent(channel, f"stream chunk {i}", data.decode())
                yield data
            hit.finished = time.monotonic()
        finally:
            if hit.finished is None:
                hit.aborted = time.monotonic()
                self.log.note(f"the proxy closed its {self.name} stream after {len(hit.chunks)}")


class FakeBootstrap(Backend):
    """P's bootstrap server: ``GET /query`` answers one engine id per DP rank (§4.2)."""

    name = "bootstrap"

    def __init__(self, log: WireLog, dp_ranks: int = 2) -> None:
        super().__init__(log)
        tag = uuid.uuid4().hex[:8]
        self.engines = {dp: f"fake-p-{tag}-dp{dp}" for dp in range(dp_ranks)}
        self.status = 200  # of GET /query

    def entries(self) -> dict[str, Any]:
        return {
            str(dp): {"engine_id": e, "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{20000 + dp}"}}}
            for dp, e in self.engines.items()
        }

    def _app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)

        @app.get("/query")
        async def query(request: Request) -> JSONResponse:
            hit = await self.record(request)
            body: Any = self.entries() if self.status == 200 else {"detail": "not ready"}
            self.answered(hit, self.status, body)
            return JSONResponse(body, status_code=self.status)

        @app.get("/health")
        async def health(request: Request) -> JSONResponse:
            hit = await self.record(request)
            self.answered(hit, 200, {"status": "ok"})
            return JSONResponse({"status": "ok"})

        return app
