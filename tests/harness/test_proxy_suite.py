"""The proxy suite (``pdwire conformance proxy``): the reference proxy passes every case, and a
proxy mutant fails the case that names it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conformance import cli
from conformance.case import CaseFailed
from conformance.command import with_env
from conformance.peers.backends import Hit
from conformance.suites import proxy_start
from conformance.suites.proxy_env import KEY_ENV, REFERENCE_COMMAND
from mutants import preload
from pdwire.limits import REFERENCE
from tests import suite_report

pytestmark = pytest.mark.conformance


def _run(tmp_path: Path, command: str, *args: str) -> tuple[int, dict[str, Any]]:
    return suite_report.run(tmp_path, "proxy", ["proxy", "--command", command, *args])


def test_reference_proxy_passes_every_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    key_command = f"{REFERENCE_COMMAND} --api-key-env {KEY_ENV}"
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps(REFERENCE.as_dict()))
    code, doc = _run(
        tmp_path, REFERENCE_COMMAND, "--key-command", key_command, "--limits", str(limits)
    )
    elapsed = time.monotonic() - start
    out = capsys.readouterr().out
    verdicts = {c["id"]: (c["verdict"], c["detail"]) for c in doc["cases"]}
    assert verdicts and all(i.startswith("proxy/") for i in verdicts)
    not_passed = {i: v for i, v in verdicts.items() if v[0] != "pass"}
    # 5.4-R16 needs port 8998: a machine where it is taken reports the case unsupported
    assert set(not_passed) <= {"proxy/5.4/17"}, not_passed
    assert all(v[0] == "unsupported" for v in not_passed.values()), not_passed
    assert code == cli.EXIT_OK, out
    print(f"proxy suite: {len(verdicts)} cases in {elapsed:.1f}s")


def test_a_proxy_mutant_fails_its_case(tmp_path: Path) -> None:
    code, doc = _run(
        tmp_path,
        with_env(REFERENCE_COMMAND, preload.environ("proxy-serial-legs")),
        "--cases",
        "proxy/5.4/7",
    )
    only = suite_report.only(doc)
    assert only["verdict"] == "fail", only
    assert "waited for P" in only["detail"]
    assert code == cli.EXIT_FAILED


def test_a_bad_template_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["proxy", "--command", "pdwire proxy --port {nope}"]) == cli.EXIT_USAGE
    assert "{prefill_url}" in capsys.readouterr().err


def _world(health: list[tuple[float, int]], queries: list[float]) -> Any:
    """A world whose fake P answered ``/health`` with (time, status) and whose fake bootstrap
    server got ``/query`` at these times: the hits alone, as the fake backends record them."""

    def hit(path: str, arrived: float, answered: float | None, status: int | None) -> Hit:
        return Hit("GET", path, {}, None, arrived, answered=answered, status=status)

    p = [hit("/health", at - 0.001, at, status) for at, status in health]
    bootstrap = [hit("/query", at, None, None) for at in queries]
    return SimpleNamespace(
        p=SimpleNamespace(of=lambda path: [h for h in p if h.path == path]),
        bootstrap=SimpleNamespace(of=lambda path: [h for h in bootstrap if h.path == path]),
    )


def test_a_query_after_a_503_fails_even_when_it_arrives_after_p_turned_healthy() -> None:
    """proxy/5.4/1's check pairs each /query with the last /health answer before it arrived: a
    query sent after a 503 is caught though it reached the bootstrap server after the case made
    P healthy (as a proxy that queries whatever /health answers does under load), and a proxy
    that queries only after a 200 passes."""
    polls = [(1.0, 503), (2.0, 503)]
    with pytest.raises(CaseFailed, match="answered 503, not 200"):
        proxy_start._expect_health_before_each_query(_world(polls, [2.1]))
    with pytest.raises(CaseFailed, match="answered nothing"):
        proxy_start._expect_health_before_each_query(_world(polls, [0.5]))
    proxy_start._expect_health_before_each_query(_world([*polls, (3.0, 200)], [3.1, 4.0]))
