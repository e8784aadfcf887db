"""Proxy cases: the size of the completion requests a proxy reads (§13.7)."""

from __future__ import annotations

import json

import httpx

from pdwire.limits import MINIMUM

from ..case import case, expect
from .proxy_env import ProxyCtx


def padded(t: ProxyCtx, size: int) -> bytes:
    """A completion request of exactly ``size`` bytes of JSON, padded by a field of its own."""
    body = t.body(x_padding="")
    base = len(json.dumps(body).encode())
    body["x_padding"] = "x" * (size - base)
    raw = json.dumps(body).encode()
    assert len(raw) == size, (len(raw), size)
    return raw


async def post(t: ProxyCtx, raw: bytes) -> int:
    """POST ``raw`` to the proxy; its HTTP status, 0 when it gave none."""
    url = f"{t.world.url}/v1/completions"
    t.log.sent(f"http client POST {url}", f"a body of {len(raw)} bytes")
    try:
        r = await t.env.http.post(url, content=raw, headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        t.log.received(f"http client POST {url}", f"no response: {type(exc).__name__}: {exc}")
        return 0
    t.log.received(f"http client POST {url}", f"HTTP {r.status_code}", r.text[:200])
    return r.status_code


@case(
    "proxy/13.7/1",
    "13.7-R1",
    covers=("13.1-R1", "13.1-R2"),
)
async def completion_body_limit(t: ProxyCtx) -> None:
    """A completion request of 4 MiB (the minimum) is served; one a byte longer than the
    proxy's completion_body_bytes is answered HTTP 413."""
    least = MINIMUM.completion_body_bytes
    served = await post(t, padded(t, least))
    expect(served == 200, f"a request of {least} bytes (the minimum): HTTP {served}, not 200")
    maximum = t.limit("completion_body_bytes")
    refused = await post(t, padded(t, maximum + 1))
    expect(refused == 413, f"a request of {maximum + 1} bytes: HTTP {refused}, not 413")
