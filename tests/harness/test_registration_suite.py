"""The registration suite's machinery: its scripted bootstrap server records what a real
registration client (pdwire's own, over real HTTP on loopback) does, and the command refuses a
bad template. Against the reference P, the cases run in ``test_self`` and their mutants in
``test_mutants``."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
import zmq.asyncio

from conformance import cli
from conformance.case import WireLog
from conformance.peers import loop_lag
from conformance.peers.loop_lag import LoopLag
from conformance.peers.registrar import Registrar, Script
from conformance.suites import registration
from pdwire.http_models import RegisterWorkerPayload
from reference_connector import bootstrap_client
from reference_connector.bootstrap_client import BootstrapError
from tests import suite_report

PAYLOAD = RegisterWorkerPayload(
    engine_id="e", dp_rank=0, tp_rank=1, pp_rank=0, addr="tcp://127.0.0.1:5555"
)


async def _register(script: Script, **kw: float) -> tuple[Registrar, BaseException | None]:
    registrar = Registrar(script, WireLog())
    await registrar.start()
    error: BaseException | None = None
    try:
        await bootstrap_client.register(registrar.url, PAYLOAD, **kw)
    except BootstrapError as exc:
        error = exc
    finally:
        # the client's last close can reach the server a moment after the client gave up
        await registrar.wait(lambda: all(a.closed for a in registrar.attempts), 2.0)
        await registrar.stop()
    return registrar, error


@pytest.mark.asyncio
async def test_a_stalled_registration_is_seen_attempt_by_attempt() -> None:
    registrar, error = await _register(Script("stall"), timeout=0.2, backoff=0.1)
    assert isinstance(error, BootstrapError) and "after 3 attempts" in str(error)
    attempts = registrar.registrations()
    assert [a.worker for a in attempts] == [(0, 1, 0)] * 3
    lag = registrar.lag.late_by
    for a in attempts:
        assert a.arrived is not None and a.closed is not None and a.answered is None
        assert a.body["addr"] == PAYLOAD.addr
        assert 0.15 <= a.closed - a.arrived < 1.0 + lag(a.closed)  # the client's timeout ended it
    for before, after in itertools.pairwise(attempts):
        assert before.closed is not None
        assert after.opened - before.closed >= 0.09 - lag(before.closed)


@pytest.mark.asyncio
async def test_a_refused_registration_is_answered_and_not_retried() -> None:
    registrar, error = await _register(Script("reject", status=400))
    assert isinstance(error, BootstrapError) and error.status == 400
    [attempt] = registrar.attempts
    assert attempt.is_registration and attempt.answered is not None


@pytest.mark.asyncio
async def test_an_accepted_registration_is_held_as_the_script_says() -> None:
    start = time.monotonic()
    registrar, error = await _register(Script("accept", hold=0.3))
    assert error is None
    [attempt] = registrar.attempts
    assert attempt.arrived is not None and attempt.answered is not None
    assert attempt.answered - attempt.arrived >= 0.3
    assert attempt.answered - start < 5.0


@pytest.mark.asyncio
async def test_loop_lag_sees_a_stall_of_the_loop_and_only_around_it() -> None:
    lag = LoopLag()
    lag.start()
    try:
        await asyncio.sleep(0.05)  # the ticker runs on time
        before = time.monotonic()
        time.sleep(0.3)  # the stall: the loop cannot run
        await asyncio.sleep(0)  # the ticker runs again
        after = time.monotonic()
        await asyncio.sleep(3 * loop_lag.TICK_S)
    finally:
        await lag.stop()
    assert lag.late_by(after) >= 0.29
    assert lag.late_by(before - loop_lag.TICK_S) < 0.29  # the stall is not put before it
    assert lag.late_by(after + 1.0) == 0.0


class _Worker:
    """A P worker that registers over a raw connection, opened before it sends, and answers
    every message at its ROUTER only once its registration was answered 200 (4.4-R6)."""

    def __init__(self, ctx: zmq.asyncio.Context, tp_rank: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.payload = RegisterWorkerPayload(
            engine_id="e", dp_rank=0, tp_rank=tp_rank, pp_rank=0, addr=f"tcp://127.0.0.1:{port}"
        )
        self.writer: asyncio.StreamWriter | None = None
        self.serving: asyncio.Task[None] | None = None

    async def connect(self, registrar: Registrar) -> None:
        reader, self.writer = await asyncio.open_connection(registrar.host, registrar.port)
        self.serving = asyncio.create_task(self._serve_once_registered(reader))

    def send(self) -> None:
        assert self.writer is not None
        body = self.payload.model_dump_json().encode()
        head = f"POST /register HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
        self.writer.write(head.encode() + body)

    async def _serve_once_registered(self, reader: asyncio.StreamReader) -> None:
        status = (await reader.readline()).split()[1]
        assert status == b"200", status
        while True:
            identity, *_ = await self.sock.recv_multipart()
            await self.sock.send_multipart([identity, b"an ERROR"])

    async def close(self) -> None:
        if self.serving is not None:
            self.serving.cancel()
            await asyncio.gather(self.serving, return_exceptions=True)
        if self.writer is not None:
            self.writer.close()
        self.sock.close(linger=0)


@pytest.mark.asyncio
async def test_each_probe_is_checked_against_its_own_registration() -> None:
    """4.4-R6's check pairs each probe with the registration it was sent for. Worker 0 opens its
    connection first and sends its registration after worker 1's was read, so the list of
    registrations (in the order connections opened) puts it first only then; each worker
    answers only after its own 200, so the check passes."""
    registrar = Registrar(Script("accept", hold=0.5), WireLog())
    await registrar.start()
    ctx = zmq.asyncio.Context()
    first, second = _Worker(ctx, 0), _Worker(ctx, 1)
    try:
        await first.connect(registrar)
        await second.connect(registrar)
        second.send()
        assert await registrar.wait(lambda: len(registrar.registrations()) == 1, 5.0)
        await asyncio.sleep(0.2)  # the order to cause: worker 0's arrives 0.2 s after worker 1's
        first.send()
        t: Any = SimpleNamespace(options=SimpleNamespace(request_timeout=5.0), log=WireLog())
        await registration._probe_while_held(t, SimpleNamespace(registrar=registrar))
        attempts = registrar.registrations()
        assert [a.worker for a in attempts] == [(0, 0, 0), (0, 1, 0)]
        assert attempts[0].answered and attempts[1].answered
        assert attempts[0].answered - attempts[1].answered >= 0.15
    finally:
        await first.close()
        await second.close()
        ctx.destroy(linger=0)
        await registrar.stop()


def test_a_bad_template_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["registration", "--command", "pdwire node --port {nope}"])
    assert code == cli.EXIT_USAGE
    assert "{bootstrap_address}" in capsys.readouterr().err


def test_a_bad_own_template_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "registration",
            "--command",
            "pdwire node --port {port} --bootstrap {bootstrap_address}",
            "--own-command",
            "pdwire node --port {port} --bootstrap {bootstrap_address}",
        ]
    )
    assert code == cli.EXIT_USAGE
    assert "use {python}, {port}" in capsys.readouterr().err


def test_the_own_server_case_is_skipped_without_own_command(tmp_path: Path) -> None:
    template = "pdwire node --port {port} --bootstrap {bootstrap_address}"
    args = ["registration", "--command", template, "--cases", "registration/4.4/5"]
    code, doc = suite_report.run(tmp_path, "r", args, quiet=False)
    assert code == cli.EXIT_OK
    row = suite_report.only(doc)
    assert row["verdict"] == "skipped" and "--own-command" in row["detail"]
