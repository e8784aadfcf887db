"""HTTP as the harness speaks it: completions to an engine's OpenAI API, the bootstrap server's
routes, each exchange in the case's wire log."""

from __future__ import annotations

import dataclasses
import functools
import json
import ssl
import time
import uuid
from typing import Any, Final

import httpx

from pdwire.http_models import CLIENT_KEEPALIVE_S

from ..case import WireLog

PROBE_TIMEOUT: Final = 2.0  # seconds: a server that is up answers a probe at once


@functools.cache
def client_tls() -> ssl.SSLContext:
    """The TLS context of every httpx client of the harness (``verify=``): httpx would make one
    for each client, reading the CA bundle, about 25 ms of CPU."""
    return httpx.create_ssl_context()


def client(timeout: float, *, trust_env: bool = True) -> httpx.AsyncClient:
    """The harness's client of a testee's HTTP servers: it drops an idle connection before the
    server would close it (``CLIENT_KEEPALIVE_S``)."""
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S)
    return httpx.AsyncClient(
        timeout=timeout, limits=limits, trust_env=trust_env, verify=client_tls()
    )


@dataclasses.dataclass
class HttpResult:
    status: int  # 0: no response (connection error, timeout)
    body: Any  # decoded JSON, else the text
    elapsed: float
    error: str = ""  # why there is no response

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def output(self) -> tuple[str, list[int] | None, list[float] | None]:
        """The completion text, and where the answer has them its generated token ids (vLLM's
        ``return_token_ids``) and their log probabilities (``logprobs``): a tiny model's text,
        even its tokens, may be the same whatever its KV, where its log probabilities are not
        (``consumer_env.same_output`` compares two)."""
        try:
            choice = self.body["choices"][0]
            ids = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        except (KeyError, IndexError, TypeError, AttributeError):
            ids = logprobs = None
        return (
            self.text(),
            list(ids) if isinstance(ids, list) else None,
            list(logprobs) if isinstance(logprobs, list) else None,
        )

    def text(self) -> str:
        """The completion text of an OpenAI completion or chat body ("" if none)."""
        try:
            choice = self.body["choices"][0]
        except (KeyError, IndexError, TypeError):
            return ""
        if "text" in choice:
            return str(choice["text"])
        return str((choice.get("message") or {}).get("content") or "")


async def request(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    log: WireLog,
    *,
    body: Any = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
) -> HttpResult:
    """One exchange: ``body`` sent as JSON, or ``content`` as it is."""
    channel = f"http {method} {url}"
    log.sent(channel, "request", body if content is None else content.decode(errors="replace"))
    start = time.monotonic()
    try:
        response = await client.request(
            method,
            url,
            json=body if content is None else None,
            content=content,
            headers=headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
    except httpx.HTTPError as exc:
        elapsed = time.monotonic() - start
        log.received(channel, f"no response: {type(exc).__name__}: {exc}")
        return HttpResult(0, None, elapsed, f"{type(exc).__name__}: {exc}")
    elapsed = time.monotonic() - start
    try:
        decoded: Any = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        decoded = response.text
    log.received(channel, f"HTTP {response.status_code}", decoded)
    return HttpResult(response.status_code, decoded, elapsed)


async def probe(url: str, http: httpx.AsyncClient | None = None) -> httpx.Response | None:
    """``GET url`` (with ``http``, or a client of its own with a short timeout), unlogged: the
    answer, or None where nothing answered, as while a server starts."""
    try:
        if http is not None:
            return await http.get(url)
        async with client(PROBE_TIMEOUT, trust_env=False) as own:
            return await own.get(url)
    except httpx.HTTPError:
        return None


async def listens(url: str, until: float) -> str:
    """Whether a server listens at ``url``'s address, once it is known to be up on another of
    its host's addresses: "" once it answers ``GET url``; why not, at once when the connection
    is refused (nothing listens there), else at ``until`` (monotonic). A server that listens
    answers late, not never, on a loaded machine: a timeout alone is no verdict."""
    why = "no answer"
    async with client(PROBE_TIMEOUT, trust_env=False) as http:
        while True:
            try:
                await http.get(url)
                return ""
            except httpx.ConnectError as exc:
                return f"connection refused ({exc})"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= until:
                return why


def request_id() -> str:
    return uuid.uuid4().hex


def transfer_id() -> str:
    """A transfer_id as a proxy mints it (§5.4)."""
    return f"xfer-{uuid.uuid4()}"
