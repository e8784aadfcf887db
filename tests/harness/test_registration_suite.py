"""The registration suite's machinery: its scripted bootstrap server records what a real
registration client (pdwire's own, over real HTTP on loopback) does, and the command refuses a
bad template. Against the reference P, the cases run in ``test_self`` and their mutants in
``test_mutants``."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from conformance import cli
from conformance.case import WireLog
from conformance.peers import loop_lag
from conformance.peers.loop_lag import LoopLag
from conformance.peers.registrar import Registrar, Script
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
