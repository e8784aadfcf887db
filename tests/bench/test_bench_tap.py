"""Smoke test of the tap benchmark: it runs and reports positive figures. No timing thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import tap_ratios

pytestmark = pytest.mark.bench


def test_tap_ratios_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tap.json"
    assert tap_ratios.main(["--quick", "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["case"] == tap_ratios.CASE_NAMES[0] and case["round_trips"] == 30
    for key in ("direct_us", "tapped_us", "ratio"):
        assert case[key] > 0, key
    assert "ratio" in capsys.readouterr().out
