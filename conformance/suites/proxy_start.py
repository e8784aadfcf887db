"""Proxy cases: start-up (§5.4): P's health, its bootstrap server, 503 until ready, port 8998."""

from __future__ import annotations

import asyncio
import random
import socket
import time

from pdwire.http_models import DEFAULT_BOOTSTRAP_PORT

from ..case import Unsupported, case, expect
from ..peers.loop_server import bind
from .proxy_env import ProxyCtx, World

#: Bound on each start-up step: vLLM's proxy polls every second.
STEP_S = 5.0
#: How long completions keep getting 503 while P is unhealthy: long enough for what the proxy
#: read from a /query it sent anyway to take effect, even on a loaded machine.
WATCH_S = 1.5


async def _polled(w: World) -> None:
    """Wait until the proxy has polled P's /health twice, or queried P's bootstrap server."""
    deadline = time.monotonic() + STEP_S
    while len(w.p.of("/health")) < 2 and not w.bootstrap.of("/query"):
        expect(
            time.monotonic() < deadline,
            f"the proxy sent {len(w.p.of('/health'))} GET /health to P in {STEP_S}s while P "
            "was not healthy: it must poll until P answers 200",
        )
        await asyncio.sleep(0.05)


@case(
    "proxy/5.4/1",
    "5.4-R1",
    timeout=20.0,
)
async def waits_for_health_then_queries(t: ProxyCtx) -> None:
    """The proxy polls P's /health until it answers 200, only then queries P's bootstrap
    server, and routes to the engine ids it read there."""
    w = await t.own_world(p_health=503)
    await _polled(w)
    expect(
        not w.bootstrap.of("/query"),
        "the proxy queried P's bootstrap server while P's /health still answered 503",
    )
    w.p.health = 200
    t.log.note("P's /health answers 200 from now on")
    query = await w.bootstrap.wait(lambda h: h.path == "/query", STEP_S)
    expect(query is not None, f"the proxy did not GET /query within {STEP_S}s of P being healthy")
    _expect_health_before_each_query(w)
    reply = await t.until_served(w, STEP_S)
    expect(reply.status == 200, f"after start-up the proxy answered {reply.describe()}")
    body = t.body()
    _, _, d = await t.served(body, w)
    engine = d.params.get("remote_engine_id")
    expect(
        engine in w.bootstrap.engines.values(),
        f"the D leg names remote_engine_id {engine!r}, not an engine id of P's /query answer "
        f"{sorted(w.bootstrap.engines.values())}",
    )


def _expect_health_before_each_query(w: World) -> None:
    """Each /query the proxy sent came after a /health of P that answered 200: the last one
    answered before the query arrived. A query sent after a 503 is caught even when it reached
    the bootstrap server late, after P had turned healthy."""
    answers = [(h.answered, h.status) for h in w.p.of("/health") if h.answered is not None]
    for query in w.bootstrap.of("/query"):
        last = max((a for a in answers if a[0] <= query.arrived), default=None)
        expect(
            last is not None and last[1] == 200,
            f"the proxy queried P's bootstrap server after P's /health answered "
            f"{'nothing' if last is None else last[1]}, not 200",
        )


@case(
    "proxy/5.4/2",
    "5.4-R2",
    timeout=20.0,
)
async def unavailable_until_ready(t: ProxyCtx) -> None:
    """Until P is healthy and its bootstrap server answered, a completion gets HTTP 503 and no
    leg is sent; once both are, completions are served."""
    w = await t.own_world(p_health=503)
    await _polled(w)
    await _unavailable(t, w, "P's /health answers 503", WATCH_S)
    w.bootstrap.status = 503
    changed = time.monotonic()
    w.p.health = 200
    t.log.note("P's /health answers 200, its bootstrap server 503, from now on")
    got = await w.bootstrap.wait(lambda h: h.path == "/query" and h.arrived >= changed, STEP_S)
    expect(got is not None, f"the proxy did not GET /query within {STEP_S}s of P being healthy")
    await _unavailable(t, w, "P's bootstrap server answers 503")
    w.bootstrap.status = 200
    t.log.note("P's bootstrap server answers /query from now on")
    reply = await t.until_served(w, STEP_S)
    expect(
        reply.status == 200,
        f"once P and its bootstrap server were ready the proxy still answered {reply.describe()}",
    )


async def _unavailable(t: ProxyCtx, w: World, phase: str, watch: float = 0.0) -> None:
    """Completions sent for ``watch`` seconds (one at least) get HTTP 503, and no leg."""
    end = time.monotonic() + watch
    while True:
        body = t.body()
        reply = await t.complete(body, w)
        expect(
            reply.status == 503,
            f"while {phase}, the proxy answered {reply.describe()}, not HTTP 503",
        )
        expect(
            not [h for h in w.p.hits + w.d.hits if h.prompt == body["prompt"]],
            f"while {phase}, the proxy sent a leg of the request anyway",
        )
        if time.monotonic() >= end:
            return
        await asyncio.sleep(0.1)


@case(
    "proxy/5.4/17",
    "5.4-R16",
    timeout=20.0,
)
async def bootstrap_port_defaults_to_8998(t: ProxyCtx) -> None:
    """Started with P's bootstrap port given as none, the proxy queries port 8998 of P's host and
    names http://<P's host>:8998 as remote_bootstrap_addr. P's host is a loopback address of this
    case's own, so that other runs on the machine can hold port 8998 of theirs."""
    host = f"127.{random.randrange(1, 255)}.{random.randrange(256)}.{random.randrange(1, 255)}"
    socks: list[socket.socket] = []
    try:
        socks += [bind(DEFAULT_BOOTSTRAP_PORT, host), bind(0, host)]
    except OSError as exc:
        for s in socks:
            s.close()
        raise Unsupported(f"port {DEFAULT_BOOTSTRAP_PORT} of {host} is not free: {exc}") from None
    sock, p_sock = socks
    try:
        w = await t.own_world(bootstrap_sock=sock, p_sock=p_sock, bootstrap_given=False)
    except BaseException:
        sock.close()
        p_sock.close()
        raise
    got = await w.bootstrap.wait(lambda h: h.path == "/query", STEP_S)
    expect(got is not None, f"the proxy did not GET /query at port 8998 within {STEP_S}s")
    reply = await t.until_served(w, STEP_S)
    expect(reply.status == 200, f"the proxy answered {reply.describe()}")
    body = t.body()
    _, _, d = await t.served(body, w)
    addr = d.params.get("remote_bootstrap_addr")
    expected = f"http://{host}:{DEFAULT_BOOTSTRAP_PORT}"
    expect(addr == expected, f"the D leg names remote_bootstrap_addr {addr!r}, not {expected}")
