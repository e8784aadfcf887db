"""The pytest plugin: an implementation's own pytest run checks its endpoints case by case, and
a case the testee fails fails that run's test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conformance import testees
from mutants import preload

pytestmark = pytest.mark.conformance
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def prefill() -> Iterator[testees.Testee]:
    p = testees.start_node("prefill", tp=2)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def mutant_prefill() -> Iterator[testees.Testee]:
    p = testees.start_node("prefill", tp=2, env=preload.environ("v2-to-legacy"))
    yield p
    p.stop()


def _run(pytester: pytest.Pytester, p: testees.Testee, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "--pyargs", "conformance.pytest_cases", "-p", "no:cacheprovider",
        "--pdwire-producer", f"{p.url}@{p.bootstrap}", "--pdwire-abort-timeout", "2",
        "--pdwire-timeout", "3", *args,
    )  # fmt: skip


def test_cases_run_as_tests(pytester: pytest.Pytester, prefill: testees.Testee) -> None:
    result = _run(
        pytester, prefill, "--pdwire-cases", "producer/3.4/1,producer/3.4/2", "--pdwire-cases",
        "consumer/3.2/*",
    )  # fmt: skip
    # No consumer testee is named: its cases skip.
    result.assert_outcomes(passed=2, skipped=_consumer_cases_matching("consumer/3.2/"))


def test_a_failing_case_fails_the_test(
    pytester: pytest.Pytester, mutant_prefill: testees.Testee
) -> None:
    result = _run(pytester, mutant_prefill, "--pdwire-cases", "producer/3.4/2")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*3.4-R6*", "*to a legacy pull carries*"])


def _consumer_cases_matching(prefix: str) -> int:
    from conformance.case import all_cases

    return sum(c.id.startswith(prefix) for c in all_cases())


#: The case whose malformed pull makes a crash-on-malformed P's worker exit.
BREAKS = "producer/2.1/5"


def test_a_testee_that_stops_serving_blocks_its_cases_left(
    pytester: pytest.Pytester, crashing_p: testees.Testee
) -> None:
    # -rN: no short summary, whose lines CI (the CI variable) prints untruncated
    result = _run(
        pytester, crashing_p, "-rN", "--pdwire-cases", f"producer/3.1/2,{BREAKS},producer/3.4/1"
    )
    result.assert_outcomes(failed=3)
    # the case that may break a testee runs last; the cases after the one that broke it are
    # blocked at once, naming it
    result.stdout.fnmatch_lines(
        [f"*{BREAKS}*", "*producer/3.4/1*", "*producer/3.1/2*"], consecutive=False
    )
    assert result.stdout.str().count(f"the testee stopped serving after {BREAKS}") == 2


def test_a_restart_command_brings_the_testee_back(
    pytester: pytest.Pytester, restartable_p: tuple[str, str, str]
) -> None:
    url, bootstrap, start = restartable_p
    result = pytester.runpytest_subprocess(
        "--pyargs", "conformance.pytest_cases", "-p", "no:cacheprovider",
        "--pdwire-producer", f"{url}@{bootstrap}", "--pdwire-timeout", "3",
        "--pdwire-cases", f"{BREAKS},producer/3.4/1",
        "--pdwire-restart-command", start, "--pdwire-restart-timeout", "60",
    )  # fmt: skip
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*stopped serving after this case*was restarted*"])
