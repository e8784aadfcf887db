"""Proxy cases: what the client gets (§5.4): D's answer, whole or streamed as it comes, and a
failed P leg reported, before D's answer starts or at the end of its stream; D's leg aborted."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from ..case import case, expect, expect_equal
from ..peers.backends import Hit
from .proxy_env import ProxyCtx, Reply

#: D holds its answer this long, so that a P failure comes before D's answer starts.
D_DELAY_S = 1.5
#: How soon after the client's answer D's leg must have been closed (5.4-R15).
ABORT_BOUND_S = 2.0


def _marker() -> str:
    return f"pdwire-p-error-{uuid.uuid4().hex[:12]}"


def _fail_p(t: ProxyCtx, status: int = 500, delay: float = 0.0) -> str:
    marker = _marker()
    t.world.p.fail_status, t.world.p.fail_message, t.world.p.delay = status, marker, delay
    t.log.note(f"the fake P answers each completion HTTP {status} {marker!r} after {delay}s")
    return marker


def _events(raw: bytes) -> list[str]:
    text = raw.decode(errors="replace").replace("\r\n", "\n")
    return [e.strip() for e in text.split("\n\n") if e.strip()]


def _is_error(event: str) -> bool:
    lines = event.splitlines()
    if "event: error" in lines:
        return True
    for line in lines:
        if line.startswith("data:"):
            try:
                data: Any = json.loads(line[5:].strip())
            except ValueError:
                continue
            if isinstance(data, dict) and "error" in data:
                return True
    return False


def _expect_error(reply: Reply, what: str, marker: str | None = None) -> None:
    expect(
        reply.status >= 400,
        f"with {what}, the client got {reply.describe()}: the failure was not reported",
    )
    if marker is not None:
        expect(
            marker in reply.text(),
            f"with {what}, the client got {reply.describe()}, which does not carry P's error "
            f"{marker!r}",
        )


@case(
    "proxy/5.4/12",
    "5.4-R12",
)
async def d_answer_returned(t: ProxyCtx) -> None:
    """The client gets D's answer: D's body, D's error status, and D's stream, byte for byte,
    each chunk as it comes (the first before D sent its last)."""
    body = t.body()
    reply, _, d = await t.served(body)
    expect_equal(reply.body, d.answer, "the client's answer (D's body)")
    marker = _marker()
    t.world.d.fail_status, t.world.d.fail_message = 404, marker
    reply = await t.complete(t.body())
    expect(
        reply.status == 404 and marker in reply.text(),
        f"D answered HTTP 404 {marker!r}; the client got {reply.describe()}",
    )
    t.world.d.reset()
    t.world.d.chunk_delay = 0.25
    body = t.body(stream=True)
    reply, _, d = await t.served(body)
    expect_equal(reply.raw, d.streamed(), "the client's stream (D's stream)")
    first, last = reply.chunks[0][0], d.chunks[-1][0]
    expect(
        first < last,
        f"the client got the stream's first bytes {first - last:.2f}s after D sent its last: "
        "the proxy held D's stream back",
    )


@case(
    "proxy/5.4/13",
    "5.4-R13",
    covers=("5.4-R14",),
)
async def p_error_status_reported(t: ProxyCtx) -> None:
    """When P answers HTTP 500 before D's answer starts, the client gets an HTTP error that
    carries P's error message, streamed request or not."""
    marker = _fail_p(t)
    t.world.d.delay = D_DELAY_S
    for stream in (False, True):
        reply = await t.complete(t.body(stream=stream))
        _expect_error(
            reply, f"P failing (HTTP 500){' a streamed request' if stream else ''}", marker
        )


@case(
    "proxy/5.4/14",
    "5.4-R13",
    covers=("5.4-R14",),
    timeout=20.0,
)
async def p_refusing_reported(t: ProxyCtx) -> None:
    """When P's API refuses connections (after start-up), the client gets an HTTP error naming
    the failure, streamed request or not."""
    w = await t.own_world()
    ready = await t.until_served(w)
    expect(ready.status == 200, f"the proxy answered {ready.describe()}")
    await w.p.stop()
    w.d.delay = D_DELAY_S
    for stream in (False, True):
        reply = await t.complete(t.body(stream=stream), w)
        _expect_error(reply, f"P refusing connections{' (streamed)' if stream else ''}")
        expect(bool(reply.text().strip()), "the proxy's error answer has an empty body")


@case(
    "proxy/5.4/15",
    "5.4-R14",
    covers=("5.4-R13",),
)
async def p_error_ends_stream(t: ProxyCtx) -> None:
    """When P fails after D's stream has started, the client's stream ends with an error."""
    _fail_p(t, delay=0.6)
    t.world.d.chunks, t.world.d.chunk_delay = 12, 0.25
    body = t.body(stream=True)
    reply = await t.complete(body)
    d = await t.leg(t.world.d, body)
    expect(
        reply.status == 200,
        f"D's stream had started ({len(d.chunks)} chunks) but the client got {reply.describe()}",
    )
    events = [e for e in _events(reply.raw) if e != "data: [DONE]"]
    expect(bool(events), "the client's stream is empty")
    expect(
        _is_error(events[-1]),
        f"the client's stream ends with {events[-1][:200]!r}, not an error: P's failure was "
        f"dropped ({len(events)} events)",
    )


@case(
    "proxy/5.4/16",
    "5.4-R15",
    timeout=15.0,
)
async def d_leg_aborted(t: ProxyCtx) -> None:
    """When the P leg fails, the proxy closes the D leg: D sees its caller go away within 2 s of
    the client's answer."""
    _fail_p(t)
    t.world.d.delay = 3 * ABORT_BOUND_S
    body = t.body()
    reply = await t.complete(body)
    _expect_error(reply, "P failing (HTTP 500)")
    d = await t.leg(t.world.d, body)
    await _aborted(d, time.monotonic() + ABORT_BOUND_S)
    expect(
        d.aborted is not None,
        f"the proxy kept the D leg open {ABORT_BOUND_S}s after it reported P's failure",
    )


async def _aborted(hit: Hit, deadline: float) -> None:
    while hit.aborted is None and hit.finished is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
