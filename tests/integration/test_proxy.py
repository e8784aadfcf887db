"""The disaggregation proxy over real HTTP on loopback (spec §5.4).

The proxy talks to a real bootstrap server and to scripted P and D engines (``ScriptedEngine``);
every server runs under uvicorn in a thread on a free port. Every wait is bounded by ``WAIT``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdwire.http_models import CLIENT_KEEPALIVE_S, RegisterWorkerPayload
from reference_connector import cli_common
from reference_connector import proxy as proxy_module
from reference_connector.bootstrap import BootstrapServer
from reference_connector.proxy import Prefill, ProxyServer, bootstrap_url, parse_prefill

WAIT = 10.0  # bound of every wait in this module
POLL = 0.05  # the proxy's readiness poll interval here
XFER_ID = re.compile(r"xfer-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
UUID4 = re.compile(XFER_ID.pattern.removeprefix("xfer-"))


# -- scripted engines -------------------------------------------------------------------------


@dataclass
class Seen:
    """One completion request an engine received."""

    path: str
    headers: dict[str, str]  # names in lower case
    body: dict[str, Any]
    port: int  # the client's: a new one is a new connection


@dataclass
class ScriptedEngine:
    """A scripted stand-in for a P or D engine's OpenAI server, whose real counterpart is the
    model-free engine node built elsewhere: it records every completion request and answers as
    its fields say. ``disconnected`` is set when the proxy drops a request it is still serving.
    """

    name: str
    health_status: int = 200
    status: int = 200  # of completions; 400 or more: an error body
    delay: float = 0.0  # before answering (a unary answer) or before the first SSE chunk
    chunks: int = 3  # SSE data events before [DONE]
    chunk_interval: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    disconnected: threading.Event = field(default_factory=threading.Event)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def wait_seen(self, n: int) -> list[Seen]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.seen) >= n, WAIT), self.seen
            return list(self.seen)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse(status_code=self.health_status, content={})

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.name}]}

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> Response:
            return await self._complete(request)

        return app

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        with self._cond:
            port = request.client.port if request.client else 0
            self.seen.append(Seen(request.url.path, dict(request.headers), body, port))
            self._cond.notify_all()
        if body.get("stream"):
            return StreamingResponse(self._sse(), media_type="text/event-stream")
        if not await self._pause(request, self.delay):
            return Response(status_code=499)
        if self.status >= 400:
            return JSONResponse(status_code=self.status, content={"error": f"{self.name} boom"})
        reply = {"engine": self.name, "choices": [{"text": "hi"}], "kv_transfer_params": None}
        return JSONResponse(status_code=self.status, content=reply)

    async def _pause(self, request: Request, seconds: float) -> bool:
        """Wait ``seconds``; False (and ``disconnected`` set) if the client went away first."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.disconnected.set()
                return False
            await asyncio.sleep(0.01)
        return True

    async def _sse(self) -> AsyncIterator[bytes]:
        try:  # a client's disconnect cancels this generator (ASGI spec 2.3)
            await asyncio.sleep(self.delay)
            for i in range(self.chunks):
                if i:
                    await asyncio.sleep(self.chunk_interval)
                yield f"data: {json.dumps({'n': i, 'engine': self.name})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnected.set()
            raise


class Served:
    """A scripted app under uvicorn in a daemon thread, on a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", log_config=None)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + WAIT
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "upstream start"
            self._thread.join(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(WAIT)
        self._sock.close()


# -- the cluster ------------------------------------------------------------------------------


@dataclass
class Cluster:
    bootstrap: BootstrapServer
    prefill: ScriptedEngine
    prefill_server: Served
    decodes: list[ScriptedEngine]
    proxy: ProxyServer
    http: httpx.Client

    def register(self, dp_rank: int = 0) -> None:
        register(self.bootstrap, dp_rank)

    def complete(self, path: str = "/v1/completions", **body: Any) -> httpx.Response:
        return self.http.post(path, json={"model": "m", "prompt": "hello", **body})


def engine_id(dp_rank: int) -> str:
    return f"engine-dp{dp_rank}"


def register(bootstrap: BootstrapServer, dp_rank: int) -> None:
    """Register one P worker (tp 0, pp 0) of ``dp_rank`` with the bootstrap server."""
    payload = RegisterWorkerPayload(
        engine_id=engine_id(dp_rank),
        dp_rank=dp_rank,
        tp_rank=0,
        pp_rank=0,
        addr=f"tcp://127.0.0.1:{17000 + dp_rank}",
        pdwire_version=2,
    )
    r = httpx.post(f"{bootstrap.url}/register", json=payload.dump(), timeout=WAIT)
    assert r.status_code == 200, r.text


ClusterFactory = Callable[..., Cluster]


@pytest.fixture
def make_cluster() -> Iterator[ClusterFactory]:
    """Bootstrap server, one scripted P, scripted Ds and a proxy; every one stopped at the end."""
    stops: list[Callable[[], None]] = []

    def make(
        *,
        decodes: int = 1,
        dp_ranks: int = 1,
        ready: bool = True,
        prefill: ScriptedEngine | None = None,
        **proxy_kwargs: Any,
    ) -> Cluster:
        bootstrap = BootstrapServer().start(port=0)
        stops.append(bootstrap.stop)
        for dp in range(dp_ranks if ready else 0):  # all before the proxy reads them once
            register(bootstrap, dp)
        p = prefill or ScriptedEngine("P")
        p_server = Served(p.app())
        stops.append(p_server.stop)
        ds = [ScriptedEngine(f"D{i}") for i in range(decodes)]
        d_servers: list[Served] = []
        for d in ds:
            d_servers.append(Served(d.app()))
            stops.append(d_servers[-1].stop)
        proxy = ProxyServer(
            [Prefill(p_server.url, bootstrap.url)],
            [s.url for s in d_servers],
            poll_interval=POLL,
            **proxy_kwargs,
        )
        stops.append(proxy.start(port=0).stop)
        http = httpx.Client(base_url=proxy.url, timeout=WAIT)
        stops.append(http.close)  # at once with the servers: its connections are idle by then
        cluster = Cluster(bootstrap, p, p_server, ds, proxy, http)
        if ready:
            proxy.wait_ready(WAIT)
        return cluster

    try:
        yield make
    finally:
        stop_all(stops)


def stop_all(stops: list[Callable[[], None]]) -> None:
    """Run every stop at once: uvicorn takes a tick of its loop to notice it should exit."""
    threads = [threading.Thread(target=stop) for stop in stops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def kv(seen: Seen) -> dict[str, Any]:
    params: dict[str, Any] = seen.body["kv_transfer_params"]
    return params


# -- readiness --------------------------------------------------------------------------------


def test_503_with_the_reason_until_ready(make_cluster: ClusterFactory) -> None:
    c = make_cluster(ready=False, prefill=ScriptedEngine("P", health_status=503))
    p_url, b_url = c.prefill_server.url, c.bootstrap.url

    def reason_has(text: str) -> bool:
        r = c.http.get("/health")
        return r.status_code == 503 and text in r.json()["reason"]

    eventually(lambda: reason_has("/health answered 503"), "P's 503 in the reason")
    r = c.complete()
    assert r.status_code == 503
    assert (
        r.json()["error"]["message"]
        == f"waiting for prefill {p_url}: GET {p_url}/health answered 503"
    )

    c.prefill.health_status = 200  # the proxy keeps polling
    missing = f"waiting for prefill {p_url}: bootstrap {b_url} has no engine yet"
    eventually(lambda: reason_has(missing), "the bootstrap's missing engine in the reason")
    r = c.complete()
    assert (r.status_code, r.json()["error"]["message"]) == (503, missing)
    assert c.prefill.seen == [] and c.decodes[0].seen == []

    c.register()
    eventually(lambda: c.http.get("/health").status_code == 200, "readiness")
    assert c.http.get("/health").json() == {"status": "ok"}
    r = c.complete()
    assert r.status_code == 200 and r.json()["engine"] == "D0"


# -- the two legs ------------------------------------------------------------------------------


def test_the_legs_carry_what_the_spec_says(make_cluster: ClusterFactory) -> None:
    c = make_cluster()
    client_body = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 20,
        "max_completion_tokens": 20,
        "stream": False,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "kv_transfer_params": {"transfer_id": "xfer-from-the-client"},  # 5.4-R4: not taken
    }
    r = c.http.post("/v1/completions", json=client_body, headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200 and r.json()["engine"] == "D0"
    [p] = c.prefill.wait_seen(1)
    [d] = c.decodes[0].wait_seen(1)

    assert p.path == d.path == "/v1/completions"
    assert p.body["max_tokens"] == 1 and p.body["max_completion_tokens"] == 1
    assert p.body["stream"] is False and "stream_options" not in p.body
    assert p.body["temperature"] == 0.5 and p.body["prompt"] == "hello"
    transfer_id = kv(p)["transfer_id"]
    assert XFER_ID.fullmatch(transfer_id)
    assert kv(p) == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
        "pdwire_version": 2,
    }
    assert {k: v for k, v in d.body.items() if k != "kv_transfer_params"} == {
        k: v for k, v in client_body.items() if k != "kv_transfer_params"
    }
    assert kv(d) == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": c.bootstrap.url,
        "remote_engine_id": engine_id(0),
        "transfer_id": transfer_id,
        "pdwire_version": 2,
    }
    assert p.headers["x-request-id"] == d.headers["x-request-id"] == "req-42"
    assert p.headers["x-data-parallel-rank"] == "0" and "x-data-parallel-rank" not in d.headers
    assert "authorization" not in p.headers and "authorization" not in d.headers  # 5.4-R11


def test_generated_request_ids_and_transfer_ids_are_fresh(make_cluster: ClusterFactory) -> None:
    c = make_cluster()
    for _ in range(2):
        assert c.complete(path="/v1/chat/completions", messages=[]).status_code == 200
    ps, ds = c.prefill.wait_seen(2), c.decodes[0].wait_seen(2)
    by_id = {p.headers["x-request-id"]: p for p in ps}
    assert len(by_id) == 2 and all(UUID4.fullmatch(rid) for rid in by_id)
    for d in ds:
        p = by_id[d.headers["x-request-id"]]
        assert p.path == d.path == "/v1/chat/completions"
        assert kv(p)["transfer_id"] == kv(d)["transfer_id"]
    assert len({kv(d)["transfer_id"] for d in ds}) == 2


def test_round_robin_over_decodes_and_dp_ranks(make_cluster: ClusterFactory) -> None:
    c = make_cluster(decodes=2, dp_ranks=2)
    engines = [c.complete().json()["engine"] for _ in range(4)]
    assert engines == ["D0", "D1", "D0", "D1"]
    ps = c.prefill.wait_seen(4)
    ranks = {p.headers["x-request-id"]: p.headers["x-data-parallel-rank"] for p in ps}
    assert sorted(ranks.values()) == ["0", "0", "1", "1"]
    for d in c.decodes[0].seen + c.decodes[1].seen:  # D got the engine id of P's dp rank
        assert kv(d)["remote_engine_id"] == engine_id(int(ranks[d.headers["x-request-id"]]))


def test_api_key_goes_on_both_legs(make_cluster: ClusterFactory) -> None:
    c = make_cluster(api_key="sekrit")
    assert c.complete().status_code == 200
    [p], [d] = c.prefill.wait_seen(1), c.decodes[0].wait_seen(1)
    assert p.headers["authorization"] == d.headers["authorization"] == "Bearer sekrit"


def test_legacy_profile_sends_no_pdwire_version(make_cluster: ClusterFactory) -> None:
    c = make_cluster(profile="legacy")
    assert c.complete().status_code == 200
    [p], [d] = c.prefill.wait_seen(1), c.decodes[0].wait_seen(1)
    assert set(kv(p)) == {"do_remote_decode", "do_remote_prefill", "transfer_id"}
    assert set(kv(d)) == {
        "do_remote_decode",
        "do_remote_prefill",
        "remote_bootstrap_addr",
        "remote_engine_id",
        "transfer_id",
    }


def test_decode_answers_pass_through(make_cluster: ClusterFactory) -> None:
    c = make_cluster()
    c.decodes[0].status = 418
    r = c.complete()
    assert (r.status_code, r.json()) == (418, {"error": "D0 boom"})
    models = c.http.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"] == [{"id": "D0"}]


# -- streaming ----------------------------------------------------------------------------------


def read_events(response: httpx.Response) -> list[tuple[float, str]]:
    """The SSE events of a streamed response, each with when it was complete."""
    events, buffer = [], ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            events.append((time.monotonic(), event))
    return events


def test_streaming_passes_chunks_through_as_they_come(make_cluster: ClusterFactory) -> None:
    c = make_cluster()
    c.decodes[0].chunks, c.decodes[0].chunk_interval = 4, 0.2
    with c.http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = read_events(r)
    data = [e for _, e in events]
    assert data[:-1] == [f'data: {{"n": {i}, "engine": "D0"}}' for i in range(4)]
    assert data[-1] == "data: [DONE]"
    times = [t for t, _ in events]
    assert times[3] - times[0] > 0.45  # the first chunk came long before the last
    [p] = c.prefill.wait_seen(1)
    assert p.body["stream"] is False


# -- P-leg failures ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_error_is_a_502_and_cancels_decode(
    make_cluster: ClusterFactory, stream: bool
) -> None:
    c = make_cluster(prefill=ScriptedEngine("P", status=500))
    c.decodes[0].delay = WAIT  # D waits for KV that never comes
    started = time.monotonic()
    r = c.complete(stream=stream)
    assert r.status_code == 502 and time.monotonic() - started < WAIT / 2
    assert r.json() == {
        "error": {"message": 'prefill failed: 500 {"error":"P boom"}', "type": "prefill_error"}
    }
    assert c.decodes[0].disconnected.wait(WAIT), "D's request was not cancelled"
    assert c.proxy.proxy.prefill_failures == 1


def test_prefill_down_is_a_502(make_cluster: ClusterFactory) -> None:
    c = make_cluster()
    c.prefill_server.stop()
    c.decodes[0].delay = WAIT
    r = c.complete()
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["type"] == "prefill_error"
    assert error["message"].startswith("prefill failed: ConnectError")
    assert c.decodes[0].disconnected.wait(WAIT)


def test_prefill_failure_mid_stream_ends_the_stream_with_an_error(
    make_cluster: ClusterFactory,
) -> None:
    c = make_cluster(prefill=ScriptedEngine("P", status=503, delay=0.4))
    c.decodes[0].chunks, c.decodes[0].chunk_interval = 50, 0.1
    with c.http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 200
        events = [e for _, e in read_events(r)]
    assert 1 <= len(events) < 50 and events[0].startswith('data: {"n": 0')
    assert events[-1].startswith("event: error\ndata: ")
    error = json.loads(events[-1].split("data: ", 1)[1])["error"]
    assert error == {"message": 'prefill failed: 503 {"error":"P boom"}', "type": "prefill_error"}
    assert "data: [DONE]" not in events
    assert c.decodes[0].disconnected.wait(WAIT)


# -- the command line ---------------------------------------------------------------------------


def test_parse_prefill() -> None:
    assert parse_prefill("http://p:8100") == Prefill("http://p:8100", "http://p:8998")
    assert parse_prefill("http://p:8100/@9000").bootstrap == "http://p:9000"
    assert parse_prefill("http://p:8100@none").bootstrap == "http://p:8998"
    assert parse_prefill("http://p:8100@http://b:7000/") == Prefill(
        "http://p:8100", "http://b:7000"
    )
    assert bootstrap_url("http://[::1]:8100") == "http://[::1]:8998"
    with pytest.raises(ValueError):
        parse_prefill("p:8100")


def test_cli_serves_until_sigint() -> None:
    cmd = [
        sys.executable,
        "-m",
        "reference_connector.cli_proxy",
        "--prefill",
        "http://127.0.0.1:9@none",
        "--decode",
        "http://127.0.0.1:9",
        "--port",
        "0",
        "--profile",
        "legacy",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    ) as proc:
        _serve_then_interrupt(proc)


def _serve_then_interrupt(proc: subprocess.Popen[str]) -> None:
    try:
        line = _read_line(proc)
        match = re.fullmatch(r"proxy \(legacy\) at (http://\S+)\n", line)
        assert match, line
        health = httpx.get(f"{match[1]}/health", timeout=WAIT)
        assert health.status_code == 503
        assert "waiting for prefill http://127.0.0.1:9" in health.json()["reason"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT) == cli_common.EXIT_OK
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)


def _read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(WAIT), "the proxy printed nothing"
    return proc.stdout.readline()


def test_a_connection_idle_past_the_keepalive_expiry_is_not_reused(
    make_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy reuses a connection to an engine, but not one idle for CLIENT_KEEPALIVE_S,
    which is well below the 5 s after which uvicorn (vLLM's API server) closes an idle one: a
    request sent on a connection as the server closes it fails unanswered. (Here the expiry is
    shortened, so the test waits it out in a fraction of a second.)"""
    assert uvicorn.Config(FastAPI()).timeout_keep_alive >= CLIENT_KEEPALIVE_S + 2
    short = 0.3
    monkeypatch.setattr(proxy_module, "CLIENT_KEEPALIVE_S", short)
    c = make_cluster()
    d = c.decodes[0]
    for _ in range(2):
        assert c.complete().status_code == 200
    time.sleep(2 * short)  # the subject is an idle connection: nothing to await
    assert c.complete().status_code == 200
    first, again, after_idle = (seen.port for seen in d.wait_seen(3))
    assert first == again, "the proxy did not reuse a connection at all"
    assert after_idle != again, "the proxy reused a connection idle past its expiry"
