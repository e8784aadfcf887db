"""A gate in front of the harness's transfer engine, to hold a write of P's in flight.

P's engine reaches a peer named ``host:port`` first through that port: the handshake that tells
it where the peer's memory is. A pull that names the gate's port instead of the engine's makes
P's first write to it wait at the gate, connected and unanswered, for as long as the case keeps
the gate shut: a write in flight that the harness can see begin and decide when to end. ``open``
relays the handshake to the engine and the write completes; later writes to the same name go
straight to the engine. ``close`` drops whatever is held, which fails the write.

A gate holds only the first write P makes to its name, so each case takes a new gate, on a port
no earlier gate of this process had.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

from ..case import WireLog
from .engine import Engine

RELAY_CHUNK = 65536
_used_ports: set[int] = set()  # P's engine remembers every name it reached through a gate


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(RELAY_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


class WriteGate:
    """A loopback listener in front of ``engine``'s handshake port; shut until ``open``."""

    def __init__(self, engine: Engine, log: WireLog) -> None:
        self.engine = engine
        self.log = log
        self.port = 0
        self._knocked = asyncio.Event()
        self._open = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._dropped = False
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> WriteGate:
        taken: list[asyncio.Server] = []
        while True:
            server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
            port = int(server.sockets[0].getsockname()[1])
            if port not in _used_ports:
                break
            taken.append(server)  # held open so that the next bind gets another port
        for old in taken:
            old.close()
        self._server, self.port = server, port
        _used_ports.add(port)
        self.log.note(f"write gate on :{port}, shut, before engine {self.engine.session}")
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        if not self._knocked.is_set():
            self.log.received(f"gate :{self.port}", "P's engine began a write (handshake held)")
        self._knocked.set()
        await self._open.wait()
        if self._dropped:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.engine.port)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        await asyncio.gather(_relay(reader, up_writer), _relay(up_reader, writer))

    async def entered(self, timeout: float) -> bool:
        """Whether P's engine began a write through the gate within ``timeout``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._knocked.wait(), timeout)
        return self._knocked.is_set()

    def open(self) -> None:
        """Let the held write through: it completes."""
        if not self._open.is_set():
            self.log.note(f"write gate :{self.port} opened")
            self._open.set()

    async def close(self) -> None:
        """Stop listening and drop every connection, held or relayed: a held write fails."""
        self._dropped = True
        self._open.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in self._writers:
            w.close()
        self._writers.clear()
