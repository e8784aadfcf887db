"""The harness as a pytest plugin, so an implementation's own test suite runs the cases against
its endpoints.

Installed with pdwire (entry point ``pytest11``), it adds options and three things to use:

- a test argument ``pdwire_case``: the test runs once per case that ``--pdwire-cases`` selects;
- ``cases(glob)``: the cases to parametrize a test with by hand;
- the session fixture ``pdwire_testee``, whose ``check(case)`` runs one case against the testee
  the options name and turns its verdict into pytest's: pass passes; fail fails with the
  requirement and the wire log; non-strict warns (fails under ``--pdwire-strict``);
  informational passes; unsupported and skipped skip. After a failed case it asks the testee
  whether it still serves: when not, ``--pdwire-restart-command`` restarts it, and without one
  the cases left of that testee fail at once as blocked. Cases that may break a testee run
  last.

Every case at once, without writing a test::

    pytest --pyargs conformance.pytest_cases --pdwire-producer http://p:8000@http://p:8998

In a suite of one's own::

    def test_pdwire(pdwire_case, pdwire_testee):
        pdwire_testee.check(pdwire_case)
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdwire.sim.geometry import KV_LAYOUT_HELP, KV_LAYOUTS

from .case import Case, Suite, Verdict, WireLog, all_cases, limits_from_file
from .runner import (
    Result,
    RunOptions,
    blocked,
    in_run_order,
    probes,
    run_case,
    select,
    stopped_after,
)

_OPTIONS = {
    Suite.PRODUCER: "--pdwire-producer",
    Suite.CONSUMER: "--pdwire-consumer",
    Suite.PAIR: "--pdwire-pair",
    Suite.PROXY: "--pdwire-proxy",
    Suite.REGISTRATION: "--pdwire-registration",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pdwire", "pdwire conformance")
    group.addoption(
        "--pdwire-producer",
        metavar="API@BOOTSTRAP",
        help="run producer cases against this P (its API and bootstrap server)",
    )
    group.addoption("--pdwire-consumer", metavar="API", help="run consumer cases against this D")
    group.addoption(
        "--pdwire-pair",
        metavar="PREFILL[@BOOTSTRAP],DECODE",
        help="run pair cases against this P and D",
    )
    group.addoption(
        "--pdwire-proxy",
        metavar="TEMPLATE",
        help="run proxy cases against the proxy this command line starts (placeholders as "
        "pdwire conformance proxy --command takes them)",
    )
    group.addoption(
        "--pdwire-registration",
        metavar="TEMPLATE",
        help="run registration cases against the P this command line starts (placeholders as "
        "pdwire conformance registration --command takes them)",
    )
    group.addoption(
        "--pdwire-d-command",
        metavar="TEMPLATE",
        help="with --pdwire-consumer: the command line that starts a D like it, for the case "
        "that restarts D (as pdwire conformance consumer --d-command takes it)",
    )
    group.addoption(
        "--pdwire-registration-own",
        metavar="TEMPLATE",
        help="with --pdwire-registration: the command line that starts P without an external "
        "bootstrap server (as pdwire conformance registration --own-command takes it)",
    )
    group.addoption(
        "--pdwire-registration-dp",
        metavar="TEMPLATE",
        help="with --pdwire-registration: the command line that starts one engine of a "
        "data-parallel deployment (as pdwire conformance registration --dp-command takes it)",
    )
    group.addoption(
        "--pdwire-abort-timeout",
        type=float,
        metavar="S",
        help="the testee's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (timer cases)",
    )
    group.addoption(
        "--pdwire-kv-lease-duration",
        type=float,
        metavar="S",
        help="the testee's kv_lease_duration (vLLM 0.34, §6.4), 0 for none (lease cases)",
    )
    group.addoption(
        "--pdwire-kernel-block-size",
        type=int,
        metavar="N",
        help="with --pdwire-producer: P's attention kernel block size, when smaller than its "
        "block size (10.6.6)",
    )
    group.addoption(
        "--pdwire-sliding-window",
        type=int,
        metavar="W",
        help="the sliding window of the testee's KV-cache group 1 (10.4.7): with "
        "--pdwire-producer, P's odd layers; with --pdwire-consumer, D's group 1",
    )
    group.addoption(
        "--pdwire-mamba",
        action="store_true",
        help="with --pdwire-producer: P's odd layers are state-space layers, its KV-cache "
        "group 1 (10.6.3)",
    )
    group.addoption(
        "--pdwire-packed-rows",
        action="store_true",
        help="with --pdwire-producer: P's regions are slices of packed rows (10.7.8)",
    )
    group.addoption(
        "--pdwire-opaque-rows",
        action="store_true",
        help="with --pdwire-producer: P registers its packed rows whole (10.2.8, 10.6.7)",
    )
    group.addoption(
        "--pdwire-kv-layout",
        choices=KV_LAYOUTS,
        help="with --pdwire-producer, P's KV layout (default: as P's fingerprint names it, else "
        f"apart): {KV_LAYOUT_HELP}",
    )
    group.addoption(
        "--pdwire-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for any one reply of the testee (10)",
    )
    group.addoption(
        "--pdwire-restart-command",
        metavar="COMMAND",
        help="a shell command that restarts a testee that stopped serving after a failed case "
        "(as pdwire conformance --restart-command takes it); without it, the cases left of "
        "that testee fail at once as blocked",
    )
    group.addoption(
        "--pdwire-restart-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds for --pdwire-restart-command and the testee's return together (600)",
    )
    group.addoption(
        "--pdwire-limits",
        metavar="PATH",
        help="a JSON object of the testee's limits by name (chapter 13), as pdwire conformance "
        "--limits takes it; the cases past a limit are skipped without it",
    )
    group.addoption("--pdwire-strict", action="store_true", help="a failed SHOULD case fails")
    group.addoption(
        "--pdwire-cases",
        action="append",
        metavar="GLOB",
        help="the cases a test taking ``pdwire_case`` runs (default: all)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes the argument ``pdwire_case`` runs once per selected case."""
    if "pdwire_case" in metafunc.fixturenames:
        chosen = in_run_order(select(all_cases(), metafunc.config.getoption("--pdwire-cases")))
        metafunc.parametrize("pdwire_case", chosen, ids=[c.id for c in chosen])


def cases(glob: str = "*") -> list[Case]:
    """The cases whose id matches ``glob``, for ``pytest.mark.parametrize``."""
    return select(all_cases(), [glob])


class Testee:
    """The testees the options name, one suite world each, opened on first use in a loop thread
    of their own and closed at the end of the session."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="pdwire-conformance"
        )
        self._thread.start()
        self._worlds: dict[Suite, tuple[Any, Callable[[WireLog], Any]]] = {}
        self._stopped: dict[Suite, str] = {}  # why a suite's testee no longer serves
        self._options = RunOptions(
            strict=bool(config.getoption("--pdwire-strict")),
            restart_command=config.getoption("--pdwire-restart-command"),
            restart_timeout=float(config.getoption("--pdwire-restart-timeout")),
        )

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _world(self, suite: Suite) -> Callable[[WireLog], Any]:
        if suite not in self._worlds:
            target = self._config.getoption(_OPTIONS[suite])
            if not target:
                pytest.skip(f"{_OPTIONS[suite]} not given: no {suite.value} testee")
            env, ctx_for = _open(suite, str(target), self._config)
            self._call(env.open(), 120)
            self._worlds[suite] = (env, ctx_for)
        return self._worlds[suite][1]

    def run(self, case: Case) -> Result:
        """Run ``case``; after it failed, ask its testee whether it still serves, restart it
        when told how, and else block the cases left of that testee."""
        if case.suite in self._stopped:
            return blocked(case, self._stopped[case.suite])
        ctx_for = self._world(case.suite)
        result: Result = self._call(run_case(case, ctx_for, self._options))
        serving, restart = probes(self._worlds[case.suite][0], self._options)
        if serving is not None:
            why = self._call(stopped_after(result, serving, restart))
            if why is not None:
                self._stopped[case.suite] = why
        return result

    def check(self, case: Case) -> None:
        r = self.run(case)
        req = f"[{case.level.value}] {case.requirement.id}: {case.requirement.text}"
        if r.verdict in (Verdict.UNSUPPORTED, Verdict.SKIPPED):
            pytest.skip(f"{r.verdict.value}: {r.detail}")
        if r.verdict is Verdict.NON_STRICT:
            warnings.warn(f"{case.id} non-strict: {r.detail}\n{req}", stacklevel=2)
        elif r.verdict is Verdict.BLOCKED:
            pytest.fail(f"{case.id} {case.title}\n{r.detail}", pytrace=False)
        elif r.verdict is Verdict.FAIL:
            log = "\n".join(
                f"{e.t:8.3f}s {e.direction} {e.channel} {e.what}" for e in r.log.entries
            )
            pytest.fail(f"{case.id} {case.title}\n{req}\n{r.detail}\n{log}", pytrace=False)

    def close(self) -> None:
        for env, _ in self._worlds.values():
            self._call(env.close(), 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _open(suite: Suite, target: str, config: pytest.Config) -> tuple[Any, Callable[[WireLog], Any]]:
    abort = config.getoption("--pdwire-abort-timeout")
    lease = config.getoption("--pdwire-kv-lease-duration")
    timeout = float(config.getoption("--pdwire-timeout"))
    try:
        limits = limits_from_file(config.getoption("--pdwire-limits"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if suite is Suite.PRODUCER:
        from .suites.producer_env import ProducerCtx, ProducerEnv, ProducerOptions

        api, _, bootstrap = target.partition("@")
        penv = ProducerEnv(
            ProducerOptions(
                api=api,
                bootstrap=bootstrap,
                abort_timeout=abort,
                kv_lease_duration=lease,
                request_timeout=timeout,
                kernel_block_size=config.getoption("--pdwire-kernel-block-size"),
                sliding_window=config.getoption("--pdwire-sliding-window"),
                mamba=config.getoption("--pdwire-mamba"),
                packed_rows=config.getoption("--pdwire-packed-rows"),
                opaque_rows=config.getoption("--pdwire-opaque-rows"),
                kv_layout=config.getoption("--pdwire-kv-layout"),
                limits=limits,
            )
        )
        return penv, lambda log: ProducerCtx(penv, log)
    if suite is Suite.CONSUMER:
        from .suites.consumer_env import ConsumerCtx, ConsumerEnv, ConsumerOptions

        cenv = ConsumerEnv(
            ConsumerOptions(
                api=target,
                abort_timeout=abort,
                kv_lease_duration=lease,
                request_timeout=timeout,
                d_command=config.getoption("--pdwire-d-command"),
                sliding_window=config.getoption("--pdwire-sliding-window"),
            )
        )
        return cenv, lambda log: ConsumerCtx(cenv, log)
    if suite is Suite.PROXY:
        from .suites.proxy_env import ProxyCtx, ProxyEnv, ProxyOptions

        xenv = ProxyEnv(ProxyOptions(command=target, request_timeout=timeout, limits=limits))
        return xenv, lambda log: ProxyCtx(xenv, log)
    if suite is Suite.REGISTRATION:
        from .suites.registration_env import (
            RegistrationCtx,
            RegistrationEnv,
            RegistrationOptions,
        )

        renv = RegistrationEnv(
            RegistrationOptions(
                command=target,
                own_command=config.getoption("--pdwire-registration-own"),
                dp_command=config.getoption("--pdwire-registration-dp"),
                request_timeout=timeout,
            )
        )
        return renv, lambda log: RegistrationCtx(renv.options, log)
    from pdwire.http_models import parse_prefill

    from .suites.pair_env import PairCtx, PairEnv, PairOptions

    prefill, _, decode = target.partition(",")
    api, bootstrap = parse_prefill(prefill)
    pairenv = PairEnv(
        PairOptions(
            prefill=api, prefill_bootstrap=bootstrap, decode=decode, request_timeout=timeout
        )
    )
    return pairenv, lambda log: PairCtx(pairenv, log)


@pytest.fixture(scope="session")
def pdwire_testee(request: pytest.FixtureRequest) -> Iterator[Testee]:
    testee = Testee(request.config)
    yield testee
    testee.close()
