"""``pdwire run --soak`` end to end, through the command's Python entry: a short soak of the
reference pair with every fault injected comes out clean, and a P that never frees a sent
transfer's blocks (the ``p-keeps-blocks`` mutant, applied in this process, where the nodes'
fronts run) is reported as a leak. Each test starts a whole deployment (about 7 s)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mutants
from reference_connector import cli_run, soak
from reference_connector.transport import explain_import_error

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIELDS = {
    "requests",
    "terminal",
    "leaked_blocks_prefill",
    "leaked_blocks_decode",
    "late_terminal",
    "minutes",
    "fault_rate",
    "rps",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "faults",
    "samples",
    "windows",
}


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        return str(explain_import_error(exc))
    return None


pytestmark = pytest.mark.skipif(
    _mooncake_missing() is not None, reason=f"Mooncake unavailable: {_mooncake_missing()}"
)


def _soak(path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code = cli_run.main(["--soak", *args, "--json", str(path)])
    report: dict[str, Any] = json.loads(path.read_text())
    return code, report


def test_soak_with_every_fault_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _soak(tmp_path / "soak.json", "0.25", "--fault-rate", "0.3")
    out, err = capsys.readouterr()
    assert code == 0, out
    assert set(report) >= FIELDS
    assert report["minutes"] == 0.25 and report["fault_rate"] == 0.3
    assert report["requests"] == report["terminal"] > 0
    assert report["late_terminal"] == 0 and report["unexpected"] == 0
    assert report["leaked_blocks_prefill"] == report["leaked_blocks_decode"] == 0
    assert report["plain"]["outcomes"]["ok"] > 0 and report["rps"] > 0
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"]
    for kind in soak.FAULTS:
        fault = report["faults"][kind]
        assert fault["count"] >= 1, kind
        assert set(fault["outcomes"]) <= set(fault["expected"]), (kind, fault)
        assert fault["seconds_max"] <= fault["deadline_s"], (kind, fault)
    assert report["faults"]["give-up-before-first-token"]["outcomes"].get("abandoned", 0) >= 1
    assert report["samples"] and max(s["blocks_prefill"] for s in report["samples"]) > 0
    assert report["samples"][-1] == {
        "t": report["samples"][-1]["t"],
        "blocks_prefill": 0,
        "blocks_decode": 0,
    }
    assert (tmp_path / "soak.png").read_bytes()[:8] == PNG_MAGIC
    assert "leaked blocks P / D           0 / 0" in out
    assert "soak 5s:" in err  # the progress lines


@pytest.fixture
def p_keeps_blocks() -> Iterator[None]:
    mutants.apply("p-keeps-blocks")
    try:
        yield
    finally:
        mutants.apply("")


@pytest.mark.usefixtures("p_keeps_blocks")
def test_soak_reports_leaked_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _soak(
        tmp_path / "leak.json",
        *("0.03", "--fault-rate", "0", "--prompt-tokens", "16", "--num-blocks", "4096"),
        *("--drain-timeout", "1"),
    )
    out, _ = capsys.readouterr()
    assert code == 1, out
    per_request = 16 // 4  # P holds the prompt's blocks
    assert report["leaked_blocks_prefill"] == per_request * report["requests"] > 0
    assert report["leaked_blocks_decode"] == 0
    assert report["unexpected"] == report["late_terminal"] == 0
    assert (tmp_path / "leak.png").read_bytes()[:8] == PNG_MAGIC
