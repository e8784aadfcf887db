"""A scripted bootstrap server for the registration suite (§4.4), on a raw TCP socket: it
records every request a P worker makes, with when its connection opened, when the request had
arrived whole, when the server answered and when the connection closed, and answers
``POST /register`` as the case's script says: never (the attempt must time out), with an error
status, or with HTTP 200 after holding the answer for a while."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any, Final, Literal

from ..case import WireLog
from .loop_lag import LoopLag
from .loop_server import bind

Answer = Literal["stall", "reject", "accept"]
READ_LIMIT: Final = 1 << 20  # a registration body is far smaller (4.1-R17: 64 KiB)


@dataclasses.dataclass(frozen=True)
class Script:
    """How the server answers each registration."""

    answer: Answer
    status: int = 400  # reject: the HTTP status
    hold: float = 0.0  # accept: seconds between the request and the answer


@dataclasses.dataclass
class Attempt:
    """One connection to the server, and the request on it; times are ``time.monotonic()``."""

    opened: float
    arrived: float | None = None  # the whole request read
    answered: float | None = None  # the server wrote its answer
    closed: float | None = None  # the client closed the connection
    method: str = ""
    path: str = ""
    body: Any = None  # the decoded JSON body, or None

    @property
    def is_registration(self) -> bool:
        return self.method == "POST" and self.path.split("?")[0] == "/register"

    @property
    def worker(self) -> tuple[int, int, int] | None:
        """(dp_rank, tp_rank, pp_rank) of the registering worker, as its body gives them."""
        b = self.body
        if not isinstance(b, dict):
            return None
        ranks = (b.get("dp_rank"), b.get("tp_rank"), b.get("pp_rank"))
        if not all(isinstance(r, int) for r in ranks):
            return None
        return (int(b["dp_rank"]), int(b["tp_rank"]), int(b["pp_rank"]))

    @property
    def addr(self) -> str | None:
        addr = self.body.get("addr") if isinstance(self.body, dict) else None
        return addr if isinstance(addr, str) else None


def _response(status: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    reason = {200: "OK", 400: "Bad Request"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + data


class Registrar:
    """The scripted server; ``attempts`` lists every connection in the order they opened."""

    def __init__(self, script: Script, log: WireLog) -> None:
        self.script = script
        self.log = log
        self.attempts: list[Attempt] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Condition()
        self.lag = LoopLag()  # how late the times of ``attempts`` may have been read
        self.host = "127.0.0.1"
        self.port = 0

    @property
    def host_port(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host_port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen on ``host:port`` (0: a free port); ``OSError`` when it is taken."""
        sock = bind(port, host)
        self.host, self.port = host, sock.getsockname()[1]
        self._server = await asyncio.start_server(self._accept, sock=sock, limit=READ_LIMIT)
        self.lag.start()

    async def stop(self) -> None:
        await self.lag.stop()
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        for task in list(self._handlers):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def registrations(self) -> list[Attempt]:
        return [a for a in self.attempts if a.is_registration]

    async def wait(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``done()`` holds (checked at every change, and every 50 ms for the
        clock's sake) or ``timeout`` passes; whether it holds."""
        deadline = time.monotonic() + timeout
        async with self._changed:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.05))
        return True

    async def _changed_now(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._serve(reader, writer))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        attempt = Attempt(opened=time.monotonic())
        self.attempts.append(attempt)
        channel = f"http bootstrap {self.url}"
        try:
            await self._changed_now()
            if not await self._read(reader, attempt):
                return
            self.log.received(channel, f"{attempt.method} {attempt.path}", attempt.body)
            await self._changed_now()
            if not attempt.is_registration:
                await self._answer(writer, attempt, 404, {"detail": "Not Found"})
            elif self.script.answer == "reject":
                detail = {"detail": "registration refused by the conformance harness"}
                await self._answer(writer, attempt, self.script.status, detail)
            elif self.script.answer == "accept":
                await asyncio.sleep(self.script.hold)
                await self._answer(writer, attempt, 200, {"status": "ok"})
            # "stall": no answer; the client must give up (4.4-R1)
            await reader.read()  # until the client closes
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            attempt.closed = time.monotonic()
            self.log.note(f"connection {len(self.attempts)} to the bootstrap server closed")
            writer.close()
            await self._changed_now()

    async def _read(self, reader: asyncio.StreamReader, attempt: Attempt) -> bool:
        """Read one HTTP/1.1 request into ``attempt``; False when the client closed first."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, *_ = [*lines[0].split(" "), "", ""]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length" and value.strip().isdigit():
                length = int(value.strip())
        raw = await reader.readexactly(length) if length else b""
        attempt.method, attempt.path = method, path
        try:
            attempt.body = json.loads(raw) if raw else None
        except ValueError:
            attempt.body = None
        attempt.arrived = time.monotonic()
        return True

    async def _answer(
        self, writer: asyncio.StreamWriter, attempt: Attempt, status: int, body: dict[str, Any]
    ) -> None:
        attempt.answered = time.monotonic()
        writer.write(_response(status, body))
        await writer.drain()
        self.log.sent(f"http bootstrap {self.url}", f"HTTP {status}", body)
        await self._changed_now()
