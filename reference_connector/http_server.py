"""A FastAPI app served by uvicorn on a daemon thread: the bootstrap server, the proxy and the
engine node all run this way, in tests and in ``pdwire run``."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
import time
from typing import Literal, Self

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def client_host(host: str) -> str:
    """The host a local client dials for a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    return host


class AppServer:
    """Serve ``app`` from a thread. ``start`` binds in the caller, so bind errors raise there,
    and returns once uvicorn serves; ``stop`` asks it to exit and joins the thread."""

    name = "server"
    lifespan: Literal["on", "off"] = "off"

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._host, self._port = "127.0.0.1", 0

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Self:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._sock = bind(host, port)
        self._host, self._port = host, int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan=self.lifespan,
            log_config=None,
            timeout_graceful_shutdown=3,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name=f"pdwire {self.name}",
            daemon=True,
        )
        self._thread.start()
        self._wait_started(timeout)
        logger.info("%s listening at %s", self.name, self.url)
        return self

    def _wait_started(self, timeout: float) -> None:
        assert self._server is not None and self._thread is not None
        deadline = time.monotonic() + timeout
        while not self._server.started:  # uvicorn sets a plain flag: poll it and the thread
            if not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"{self.name} exited during startup")
            if time.monotonic() >= deadline:
                self.stop()
                raise TimeoutError(f"{self.name} did not start in time ({timeout}s)")
            self._thread.join(0.01)

    @property
    def port(self) -> int:
        """The bound port (0 before ``start``)."""
        return self._port

    @property
    def url(self) -> str:
        return f"http://{client_host(self._host)}:{self._port}"

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("%s thread still running after %ss", self.name, timeout)
        if self._sock is not None:
            self._sock.close()
        self._server, self._thread, self._sock = None, None, None

    def __enter__(self) -> Self:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
