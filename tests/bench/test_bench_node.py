"""Smoke test of the node benchmark: it runs and reports every case with positive figures. No
timing thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import node_ratios

pytestmark = pytest.mark.bench


def test_node_ratios_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "node.json"
    assert node_ratios.main(["--quick", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in cases] == list(node_ratios.CASE_NAMES)
    for c in cases:
        assert c["bytes"] == 36 * 2 * 8 * 63 * 16 * 128 * 2
        for key in ("gb_per_s", "memcpy_gb_per_s", "ratio"):
            assert c[key] > 0, (c["case"], key)
    assert "ratio" in capsys.readouterr().out
