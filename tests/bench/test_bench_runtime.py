"""The runtime ratios script runs end to end (agents over Mooncake on loopback) and reports
positive figures for every case. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference_connector.transport import TransportUnavailable

from . import runtime_ratios


def test_runtime_ratios_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runtime.json"
    try:
        assert runtime_ratios.main(["--quick", "--json", str(out)]) == 0
    except TransportUnavailable as exc:
        pytest.skip(f"Mooncake transfer engine unavailable: {exc}")
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in cases] == list(runtime_ratios.CASE_NAMES)
    for case in cases:
        for key in ("pdwire", "baseline", "ratio"):
            assert case[key] > 0, (case["case"], key)
    (transfer,) = (c for c in cases if c["case"] == "transfer")
    assert 0 < transfer["raw_cores"] < 64  # CPU time over wall time, of this process
    (control,) = (c for c in cases if c["case"] == "control")
    assert control["skeleton_us"] > 0 and control["skeleton_ratio"] > 0
    assert "ratio" in capsys.readouterr().out
