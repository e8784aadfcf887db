"""Clients of the bootstrap server: P registers, D queries, with the retries of spec §4.4."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import httpx

from pdwire import error_strings
from pdwire.auth import sign_registration
from pdwire.errors import DecodeError
from pdwire.http_models import (
    QueryResponse,
    RegisterReply,
    RegisterWorkerPayload,
    decode_json,
    split_host_port,
    url_of,
)

from .http_tls import client_tls

logger = logging.getLogger(__name__)

M = TypeVar("M", RegisterReply, QueryResponse)


class BootstrapError(RuntimeError):
    """A registration or query that failed; ``status`` is the HTTP status when there was one, and
    ``detail`` the server's ``detail`` (or the reason)."""

    def __init__(self, message: str, *, status: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail or message


def external_url(address: str) -> str:
    """The URL of the external bootstrap server at ``address`` (``host:port``, or a URL of
    one); ``ValueError`` when it lacks a host or a port (4.4-R12)."""
    return url_of(*split_host_port(address.removeprefix("http://").rstrip("/")))


def signed_body(payload: RegisterWorkerPayload, auth_key: bytes | None) -> dict[str, Any]:
    """The JSON body of a registration, with its ``auth_tag`` when there is a key (8.6-R10)."""
    body = {k: v for k, v in payload.dump().items() if k != "auth_tag"}
    return body if auth_key is None else sign_registration(body, auth_key)


def _detail(response: httpx.Response) -> str:
    try:
        doc = response.json()
    except ValueError:
        return response.text
    if isinstance(doc, dict) and "detail" in doc:
        return str(doc["detail"])
    return response.text


def _http_error(what: str, url: str, response: httpx.Response) -> BootstrapError:
    detail = _detail(response)
    return BootstrapError(
        f"{what} at {url} answered HTTP {response.status_code}: {detail}",
        status=response.status_code,
        detail=detail,
    )


async def register(
    url: str,
    payload: RegisterWorkerPayload,
    *,
    timeout: float = 30.0,
    attempts: int = 3,
    backoff: float = 1.0,
    max_backoff: float = 10.0,
    auth_key: bytes | None = None,
) -> RegisterReply:
    """``POST {url}/register`` (4.4-R1 to R5).

    Only a connection error or a timeout is retried, after ``backoff`` seconds, doubling up to
    ``max_backoff``; an HTTP error status raises ``BootstrapError`` at once.
    """
    endpoint = f"{url.rstrip('/')}/register"
    body = signed_body(payload, auth_key)
    wait = backoff
    for attempt in range(1, attempts + 1):
        try:
            async with httpx.AsyncClient(timeout=timeout, verify=client_tls()) as client:
                response = await client.post(endpoint, json=body)
        except (httpx.ConnectError, httpx.TimeoutException) as exc:
            logger.warning(
                "registration attempt %d/%d at %s failed: %r", attempt, attempts, endpoint, exc
            )
            if attempt < attempts:
                await asyncio.sleep(wait)
                wait = min(wait * 2, max_backoff)
            continue
        if response.status_code != 200:
            raise _http_error("registration", endpoint, response)
        return _decode(RegisterReply, response)
    raise BootstrapError(
        error_strings.REGISTRATION_FAILED.format(payload=payload, url=url, attempts=attempts)
    )


async def query(
    url: str, *, timeout: float = 30.0, attempts: int = 3, delay: float = 0.1
) -> QueryResponse:
    """``GET {url}/query``, retried ``delay`` apart after a request error (4.4-R7, R8)."""
    endpoint = f"{url.rstrip('/')}/query"
    last: Exception | None = None
    for attempt in range(1, attempts + 1):
        try:
            async with httpx.AsyncClient(timeout=timeout, verify=client_tls()) as client:
                response = await client.get(endpoint)
        except httpx.RequestError as exc:
            logger.warning("query attempt %d/%d at %s failed: %r", attempt, attempts, endpoint, exc)
            last = exc
            if attempt < attempts:
                await asyncio.sleep(delay)
            continue
        if response.status_code != 200:
            raise _http_error("query", endpoint, response)
        return _decode(QueryResponse, response)
    raise BootstrapError(
        f"Failed to query the bootstrap server at {url} after {attempts} attempts: {last!r}"
    )


def _decode(model: type[M], response: httpx.Response) -> M:
    try:
        return decode_json(model, response.content)
    except DecodeError as exc:
        raise BootstrapError(
            f"invalid reply from the bootstrap server: {exc}", status=response.status_code
        ) from exc
