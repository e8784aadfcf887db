"""The pair suite's relay (``conformance.peers.observer``): what it answers D's ``GET /query``
with when P's bootstrap server fails to answer, and that a case can say so; that P's answer to
a pull reaches D after the case that sent the pull has ended."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from conformance.case import WireLog
from conformance.peers.observer import REAL, Observer
from conformance.ports import bind_fresh, free_port
from pdwire.codec import decode_response, encode_pull, encode_response
from pdwire.messages import XferResponse, XferResponseStatus
from pdwire.vectors import seed_pull

ENTRY = {"0": {"engine_id": "e0", "worker_addr": {"0": {"0": "tcp://127.0.0.1:9"}}}}
WAIT = 10.0


class Bootstrap:
    """A bootstrap server that answers ``GET /query`` with ``entry``, but closes the connection of
    the request after ``drop_next`` is set without an answer: a pooled connection closed as it
    is reused, a fault no real server can be made to show at will."""

    def __init__(self, entry: dict[str, object] = ENTRY) -> None:
        self.entry = entry
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
                body = json.dumps(self.entry).encode()
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


class Pair:
    """A P worker (a ROUTER that answers when told) behind a bootstrap server, the observer in
    front of them, and D's pulls, each on a DEALER of its own connected to the relayed worker."""

    def __init__(self, timeout: float) -> None:
        self.ctx = zmq.asyncio.Context()
        self.p = self.ctx.socket(zmq.ROUTER)
        port = bind_fresh(self.p, "127.0.0.1")
        entry = {"0": {"engine_id": "e0", "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{port}"}}}}
        self.bootstrap = Bootstrap(entry)
        self.timeout = timeout
        self.relayed = ""

    async def start(self) -> None:
        await self.bootstrap.start()
        self.observer = Observer(self.bootstrap.url, timeout=self.timeout)
        await self.observer.start()
        got = await _relayed(self.observer)
        self.relayed = got.json()["0"]["worker_addr"]["0"]["0"]

    async def pull(
        self, transfer_id: str, d: zmq.asyncio.Socket | None = None
    ) -> tuple[zmq.asyncio.Socket, bytes]:
        """D's pull for ``transfer_id`` on ``d`` (None: a socket of its own), and the identity
        it reaches P under."""
        if d is None:
            d = self.ctx.socket(zmq.DEALER)
            d.connect(self.relayed)
        pull = msgspec.structs.replace(seed_pull(), req_blocks={"r": (transfer_id, [[1]])})
        await d.send(encode_pull(pull, "legacy"))
        identity, _ = await asyncio.wait_for(self.p.recv_multipart(), WAIT)
        return d, identity

    async def finish(self, identity: bytes) -> None:
        reply = XferResponse(XferResponseStatus.FINISH, ["r"], None, None)
        await self.p.send_multipart([identity, encode_response(reply, "legacy")])

    async def close(self) -> int:
        unanswered = await self.observer.close()
        await self.bootstrap.close()
        self.ctx.destroy(linger=0)
        return unanswered


@pytest.mark.asyncio
async def test_a_pull_answered_after_its_case_ended_gets_its_answer() -> None:
    """A pull P answers once the next case has begun (vLLM's P readies a request at an engine
    step after it answered the proxy) still gets P's answer: dropped, it would leave D holding
    the request's blocks until its receive timeout. The relay then closes with nothing left."""
    pair = Pair(timeout=WAIT)
    await pair.start()
    try:
        pair.observer.begin(WireLog())
        d, identity = await pair.pull("x-1")
        pair.observer.begin(WireLog())  # the next case
        await pair.finish(identity)
        got = await asyncio.wait_for(d.recv(), WAIT)
        assert decode_response(got).status is XferResponseStatus.FINISH
        assert pair.observer.problems == []
    finally:
        assert await pair.close() == 0


@pytest.mark.asyncio
async def test_a_message_of_this_case_on_the_socket_of_an_earlier_one_is_checked() -> None:
    """D's second message on the socket of an earlier case's unanswered pull belongs to this
    case: the observer names it (3.1-R3) and checks P's answer to it."""
    pair = Pair(timeout=WAIT)
    await pair.start()
    try:
        pair.observer.begin(WireLog())
        d, identity = await pair.pull("x-3")
        pair.observer.begin(WireLog())
        await pair.pull("x-4", d)
        await pair.finish(identity)
        await asyncio.wait_for(d.recv(), WAIT)
        (record,) = pair.observer.records
        assert [r.msg.status for r in record.replies if r.msg] == [XferResponseStatus.FINISH]
        assert [p.requirement for p in pair.observer.problems] == ["3.1-R3"]
    finally:
        assert await pair.close() == 0


@pytest.mark.asyncio
async def test_a_relay_closed_with_a_pull_unanswered_counts_it() -> None:
    """The relay waits its timeout for P's answer to each pull it passed on, then counts the
    pulls left without one."""
    pair = Pair(timeout=0.5)
    await pair.start()
    try:
        pair.observer.begin(WireLog())
        await pair.pull("x-2")
    finally:
        assert await pair.close() == 1
