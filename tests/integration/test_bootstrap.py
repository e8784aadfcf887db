"""The bootstrap server and its clients over real HTTP on loopback (spec §4, §8.6)."""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conformance.ports import free_port
from pdwire import error_strings as es
from pdwire.auth import canonical_json, key_id, register_tag, sign_registration
from pdwire.http_models import QueryResponse, RegisterWorkerPayload
from pdwire.messages import Fingerprint
from reference_connector import cli_bootstrap
from reference_connector.bootstrap import (
    AUTH_FAILED_DETAIL,
    BootstrapServer,
    RegistrationRejected,
    Registry,
)
from reference_connector.bootstrap_client import BootstrapError, query, register, signed_body
from reference_connector.http_tls import client_tls

KEY = b"bootstrap-test-key"
FP = Fingerprint(
    model="tiny-llama",
    dtype="bfloat16",
    num_layers=2,
    num_kv_heads=4,
    head_size=64,
    block_size=16,
    kv_layout="LBHNC",
)
WAIT = 10.0  # bound of every wait on a thread or a process in this module

ServerFactory = Callable[..., BootstrapServer]


@pytest.fixture
def make_server() -> Iterator[ServerFactory]:
    """Start servers on free ports; every one is stopped at the end of the test."""
    started: list[BootstrapServer] = []

    def make(**kwargs: Any) -> BootstrapServer:
        server = BootstrapServer(**kwargs)
        started.append(server)
        return server.start(port=0)

    try:
        yield make
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def server(make_server: ServerFactory) -> BootstrapServer:
    return make_server()


@pytest.fixture
def http(server: BootstrapServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=WAIT) as client:
        yield client


def worker(
    dp: int = 0, tp: int = 0, pp: int = 0, *, engine: str = "engine-a", **extra: Any
) -> RegisterWorkerPayload:
    """A registration; its port is derived from the ranks, so each worker's address differs."""
    addr = extra.pop("addr", f"tcp://10.0.0.5:{41000 + 100 * dp + 10 * tp + pp}")
    return RegisterWorkerPayload(
        engine_id=engine, dp_rank=dp, tp_rank=tp, pp_rank=pp, addr=addr, **extra
    )


def v2(**extra: Any) -> dict[str, Any]:
    """The pdwire/2 fields of a registration."""
    return {
        "pdwire_version": 2,
        "pdwire_caps": ["cancel", "deadline", "fingerprint"],
        "tp_size": 2,
        "pp_size": 1,
        "fingerprint": FP,
        **extra,
    }


def post(http: httpx.Client, body: dict[str, Any] | RegisterWorkerPayload) -> httpx.Response:
    doc = body.dump() if isinstance(body, RegisterWorkerPayload) else body
    return http.post("/register", json=doc)


# -- /register and /query -------------------------------------------------------------------


def test_register_and_query_nest_dp_tp_pp(http: httpx.Client) -> None:
    for tp in (0, 1):
        for pp in (0, 1):
            assert post(http, worker(0, tp, pp)).json() == {"status": "ok"}
    assert post(http, worker(1, 0, 0, engine="engine-b")).status_code == 200
    doc = http.get("/query").json()
    assert doc == {
        "0": {
            "engine_id": "engine-a",
            "worker_addr": {
                "0": {"0": "tcp://10.0.0.5:41000", "1": "tcp://10.0.0.5:41001"},
                "1": {"0": "tcp://10.0.0.5:41010", "1": "tcp://10.0.0.5:41011"},
            },
        },
        "1": {"engine_id": "engine-b", "worker_addr": {"0": {"0": "tcp://10.0.0.5:41100"}}},
    }


@pytest.mark.asyncio
async def test_client_register_and_query(server: BootstrapServer) -> None:
    reply = await register(server.url, worker(0, 1, 0))
    assert reply.dump() == {"status": "ok"}
    got = await query(server.url)
    assert isinstance(got, QueryResponse)
    assert got.root[0].engine_id == "engine-a"
    assert got.root[0].worker_addr == {1: {0: "tcp://10.0.0.5:41010"}}


@pytest.mark.asyncio
async def test_clients_share_one_tls_context(
    server: BootstrapServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registrations and queries, which run on the agents' event loops, make no TLS context of
    their own: each would read the CA bundle, about 25 ms of CPU with the loop blocked."""
    client_tls()
    made: list[object] = []
    create = ssl.create_default_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        made.append(args or kwargs)
        return create(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counted)
    for rank in range(2):
        await register(server.url, worker(0, rank, 0))
        assert (await query(server.url)).root[0].engine_id == "engine-a"
    assert made == []


def test_identical_reregistration_is_accepted(http: httpx.Client) -> None:
    for _ in range(3):
        response = post(http, worker(0, 0, 0))
        assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert http.get("/query").json()["0"]["worker_addr"] == {"0": {"0": "tcp://10.0.0.5:41000"}}


def test_registrations_past_the_limit_are_507() -> None:
    """13.6-R1: a new worker past the limit is refused and nothing of it is kept; a worker
    already held may register again; vLLM's server (no limit) takes any number."""
    registry = Registry(max_workers=2)
    registry.register(worker(0, 0, 0))
    registry.register(worker(1, 0, 0, engine="engine-b"))
    with pytest.raises(RegistrationRejected) as refused:
        registry.register(worker(2, 0, 0, engine="engine-c"))
    assert refused.value.status == 507
    assert refused.value.detail == (
        "LIMIT_EXCEEDED: Limit exceeded: registrations allows 2, got 3."
    )
    assert sorted(registry.engines) == [0, 1] and registry.workers == 2
    registry.register(worker(0, 0, 0))
    unlimited = Registry(keep_pdwire_fields=False, max_workers=None)
    for tp in range(3):
        unlimited.register(worker(0, tp, 0))
    assert unlimited.workers == 3


def test_conflicting_address_is_400_with_vllms_string(http: httpx.Client) -> None:
    assert post(http, worker(0, 1, 0)).status_code == 200
    response = post(http, worker(0, 1, 0, addr="tcp://10.0.0.6:5000"))
    assert response.status_code == 400
    assert response.json() == {
        "detail": "Worker with dp_rank=0, tp_rank=1, pp_rank=0 is already registered at "
        "tcp://10.0.0.5:41010, but still want to register at tcp://10.0.0.6:5000"
    }
    assert http.get("/query").json()["0"]["worker_addr"]["1"]["0"] == "tcp://10.0.0.5:41010"


def test_engine_id_mismatch_is_400_with_vllms_string(http: httpx.Client) -> None:
    assert post(http, worker(3, 0, 0, engine="old")).status_code == 200
    response = post(http, worker(3, 1, 0, engine="new"))
    assert response.status_code == 400
    assert response.json() == {"detail": "Engine ID mismatch for dp_rank=3: expected old, got new"}
    assert response.json()["detail"] == es.ENGINE_ID_MISMATCH.format(
        dp_rank=3, registered_engine_id="old", engine_id="new"
    )


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"addr": "10.0.0.5:41000"}, "$.addr"),
        ({"addr": "tcp://10.0.0.5:70000"}, "$.addr"),
        ({"addr": "tcp://10.0.0.5"}, "$.addr"),
        ({"tp_rank": -1}, "$.tp_rank"),
        ({"dp_rank": "zero"}, "$.dp_rank"),
        ({"engine_id": None}, "$.engine_id"),
    ],
)
def test_invalid_body_is_422_naming_the_section(
    http: httpx.Client, change: dict[str, Any], path: str
) -> None:
    body = {**worker().dump(), **change}
    response = post(http, body)
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "RegisterWorkerPayload" in detail
    assert f"`{path}`" in detail
    assert "§4.1" in detail
    assert http.get("/query").json() == {}


def test_missing_field_and_non_json_are_422(http: httpx.Client) -> None:
    body = worker().dump()
    del body["addr"]
    assert post(http, body).status_code == 422
    for raw in (b"{not json", b"[1, 2]"):
        response = http.post("/register", content=raw)
        assert response.status_code == 422
        assert "§4.1" in response.json()["detail"]


def test_unknown_keys_are_ignored(http: httpx.Client) -> None:
    assert post(http, {**worker().dump(), "future_field": [1, 2]}).status_code == 200


def test_health(http: httpx.Client) -> None:
    response = http.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


# -- legacy and pdwire/2 entries ------------------------------------------------------------


def test_legacy_registration_gives_vllms_exact_documents(http: httpx.Client) -> None:
    assert post(http, worker(0, 0, 0)).json() == {"status": "ok"}
    entry = http.get("/query").json()["0"]
    assert set(entry) == {"engine_id", "worker_addr"}


def test_pdwire2_registrations_give_version_caps_sizes(http: httpx.Client) -> None:
    first = post(http, worker(0, 0, 0, **v2()))
    assert first.json() == {"status": "ok", "pdwire_version": 2}
    caps = ["deadline", "auth", "cancel"]  # the entry keeps the intersection
    assert post(http, worker(0, 1, 0, **v2(pdwire_caps=caps))).status_code == 200
    entry = http.get("/query").json()["0"]
    assert entry == {
        "engine_id": "engine-a",
        "worker_addr": {"0": {"0": "tcp://10.0.0.5:41000"}, "1": {"0": "tcp://10.0.0.5:41010"}},
        "pdwire_version": 2,
        "pdwire_caps": ["cancel", "deadline"],
        "tp_size": 2,
        "pp_size": 1,
        "fingerprint": {
            "model": "tiny-llama",
            "dtype": "bfloat16",
            "num_layers": 2,
            "num_kv_heads": 4,
            "head_size": 64,
            "block_size": 16,
            "kv_layout": "LBHNC",
        },
    }


def test_one_legacy_worker_makes_the_entry_legacy(http: httpx.Client) -> None:
    assert post(http, worker(0, 0, 0, **v2())).status_code == 200
    assert post(http, worker(0, 1, 0)).json() == {"status": "ok"}
    assert set(http.get("/query").json()["0"]) == {"engine_id", "worker_addr"}


def test_differing_engine_fields_are_400(http: httpx.Client) -> None:
    assert post(http, worker(0, 0, 0, **v2())).status_code == 200
    response = post(http, worker(0, 1, 0, **v2(tp_size=4)))
    assert response.status_code == 400
    assert "tp_size" in response.json()["detail"]
    assert "1" not in http.get("/query").json()["0"]["worker_addr"]


def test_legacy_server_drops_pdwire2_fields(make_server: ServerFactory) -> None:
    server = make_server(server_version=1)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        assert post(http, worker(0, 0, 0, **v2())).json() == {"status": "ok"}
        assert set(http.get("/query").json()["0"]) == {"engine_id", "worker_addr"}
        assert http.get("/health").status_code == 404  # vLLM's server has no /health


# -- authentication -------------------------------------------------------------------------


def test_register_tag_is_hmac_of_canonical_json() -> None:
    body = {"b": 1, "a": {"z": [1, 2], "y": "é"}}
    assert canonical_json(body) == b'{"a":{"y":"\\u00e9","z":[1,2]},"b":1}'
    want = hmac.new(KEY, canonical_json(body), hashlib.sha256).hexdigest()
    assert register_tag(body, KEY) == want
    assert want == want.lower() and len(want) == 64


def test_auth_unsigned_and_wrong_tags_are_401(make_server: ServerFactory) -> None:
    server = make_server(auth_key=KEY)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        unsigned = post(http, worker(**v2()))
        assert unsigned.status_code == 401
        assert unsigned.json() == {"detail": AUTH_FAILED_DETAIL}
        assert AUTH_FAILED_DETAIL == "AUTH_FAILED: auth_tag missing or invalid."
        wrong = signed_body(worker(**v2()), b"another key")
        assert post(http, wrong).status_code == 401
        tampered = {**signed_body(worker(**v2()), KEY), "tp_rank": 1}
        assert post(http, tampered).status_code == 401
        assert http.get("/query").json() == {}


@pytest.mark.asyncio
async def test_auth_signed_registration_is_accepted(make_server: ServerFactory) -> None:
    server = make_server(auth_key=KEY)
    reply = await register(server.url, worker(**v2(pdwire_caps=["auth"])), auth_key=KEY)
    assert reply.dump() == {"status": "ok", "pdwire_version": 2}
    # the tag covers the members as sent, unknown ones included
    body = sign_registration({**worker(0, 1, 0).dump(), "extra": "é"}, KEY)
    assert body["auth_key_id"] == key_id(KEY)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        assert post(http, body).status_code == 200


def test_auth_keys_rotate_by_id(make_server: ServerFactory) -> None:
    """8.6-R15/R16: a server holding a new and an old key accepts a registration signed with
    either, and refuses one that names no key by its id, though its tag is right."""
    new, old = b"new key", b"old key"
    server = make_server(auth_key=(new, old))
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        for rank, key in enumerate((new, old)):
            assert post(http, signed_body(worker(0, rank, 0, **v2()), key)).status_code == 200
        unnamed = signed_body(worker(0, 2, 0, **v2()), old)
        del unnamed["auth_key_id"], unnamed["auth_tag"]
        unnamed["auth_tag"] = register_tag(unnamed, old)
        assert post(http, unnamed).status_code == 401


# -- client retry and backoff ---------------------------------------------------------------


class _OnLog(logging.Handler):
    """Sets an event when a record containing ``needle`` is logged."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.seen.set()


@pytest.mark.asyncio
async def test_register_retries_until_the_server_starts(make_server: ServerFactory) -> None:
    port = free_port()
    server = BootstrapServer()
    handler = _OnLog("registration attempt 1/")
    client_logger = logging.getLogger("reference_connector.bootstrap_client")
    client_logger.addHandler(handler)

    def start_after_first_failure() -> None:
        if handler.seen.wait(WAIT):
            server.start(port=port)

    starter = threading.Thread(target=start_after_first_failure, daemon=True)
    starter.start()
    try:
        reply = await register(
            f"http://127.0.0.1:{port}",
            worker(),
            timeout=5.0,
            attempts=30,
            backoff=0.05,
            max_backoff=0.2,
        )
        assert reply.dump() == {"status": "ok"}
        assert handler.seen.is_set()
    finally:
        client_logger.removeHandler(handler)
        starter.join(WAIT)
        server.stop()


@pytest.mark.asyncio
async def test_register_gives_up_after_its_attempts(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    payload = worker()
    with pytest.raises(BootstrapError) as info:
        await register(url, payload, attempts=3, backoff=0.01)
    assert str(info.value) == (
        f"Failed to register {payload} with the Mooncake bootstrap server at {url} after 3 "
        "attempts."
    )
    assert info.value.status is None
    assert "registration attempt 3/3" in caplog.text


@pytest.mark.asyncio
async def test_register_retries_a_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(BootstrapError, match="after 2 attempts"):
            await register(url, worker(), timeout=0.2, attempts=2, backoff=0.01)


@pytest.mark.asyncio
async def test_http_errors_are_not_retried(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(auth_key=KEY)
    await register(server.url, worker(0, 0, 0), auth_key=KEY)
    posts = 0
    real_post = httpx.AsyncClient.post

    async def counting_post(self: httpx.AsyncClient, *args: Any, **kwargs: Any) -> Any:
        nonlocal posts
        posts += 1
        return await real_post(self, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "post", counting_post)
    conflict = worker(0, 0, 0, addr="tcp://10.0.0.9:1")
    with pytest.raises(BootstrapError) as info:
        await register(server.url, conflict, auth_key=KEY, backoff=0.01)
    assert (info.value.status, posts) == (400, 1)
    assert info.value.detail.startswith("Worker with dp_rank=0, tp_rank=0, pp_rank=0")
    with pytest.raises(BootstrapError) as info:
        await register(server.url, worker(0, 1, 0), backoff=0.01)  # unsigned
    assert (info.value.status, info.value.detail, posts) == (401, AUTH_FAILED_DETAIL, 2)


@pytest.mark.asyncio
async def test_query_of_unreachable_server_gives_up(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BootstrapError, match="after 3 attempts"):
        await query(url, attempts=3, delay=0.01)
    assert "query attempt 3/3" in caplog.text


@pytest.mark.asyncio
async def test_query_of_a_server_without_query_route_raises(make_server: ServerFactory) -> None:
    server = make_server()
    with pytest.raises(BootstrapError) as info:
        await query(server.url + "/nowhere")
    assert info.value.status == 404


# -- the server object and the CLI ----------------------------------------------------------


def test_server_lifecycle_and_bind_errors(make_server: ServerFactory) -> None:
    first = make_server()
    assert first.url == f"http://127.0.0.1:{first.port}" and first.alive
    with pytest.raises(OSError):
        BootstrapServer().start(port=first.port)
    with BootstrapServer() as second:
        assert httpx.get(f"{second.url}/health", timeout=WAIT).status_code == 200
    assert not second.alive


def test_cli_help_describes_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="pdwire")
    cli_bootstrap.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["bootstrap", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--auth-key-file", "--legacy", "8998"):
        assert flag in out
    args = parser.parse_args(["bootstrap"])
    assert (args.host, args.port, args.func) == ("127.0.0.1", 8998, cli_bootstrap.run)


def test_cli_rejects_an_empty_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(b"\n")
    args = argparse.Namespace(
        host="127.0.0.1", port=0, auth_key_file=str(key_file), accept_key_file=[], legacy=False
    )
    assert cli_bootstrap.run(args) == cli_bootstrap.EXIT_USAGE


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"no output from the CLI within {timeout}s")
    return proc.stdout.readline()


def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    cmd = [sys.executable, "-m", "reference_connector.cli_bootstrap", "--port", "0"]
    cmd += ["--auth-key-file", str(key_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        line = _read_line(proc, 30.0)
        assert "signed registrations" in line
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        unsigned = httpx.post(f"{url}/register", json=worker().dump(), timeout=WAIT)
        assert unsigned.status_code == 401
        signed = httpx.post(f"{url}/register", json=signed_body(worker(), KEY), timeout=WAIT)
        assert signed.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
