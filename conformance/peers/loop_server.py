"""A FastAPI app served by uvicorn inside the harness's event loop, on a socket bound (and
listening) before it serves, so that a peer may connect at once."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


def bind(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port); ``OSError`` when it is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)  # a peer may connect before uvicorn accepts: the backlog holds it
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn in the harness's loop, leaving the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class LoopServer:
    """``app`` served on ``sock`` until ``stop``."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            log_config=None,
            timeout_graceful_shutdown=1,
        )
        self._sock = sock
        self._server = _Server(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))

    def stop(self) -> asyncio.Task[None]:
        """Ask uvicorn to exit; the task ends once it has, and the port is closed."""
        self._server.should_exit = True

        async def wind_down() -> None:
            try:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._serving, 5.0)
            finally:
                self._sock.close()

        return asyncio.create_task(wind_down())
