"""The cluster simulator (``pdwire.sim``, ``pdwire simulate``): deterministic, clean without
faults, legacy stalls against pdwire/2 deadlines under faults, and checks that can fail (mutant
sessions patched into ``pdwire.sim.cluster`` make each one fire)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import pdwire.sim.cluster as cluster
from pdwire.cli import main
from pdwire.consumer import ConsumerSession
from pdwire.events import FreeBlocks, ProducerInput, ProducerOutput
from pdwire.producer import ProducerSession
from pdwire.sim import Report, SimParams, simulate
from pdwire.versions import LEGACY, PDWIRE_2, Profile


def clean(report: Report) -> None:
    """No early free, no leak, no request late or left unreported."""
    assert report.early_frees == 0
    assert report.leaked_blocks == 0
    assert report.not_terminal == 0


# -- determinism ------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", [LEGACY, PDWIRE_2])
def test_same_seed_same_report(profile: Profile) -> None:
    params = SimParams(requests=150, fault_rate=0.3, seed=7, profile=profile, decode_tp=2)
    first, second = simulate(params), simulate(params)
    assert first.as_dict() == second.as_dict()
    other = simulate(dataclasses.replace(params, seed=8))
    assert other.as_dict() != first.as_dict()  # the seed matters: the check can fail


# -- without faults ---------------------------------------------------------------------------

CONFIGS = [
    pytest.param(dict(), id="P1-D1"),
    pytest.param(dict(prefill_tp=1, decode_tp=2), id="P1-D2"),
    pytest.param(dict(prefill_tp=4, decode_tp=2), id="P4-D2"),
    pytest.param(dict(prefill_tp=2, decode_tp=2, prefill_pp=2, decode_pp=1), id="P2x2-D2x1"),
    pytest.param(dict(prefill_tp=1, decode_tp=2, prefill_pp=1, decode_pp=2), id="P1x1-D2x2"),
    pytest.param(dict(prefill_tp=2, decode_tp=4, prefill_pp=4, decode_pp=2), id="P2x4-D4x2"),
    pytest.param(dict(prefill_instances=2, decode_instances=3, decode_tp=2), id="2P-3D"),
]


@pytest.mark.parametrize("profile", [LEGACY, PDWIRE_2])
@pytest.mark.parametrize("config", CONFIGS)
def test_no_faults_every_request_completes(config: dict[str, Any], profile: Profile) -> None:
    r = simulate(SimParams(requests=120, profile=profile, **config))
    assert r.requests == r.completed == 120
    assert r.failed == 0
    clean(r)
    assert r.late_terminal == 0
    assert r.stalled == 0
    assert r.faults == {}
    assert r.control_messages_per_request > 0


# -- with faults ------------------------------------------------------------------------------

FAULTY = SimParams(requests=600, fault_rate=0.3)


@pytest.fixture(scope="module")
def faulty() -> dict[str, Report]:
    return {p: simulate(dataclasses.replace(FAULTY, profile=p)) for p in (LEGACY, PDWIRE_2)}


def test_faults_stall_legacy(faulty: dict[str, Report]) -> None:
    r = faulty[LEGACY]
    assert r.stalled > 0
    assert r.late_terminal > 0
    assert r.p99_terminal_seconds >= 480
    assert r.not_terminal == 0
    assert r.leaked_blocks == 0


def test_faults_meet_the_deadline_under_pdwire2(faulty: dict[str, Report]) -> None:
    r = faulty[PDWIRE_2]
    assert r.late_terminal == 0
    assert r.stalled == 0
    assert r.max_terminal_seconds <= FAULTY.deadline + 1
    assert r.not_terminal == 0
    assert r.leaked_blocks == 0
    assert r.failed > 0  # the faults did happen
    assert set(r.faults) == set(cluster.FAULTS)


@pytest.mark.parametrize("profile", [LEGACY, PDWIRE_2])
def test_faults_free_nothing_early(faulty: dict[str, Report], profile: Profile) -> None:
    assert faulty[profile].early_frees == 0


def test_faults_free_nothing_early_without_that_pair() -> None:
    """Without duplicate transfer_ids the same faulty run has no early free."""
    faults = tuple(f for f in cluster.FAULTS if f != "duplicate-transfer-id")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cluster, "FAULTS", faults)
        for profile in (LEGACY, PDWIRE_2):
            r = simulate(dataclasses.replace(FAULTY, profile=profile))
            assert r.faults and "duplicate-transfer-id" not in r.faults
            clean(r)


# -- mutants: each check can fail ------------------------------------------------------------


class NeedSendOne(ProducerSession):
    """Frees after the first pull, whatever the TP fan-out and PP (breaks §10.3.1)."""

    def _open_pull(self, *args: Any, **kwargs: Any) -> Any:
        pull = super()._open_pull(*args, **kwargs)
        pull.need_send = 1
        return pull


class NeverFrees(ProducerSession):
    """Drops every FreeBlocks (breaks §10.9.3)."""

    def handle(self, event: ProducerInput, now: float) -> list[ProducerOutput]:
        return [o for o in super().handle(event, now) if not isinstance(o, FreeBlocks)]


class NoDeadline(ConsumerSession):
    """Never arms the pdwire/2 load deadline (breaks §10.11.3)."""

    def _push(self, when: float, kind: str, what: Any) -> None:
        if kind != "deadline":
            super()._push(when, kind, what)


# Short prompts: the prefill ends before the D workers' pulls, which then come one by one (D
# workers start within step_jitter of each other); overlapping pulls would hide an early free,
# since P never frees while a write reads the blocks.
SHORT = {"prompt_tokens": 32}


def test_mutant_need_send_one_frees_early(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SimParams(requests=100, prefill_tp=1, decode_tp=2, **SHORT)
    clean(simulate(params))
    monkeypatch.setattr(cluster, "ProducerSession", NeedSendOne)
    assert simulate(params).early_frees > 0


def test_mutant_need_send_one_frees_early_across_pp(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SimParams(requests=100, prefill_pp=1, decode_pp=2, **SHORT)
    clean(simulate(params))
    monkeypatch.setattr(cluster, "ProducerSession", NeedSendOne)
    assert simulate(params).early_frees > 0


def test_mutant_never_freeing_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SimParams(requests=100, decode_tp=2)
    monkeypatch.setattr(cluster, "ProducerSession", NeverFrees)
    r = simulate(params)
    assert r.leaked_blocks > 0
    assert r.leaked_blocks_prefill == r.leaked_blocks
    assert r.completed == 100  # D still loads: only the freeing is missing


def test_mutant_without_deadline_is_late(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SimParams(requests=300, fault_rate=0.3, profile=PDWIRE_2)
    assert simulate(params).late_terminal == 0
    monkeypatch.setattr(cluster, "ConsumerSession", NoDeadline)
    r = simulate(params)
    assert r.late_terminal > 0
    assert r.p99_terminal_seconds > params.deadline + 1


class NoRenewals(ConsumerSession):
    """A D that never sends a renewal, though it has a lease."""

    def _renew(self, engine_id: str, now: float) -> None:
        pass


@pytest.mark.parametrize("profile", [LEGACY, PDWIRE_2])
def test_lease_keeps_kv_through_long_d_queues(
    profile: Profile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§6.4: requests wait up to three leases in D's queue; the renewals keep their KV at P, so
    every one loads, nothing is freed early, nothing leaks and nothing waits for a 480 s timer.
    A D that does not renew loses requests to P's lease, and learns it at once (6.4-R5)."""
    params = SimParams(
        requests=200, profile=profile, lease=30.0, d_queue=90.0, deadline=200.0, **SHORT
    )
    r = simulate(params)
    clean(r)
    assert (r.completed, r.stalled) == (200, 0)
    assert r.max_terminal_seconds > params.lease  # waits longer than one lease were renewed
    monkeypatch.setattr(cluster, "ConsumerSession", NoRenewals)
    lost = simulate(params)
    assert lost.failed > 0 and lost.stalled == 0
    assert (lost.early_frees, lost.leaked_blocks) == (0, 0)


# -- the CLI ----------------------------------------------------------------------------------

REPORT_KEYS = {
    "requests",
    "completed",
    "failed",
    "early_frees",
    "leaked_blocks",
    "late_terminal",
    "p99_terminal_seconds",
    "control_messages_per_request",
}


def test_cli_simulate_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "report.json"
    argv = ["simulate", "--requests", "200", "--fault-rate", "0.2", "--json", str(path)]
    assert main([*argv, "--quiet"]) == 0
    report = json.loads(path.read_text())
    assert set(report) >= REPORT_KEYS
    assert report["requests"] == 200
    assert report["completed"] + report["failed"] + report["not_terminal"] == 200
    assert report["leaked_blocks"] == 0
    assert report["params"]["fault_rate"] == 0.2
    out, err = capsys.readouterr()
    assert "completed" in out
    assert err == ""  # --quiet: no progress lines


def test_cli_simulate_reports_progress_without_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "40", "--prefill-tp", "2", "--decode-tp", "1"]) == 0
    out, err = capsys.readouterr()
    assert "40/40 requests arrived" in err
    assert "early_frees" in out


def test_cli_simulate_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--fault-rate" in out
    assert "--json" in out
