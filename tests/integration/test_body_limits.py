"""Request bodies over a server's limit get HTTP 413 before they are read whole: the real
bootstrap server (4.1-R17), and the middleware every server here uses, over real HTTP, with the
length declared and with a chunked body that declares none."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request

from reference_connector.body_limit import REGISTER_BODY_LIMIT, BodyLimit
from reference_connector.bootstrap import BootstrapServer
from reference_connector.http_server import AppServer

LIMIT = 1000


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    app = FastAPI()
    app.add_middleware(BodyLimit, limit=LIMIT)

    @app.post("/echo")
    async def echo_len(request: Request) -> dict[str, int]:
        return {"read": len(await request.body())}

    server = AppServer(app).start()
    try:
        yield server.url
    finally:
        server.stop()


def _chunks(total: int, size: int = 300) -> Iterator[bytes]:
    while total > 0:
        yield b"x" * min(size, total)
        total -= size


def test_a_body_at_the_limit_is_read(echo: str) -> None:
    got = httpx.post(f"{echo}/echo", content=b"x" * LIMIT, timeout=10.0)
    assert got.status_code == 200 and got.json() == {"read": LIMIT}
    chunked = httpx.post(f"{echo}/echo", content=_chunks(LIMIT), timeout=10.0)
    assert chunked.status_code == 200 and chunked.json() == {"read": LIMIT}


def test_a_longer_body_gets_413(echo: str) -> None:
    declared = httpx.post(f"{echo}/echo", content=b"x" * (LIMIT + 1), timeout=10.0)
    assert declared.status_code == 413
    assert declared.json() == {"detail": f"request body over {LIMIT} bytes"}
    chunked = httpx.post(f"{echo}/echo", content=_chunks(LIMIT + 1), timeout=10.0)
    assert chunked.status_code == 413
    assert httpx.post(f"{echo}/echo", content=b"x", timeout=10.0).status_code == 200


def test_the_bootstrap_server_refuses_a_long_registration() -> None:
    server = BootstrapServer().start()
    try:
        body = b'{"engine_id": "' + b"e" * REGISTER_BODY_LIMIT + b'"}'
        got = httpx.post(f"{server.url}/register", content=body, timeout=10.0)
        assert got.status_code == 413, got.text
        assert httpx.get(f"{server.url}/query", timeout=10.0).json() == {}
    finally:
        server.stop()
