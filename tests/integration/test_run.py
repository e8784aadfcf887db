"""``pdwire run`` end to end: each test starts a whole deployment (P node with its bootstrap
server, D node, proxy) on loopback through the command's Python entry, with a small KV geometry
and a few short requests, and reads the ``--json`` report. Node start-up dominates (about 3 s a
node); the expected texts of such small prompts cost nothing.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, NoReturn

import pytest

from pdwire import cli
from reference_connector import cli_run, run
from reference_connector.kv_content import KVShape
from reference_connector.node import NodeConfig
from reference_connector.transport import explain_import_error

SMALL = [
    *("--layers", "4", "--kv-heads", "8", "--head-dim", "16", "--block-size", "4"),
    *("--requests", "3", "--concurrency", "2", "--prompt-tokens", "64", "--max-tokens", "8"),
    *("--raw-repeats", "3", "--timeout", "60"),
]
SHAPE = KVShape(num_layers=4, num_kv_heads=8, head_dim=16, block_size=4)
KEYS = {
    "requests",
    "verified",
    "failed",
    "transfer_gbps",
    "raw_engine_gbps",
    "descriptors_per_request",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_split_ms_p50",
    "transfer_to_raw_ratio",
}


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        return str(explain_import_error(exc))
    return None


needs_mooncake = pytest.mark.skipif(
    _mooncake_missing() is not None, reason=f"Mooncake unavailable: {_mooncake_missing()}"
)


def _run(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "run.json"
    code = cli_run.main([*SMALL, *extra, "--json", str(path)])
    report: dict[str, Any] = json.loads(path.read_text())
    return code, report


@needs_mooncake
@pytest.mark.parametrize(
    ("extra", "p_split"),
    [
        pytest.param((), "TP1 PP1", id="1P1D-pdwire2"),
        pytest.param(("--profile", "legacy"), "TP1 PP1", id="1P1D-legacy"),
        pytest.param(("--prefill-tp", "2"), "TP2 PP1", id="P-TP2-to-D-TP1"),
        pytest.param(("--decode-tp", "2"), "TP1 PP1", id="P-TP1-to-D-TP2"),
        pytest.param(("--prefill-pp", "2"), "TP1 PP2", id="P-PP2-to-D-PP1"),
    ],
)
def test_every_request_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], p_split: str
) -> None:
    code, report = _run(tmp_path, *extra)
    out, err = capsys.readouterr()
    assert code == 0, out
    assert set(report) >= KEYS
    assert report["requests"] == report["verified"] == 3 and report["failed"] == 0
    assert report["transfer_gbps"] > 0 and report["raw_engine_gbps"] > 0
    assert report["transfer_to_raw_ratio"] > 0
    assert report["descriptors_per_request"] > 0
    assert set(report["ttft_split_ms_p50"]) == set(run.SPLIT_KEYS)
    assert report["ttft_ms_p50"] > 0
    # Every byte P wrote is one D verified, and both pools are empty again.
    kv = run.prompt_kv_bytes(SHAPE, 64)
    assert report["bytes_written"] == report["bytes_verified"] == 3 * kv
    assert report["blocks_left"] == {"prefill": 0, "decode": 0}
    for r in report["per_request"]:
        split = r["split_ms"]
        assert split["transfer"] >= 0 and split["p_prefill"] >= 0 and split["wait"] >= 0
        assert sum(split.values()) == pytest.approx(r["ttft_ms"], abs=0.01)
        # P's writes happen inside D's pull: the pull left before them and ends with the reply.
        tax = r["tax_ms"]
        assert 0 < tax["write"] <= tax["pull"] and tax["overhead"] > 0
    assert report["tax"]["write_gbps"] > 0 and report["tax"]["overhead_target_ms"] > 0
    assert f"starting P node ({p_split}) with its bootstrap server" in err
    assert "verified" in out and "raw engine" in out
    assert "P write (p50)" in out and "D pull (p50)" in out and "overhead (p50)" in out


@needs_mooncake
def test_a_replicated_p_writes_each_replica_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A P of TP 2 over one KV head, whose ranks hold the same KV: D of TP 1 verifies every
    byte, and P wrote each request's KV once, not once a rank (10.8.7)."""
    code, report = _run(tmp_path, "--kv-heads", "1", "--prefill-tp", "2")
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert report["requests"] == report["verified"] == 3
    kv = run.prompt_kv_bytes(dataclasses.replace(SHAPE, num_kv_heads=1), 64)
    assert report["bytes_written"] == report["bytes_verified"] == 3 * kv
    assert report["blocks_left"] == {"prefill": 0, "decode": 0}


@needs_mooncake
def test_a_wrong_text_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injected only here: the expected-text function returns a text no node decodes."""
    monkeypatch.setattr(run, "expected_text", lambda shape, prompt, max_tokens: "w1 w2 w3")
    code, report = _run(tmp_path)
    out, _ = capsys.readouterr()
    assert code == 1
    assert report["verified"] == 0 and report["failed"] == report["requests"] == 3
    assert all(f["why"].startswith("text differs") for f in report["failures"])
    assert "failed requests:" in out and "text differs" in out


class _Recorded(Exception):
    pass


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_both_nodes_start_their_workers_as_told(
    start: run.WorkerStart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--worker-start fork``, P's node starts alone, before D's; spawned, D's starts
    beside it. A stand-in for the node server records each config and starts nothing."""
    seen: list[tuple[str, str]] = []
    d_started = threading.Event()

    def record(config: NodeConfig) -> NoReturn:
        seen.append((config.role, config.worker_start))
        if config.role == "decode":
            d_started.set()
        elif start == "spawn":
            assert d_started.wait(10.0), "D's node did not start beside P's"
        raise _Recorded

    monkeypatch.setattr(run, "NodeServer", record)
    deployment = run.Deployment(run.RunConfig(worker_start=start), run.Progress())
    with pytest.raises(_Recorded):
        deployment.start()
    expected = [("prefill", start)] if start == "fork" else [("decode", start), ("prefill", start)]
    assert sorted(seen) == expected


def test_bad_geometry_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_run.main(["--decode-tp", "3"]) == cli_run.EXIT_USAGE
    assert "TP 3 must divide the 8 KV heads" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [(), ("--soak", "1")])
def test_a_lease_that_is_not_positive_is_a_usage_error(
    extra: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """§6.4: refused before any node starts, with vLLM 0.34's message, with or without --soak."""
    assert cli_run.main(["--kv-lease-duration", "0", *extra]) == cli_run.EXIT_USAGE
    assert "kv_lease_duration must be positive, got 0.0." in capsys.readouterr().err


def test_pdwire_run_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdwire run --help``; the entry point is added here when the install lacks it."""
    registered = entry_points(group=cli.COMMANDS_GROUP)
    if "run" not in registered.names:
        extra = EntryPoint("run", "reference_connector.cli_run", cli.COMMANDS_GROUP)
        monkeypatch.setattr(cli, "entry_points", lambda group: [*registered, extra])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--requests", "--concurrency", "--prefill-pp", "--worker-start", "--json"):
        assert option in out
