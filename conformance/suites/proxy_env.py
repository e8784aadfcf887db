"""The proxy suite's world: the harness is the client, P (its API and bootstrap servers) and D;
the testee is a proxy, started here from a command template pointed at the fake backends.

``ProxyEnv`` opens one shared world for the run: a fake P API, a fake bootstrap server with two
DP ranks, a fake D API and the proxy, ready. Each case gets a ``ProxyCtx``: the shared world with
its backends reset, or a world of its own (``own_world``) when it needs a proxy that starts
against backends in another state; every client request carries a prompt of its own, by which
its two legs are found at the fake backends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import httpx

from pdwire.limits import REFERENCE

from ..case import Case, CaseFailed, Suite, WireLog, declared_limit, expect
from ..command import TemplateProcess, check, fill, with_env
from ..peers.backends import MODEL, FakeAPI, FakeBootstrap, Hit
from ..peers.http import client
from ..ports import free_port
from ..runner import DEFAULT_REQUEST_TIMEOUT, Result, RunOptions, run_suite

#: The environment variable holding the API key of a proxy started with ``--key-command``.
KEY_ENV: Final = "PDWIRE_CONFORMANCE_API_KEY"
PLACEHOLDERS: Final = (
    "python", "host", "port", "prefill_url", "prefill_host", "prefill_port", "bootstrap_url",
    "bootstrap_port", "decode_url", "decode_host", "decode_port", "api_key",
)  # fmt: skip
LEG_WAIT_S: Final = 3.0  # how long a leg may lag behind the client's answer


@dataclasses.dataclass(frozen=True)
class ProxyOptions:
    command: str  # the template that starts the proxy
    key_command: str | None = None  # the same, for a proxy with an API key
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    start_timeout: float = 20.0  # for the proxy to listen, and to be ready
    dp_ranks: int = 2  # of the fake P
    #: the proxy's limits (chapter 13) by name, those the run was told
    limits: Mapping[str, int] = dataclasses.field(default_factory=dict)


def check_template(template: str) -> None:
    """``ValueError`` unless ``template`` is a command line using only known placeholders."""
    check(template, PLACEHOLDERS, "proxy")


#: The reference proxy (``pdwire proxy``), as ``pdwire conformance self`` starts it.
REFERENCE_COMMAND: Final = (
    "{python} -m pdwire proxy --port {port} --prefill {prefill_url}@{bootstrap_url} "
    "--decode {decode_url}"
)


def reference_options(
    env: dict[str, str] | None = None, request_timeout: float = DEFAULT_REQUEST_TIMEOUT
) -> ProxyOptions:
    """The reference proxy, ``env`` added to its environment; its key from ``KEY_ENV``."""
    return ProxyOptions(
        command=with_env(REFERENCE_COMMAND, env or {}),
        key_command=with_env(f"{REFERENCE_COMMAND} --api-key-env {KEY_ENV}", env or {}),
        request_timeout=request_timeout,
        limits=REFERENCE.as_dict(),
    )


@dataclasses.dataclass
class Reply:
    """The client's answer from the proxy, whole or streamed."""

    status: int  # 0: no response
    body: Any  # decoded JSON, else the text
    raw: bytes
    chunks: list[tuple[float, bytes]]  # (monotonic arrival, bytes) of a streamed answer
    error: str = ""

    def text(self) -> str:
        return self.raw.decode(errors="replace")

    def describe(self) -> str:
        if self.status == 0:
            return f"no response ({self.error})"
        text = self.text()
        return f"HTTP {self.status} {text[:300]}{'...' if len(text) > 300 else ''}"


@dataclasses.dataclass
class World:
    """Fake P (API and bootstrap), fake D and the proxy pointed at them."""

    p: FakeAPI
    bootstrap: FakeBootstrap
    d: FakeAPI
    proxy: TemplateProcess | None = None
    url: str = ""  # the proxy's

    def set_log(self, log: WireLog) -> None:
        for b in (self.p, self.bootstrap, self.d):
            b.log = log
        if self.proxy is not None:
            self.proxy.log = log

    async def close(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        await asyncio.gather(self.p.stop(), self.bootstrap.stop(), self.d.stop())


async def open_world(
    options: ProxyOptions,
    log: WireLog,
    *,
    bootstrap_sock: socket.socket | None = None,
    p_sock: socket.socket | None = None,
    bootstrap_given: bool = True,
    key: str | None = None,
    p_health: int = 200,
) -> World:
    """Fake backends and the proxy (listening, not necessarily ready); P's ``/health`` answers
    ``p_health`` from the start; P and the bootstrap server serve on ``p_sock`` and
    ``bootstrap_sock`` when given.

    ``bootstrap_given`` False fills ``{bootstrap_url}`` and ``{bootstrap_port}`` with ``none``:
    the proxy must find the bootstrap server at port 8998 of P's host (5.4-R16).
    """
    world = World(
        FakeAPI("prefill", log), FakeBootstrap(log, options.dp_ranks), FakeAPI("decode", log)
    )
    world.p.health = p_health
    try:
        await world.p.start(p_sock)
        await world.bootstrap.start(bootstrap_sock)
        await world.d.start()
        await start_proxy(world, options, log, bootstrap_given=bootstrap_given, key=key)
    except BaseException:
        await world.close()
        raise
    return world


async def start_proxy(
    world: World,
    options: ProxyOptions,
    log: WireLog,
    *,
    bootstrap_given: bool = True,
    key: str | None = None,
) -> None:
    template = options.command if key is None else options.key_command
    assert template is not None
    port = free_port()
    host_port = {
        f"{name}_{part}": value
        for name, backend in (
            ("prefill", world.p),
            ("bootstrap", world.bootstrap),
            ("decode", world.d),
        )
        for part, value in zip(
            ("host", "port"), backend.url.removeprefix("http://").rsplit(":", 1), strict=True
        )
    }
    values = {
        "python": sys.executable,
        "host": "127.0.0.1",
        "port": str(port),
        "prefill_url": world.p.url,
        "bootstrap_url": world.bootstrap.url if bootstrap_given else "none",
        "decode_url": world.d.url,
        "api_key": key or "",
        **host_port,
    }
    if not bootstrap_given:
        values["bootstrap_port"] = "none"
    env = {**os.environ, **({KEY_ENV: key} if key else {})}
    world.url = f"http://127.0.0.1:{port}"
    world.proxy = TemplateProcess("proxy", fill(template, values, "proxy"), env, log)
    try:
        await world.proxy.spawn()
        await world.proxy.wait_listening(world.url, options.start_timeout)
    except BaseException:
        await world.proxy.stop()
        raise


class ProxyEnv:
    """The run's shared world, opened before the cases and closed after them."""

    def __init__(self, options: ProxyOptions) -> None:
        check_template(options.command)
        if options.key_command is not None:
            check_template(options.key_command)
        self.options = options
        self.log = WireLog()
        self.world: World | None = None
        self.http = client(options.request_timeout, trust_env=False)

    async def open(self) -> None:
        self.world = await open_world(self.options, self.log)
        ctx = ProxyCtx(self, self.log)
        reply = await ctx.until_served(self.world)
        if reply.status != 200:
            tail = self.world.proxy.tail() if self.world.proxy else ""
            raise RuntimeError(f"the proxy never served a request: {reply.describe()}\n{tail}")

    async def close(self) -> None:
        if self.world is not None:
            await self.world.close()
            self.world = None
        await self.http.aclose()


class ProxyCtx:
    """What a proxy case works with; ``t.world`` is the shared world unless it opened its own."""

    def __init__(self, env: ProxyEnv, log: WireLog) -> None:
        self.env = env
        self.log = log
        self.options = env.options
        self._own: list[World] = []
        if env.world is not None:
            env.world.set_log(log)
            env.world.p.reset()
            env.world.d.reset()
            env.world.bootstrap.status = 200

    @property
    def world(self) -> World:
        assert self.env.world is not None
        return self.env.world

    async def own_world(self, **kw: Any) -> World:
        """A world of this case's own (``open_world``'s arguments), closed with the case."""
        world = await open_world(self.options, self.log, **kw)
        self._own.append(world)
        return world

    async def close(self) -> None:
        for world in self._own:
            await world.close()
        self._own.clear()
        if self.env.world is not None:
            self.env.world.set_log(self.env.log)
            self.env.world.p.reset()
            self.env.world.d.reset()

    # -- the client ------------------------------------------------------------------------

    def limit(self, name: str) -> int:
        """The proxy's limit ``name`` (chapter 13); skips the case when the run was not told it."""
        return declared_limit(self.options.limits, name, "the proxy's")

    def body(self, **fields: Any) -> dict[str, Any]:
        """A completion request with a prompt of its own (how its legs are found)."""
        prompt = f"pdwire proxy conformance {uuid.uuid4().hex}"
        return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}

    async def complete(
        self,
        body: dict[str, Any],
        world: World | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """POST ``body`` to the proxy's ``/v1/completions``; a stream is read to its end."""
        url = f"{(world or self.world).url}/v1/completions"
        channel = f"http client POST {url}"
        self.log.sent(channel, "request", body)
        chunks: list[tuple[float, bytes]] = []
        try:
            async with self.env.http.stream("POST", url, json=body, headers=headers) as r:
                async for chunk in r.aiter_raw():
                    chunks.append((time.monotonic(), chunk))
                    if body.get("stream") is True:
                        self.log.received(channel, "stream chunk", chunk.decode(errors="replace"))
        except httpx.HTTPError as exc:
            self.log.received(channel, f"no response: {type(exc).__name__}: {exc}")
            return Reply(0, None, b"", chunks, f"{type(exc).__name__}: {exc}")
        raw = b"".join(c for _, c in chunks)
        try:
            decoded: Any = json.loads(raw)
        except ValueError:
            decoded = raw.decode(errors="replace")
        self.log.received(channel, f"HTTP {r.status_code}", decoded)
        return Reply(r.status_code, decoded, raw, chunks)

    async def until_served(self, world: World, timeout: float | None = None) -> Reply:
        """Send requests until one is not answered 503 (the proxy is ready), or ``timeout``."""
        deadline = time.monotonic() + (timeout or self.options.start_timeout)
        while True:
            reply = await self.complete(self.body(), world)
            if reply.status not in (0, 503) or time.monotonic() >= deadline:
                return reply
            await asyncio.sleep(0.1)

    # -- the legs --------------------------------------------------------------------------

    async def leg(self, backend: FakeAPI, body: dict[str, Any], wait: float = LEG_WAIT_S) -> Hit:
        """The leg of the client request ``body`` that ``backend`` received; a failure when it
        received none."""
        hit = await backend.wait(lambda h: h.prompt == body["prompt"], wait)
        if hit is None:
            raise CaseFailed(f"the proxy sent no {backend.name} leg for the client's request")
        return hit

    async def legs(self, body: dict[str, Any], world: World | None = None) -> tuple[Hit, Hit]:
        w = world or self.world
        return await self.leg(w.p, body), await self.leg(w.d, body)

    async def served(
        self, body: dict[str, Any], world: World | None = None
    ) -> tuple[Reply, Hit, Hit]:
        """Send ``body``; the proxy must answer HTTP 200; its P and D legs."""
        reply = await self.complete(body, world)
        expect(reply.status == 200, f"the proxy answered {reply.describe()}, not D's HTTP 200")
        p, d = await self.legs(body, world)
        return reply, p, d


async def run_proxy(
    options: ProxyOptions,
    cases: Sequence[Case],
    run_options: RunOptions,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    env = ProxyEnv(options)
    return await run_suite(
        env, Suite.PROXY, lambda log: ProxyCtx(env, log), cases, run_options, on_result
    )
