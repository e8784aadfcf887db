"""A testee that stops serving: the run asks it after a failed case, and blocks the cases left
instead of letting each wait out its timeout; a case that may break a testee runs last. Each
probe tells a serving testee from one that was stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from conformance import cli, testees
from conformance.case import WireLog, all_cases
from conformance.peers.fake_d import exchange
from conformance.runner import in_run_order
from conformance.suites.consumer_env import ConsumerEnv, ConsumerOptions
from conformance.suites.pair_env import PairEnv, PairOptions
from conformance.suites.producer_env import ProducerEnv, ProducerOptions
from mutants import preload
from tests import suite_report

pytestmark = pytest.mark.conformance
pytest.importorskip("mooncake.engine")

#: The case whose malformed pull makes the mutant P's worker exit.
BREAKS: Final = "producer/2.1/5"


def test_a_p_that_stops_serving_blocks_the_cases_left(
    crashing_p: testees.Testee, tmp_path: Path
) -> None:
    cases = f"{BREAKS},producer/3.1/2,producer/3.4/1"
    code, doc = suite_report.run(
        tmp_path, "run",
        ["producer", "--api", crashing_p.url, "--bootstrap", crashing_p.bootstrap,
         "--timeout", "3", "--cases", cases],
    )  # fmt: skip
    assert code != cli.EXIT_OK
    ran = [(c["id"], c["verdict"], c["detail"]) for c in doc["cases"]]
    # producer/3.1/2 may break a testee itself, so it comes last
    assert [i for i, _, _ in ran] == [BREAKS, "producer/3.4/1", "producer/3.1/2"]
    assert ran[0][1] == "fail"
    for _, verdict, detail in ran[1:]:
        assert verdict == "blocked"
        assert f"stopped serving after {BREAKS}" in detail
        assert "did not answer GET /query" in detail, detail  # the whole node exited


def test_a_restart_that_fails_blocks_the_cases_left(
    crashing_p: testees.Testee, tmp_path: Path
) -> None:
    code, ran = _run(crashing_p.url, crashing_p.bootstrap, tmp_path, "--restart-command", "exit 3")
    assert code != cli.EXIT_OK
    assert [v for _, v, _ in ran] == ["fail", "blocked"], ran
    assert "restarting it failed: --restart-command exited with status 3" in ran[1][2]


def test_a_restart_command_brings_back_a_p_that_stopped(
    restartable_p: tuple[str, str, str], tmp_path: Path
) -> None:
    """After the case that crashes P, --restart-command starts it again, the run learns its new
    worker addresses, and the case after it runs and passes: with that failure known, the run
    is clean."""
    url, bootstrap, start = restartable_p
    known = tmp_path / "known-failing.txt"
    known.write_text(f"{BREAKS}  # the mutant's worker exits on it\n")
    code, ran = _run(
        url, bootstrap, tmp_path, "--restart-command", start, "--restart-timeout", "60",
        "--known-failing", str(known),
    )  # fmt: skip
    assert [(i, v) for i, v, _ in ran] == [(BREAKS, "fail"), ("producer/3.4/1", "pass")], ran
    assert "stopped serving after this case" in ran[0][2] and "was restarted" in ran[0][2]
    assert code == cli.EXIT_OK


def _run(
    url: str, bootstrap: str, tmp_path: Path, *extra: str
) -> tuple[int, list[tuple[str, str, str]]]:
    """``BREAKS`` then ``producer/3.4/1`` against the P at ``url``: the exit status and each
    case's id, verdict and detail, in run order."""
    code, doc = suite_report.run(
        tmp_path, "run",
        ["producer", "--api", url, "--bootstrap", bootstrap, "--timeout", "3",
         "--cases", f"{BREAKS},producer/3.4/1", *extra],
    )  # fmt: skip
    return code, [(c["id"], c["verdict"], c["detail"]) for c in doc["cases"]]


def test_cases_that_break_a_testee_run_last() -> None:
    for suite in ("producer", "consumer", "pair"):
        ordered = in_run_order(c for c in all_cases() if c.suite.value == suite)
        breaking = [c.breaks_testee for c in ordered]
        assert breaking == sorted(breaking), suite
    assert next(c for c in all_cases() if c.id == "producer/3.1/2").breaks_testee


@pytest.mark.asyncio
async def test_the_producer_probe_tells_a_serving_p_from_a_deaf_one() -> None:
    """The mutant's listener exits on a message of three frames, its bootstrap server stays."""
    p = testees.start_node("prefill", env=preload.environ("listener-exits-on-multi-frame"))
    env = ProducerEnv(ProducerOptions(p.url, p.bootstrap, request_timeout=3.0))
    try:
        await env.open()
        assert await env.serving() is None
        await exchange(env.zmq, env.entry["worker_addr"]["0"]["0"], [b"", b"\xc1"], 1.0, WireLog())
        why = await env.serving()
        assert why is not None and "answered nothing" in why and "lease renewal" in why, why
    finally:
        p.stop()
        await env.close()


@pytest.mark.asyncio
async def test_the_producer_probe_tells_a_p_that_can_take_no_request() -> None:
    """The mutant never frees a sent transfer's blocks and its pool holds one prompt's: after
    the probe's own request its side channel still answers, but no P leg can be served."""
    p = testees.start_node(
        "prefill", extra=["--num-blocks", "12"], env=preload.environ("p-keeps-blocks")
    )
    env = ProducerEnv(ProducerOptions(p.url, p.bootstrap, request_timeout=3.0))
    try:
        await env.open()
        assert await env.serving() is None
        why = await env.serving()
        assert why is not None and why.startswith("P did not answer a P leg within 3.0s"), why
    finally:
        p.stop()
        await env.close()


@pytest.mark.asyncio
async def test_the_consumer_probe_tells_a_serving_d_from_a_stopped_one() -> None:
    # the fake P writes random bytes, which a D that checks its KV takes for a failed load
    d = testees.start_node("decode", extra=["--no-verify-kv"])
    env = ConsumerEnv(ConsumerOptions(api=d.url, request_timeout=3.0))
    try:
        await env.open()
        assert await env.serving() is None
        d.stop()
        why = await env.serving()
        assert why is not None and why.startswith("D did not answer a plain request"), why
    finally:
        d.stop()
        await env.close()


@pytest.mark.asyncio
async def test_the_pair_probe_tells_a_serving_pair_from_a_broken_one() -> None:
    p = testees.start_node("prefill")
    d = testees.start_node("decode")
    env = PairEnv(PairOptions(p.url, p.bootstrap, d.url, request_timeout=3.0))
    try:
        await env.open()
        assert await env.serving() is None
        p.stop()
        why = await env.serving()
        assert why is not None and why.startswith("a plain request failed: P"), why
    finally:
        p.stop()
        d.stop()
        await env.close()


class _Stubborn(testees.ChildProcess):
    """A real process that ignores SIGTERM; ``wait`` after its SIGKILL raises as a stalled
    machine makes it (a stall cannot be caused here, so that one wait is faked)."""

    def __init__(self, log_path: Path) -> None:
        ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
        code = f"{ignore}; print('ready', flush=True); time.sleep(60)"
        self.log_path = log_path
        self.process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert self.process.stdout is not None and self.process.stdout.readline() == b"ready\n"
        self.waits: list[float | None] = []
        real_wait = self.process.wait

        def wait(timeout: float | None = None) -> int:
            self.waits.append(timeout)
            if len(self.waits) == 2:  # the wait after SIGKILL
                raise subprocess.TimeoutExpired(self.process.args, timeout or 0.0)
            return real_wait(timeout)

        self.process.wait = wait  # type: ignore[method-assign]


def test_a_process_not_reaped_after_its_sigkill_does_not_end_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "stubborn.log"
    log.write_text("its output")
    stubborn = _Stubborn(log)
    stubborn.stop(timeout=0.2)  # returns: SIGTERM ignored, SIGKILL sent, the reap timed out
    assert stubborn.waits == [0.2, testees.KILL_WAIT_S]
    assert f"process {stubborn.process.pid} was not reaped" in capsys.readouterr().err
    assert not log.exists()
    assert stubborn.process.wait(5.0) == -signal.SIGKILL  # the SIGKILL ended it
