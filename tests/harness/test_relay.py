"""The pair suite's bootstrap relay (``conformance.peers.observer``): what it answers D's
``GET /query`` with when P's bootstrap server fails to answer, and that a case can say so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from conformance.peers.observer import REAL, Observer
from conformance.ports import free_port

ENTRY = {"0": {"engine_id": "e0", "worker_addr": {"0": {"0": "tcp://127.0.0.1:9"}}}}
WAIT = 10.0


class Bootstrap:
    """A bootstrap server that answers ``GET /query`` with ENTRY, but closes the connection of
    the request after ``drop_next`` is set without an answer: a pooled connection closed as it
    is reused, a fault no real server can be made to show at will."""

    def __init__(self) -> None:
        self.requests = 0
        self.drop_next = False
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                self.requests += 1
                if self.drop_next:
                    self.drop_next = False
                    return
                body = json.dumps(ENTRY).encode()
                head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest_asyncio.fixture
async def bootstrap() -> AsyncIterator[Bootstrap]:
    server = Bootstrap()
    await server.start()
    yield server
    await server.close()


async def _relayed(observer: Observer) -> httpx.Response:
    async with httpx.AsyncClient(timeout=WAIT) as http:
        return await http.get(f"{observer.url(REAL)}/query")


@pytest.mark.asyncio
async def test_a_query_whose_connection_closes_unanswered_is_asked_again(
    bootstrap: Bootstrap,
) -> None:
    observer = Observer(bootstrap.url, timeout=WAIT)
    await observer.start()  # its first /query opens the connection the relay reuses
    try:
        bootstrap.drop_next = True
        got = await _relayed(observer)
        assert got.status_code == 200, got.text
        assert got.json()["0"]["engine_id"] == observer.engine_id("e0")
        assert bootstrap.requests == 3 and observer.refused == []
    finally:
        await observer.close()


@pytest.mark.asyncio
async def test_a_bootstrap_that_does_not_answer_is_a_refusal_the_case_can_name() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    observer = Observer(nobody, timeout=WAIT)
    await observer.start()
    try:
        got = await _relayed(observer)
        assert got.status_code == 502
        (refused,) = observer.refused
        assert refused.startswith("HTTP 502: P's bootstrap did not answer /query: ConnectError")
        assert got.json() == {"detail": refused.removeprefix("HTTP 502: ")}
    finally:
        await observer.close()
