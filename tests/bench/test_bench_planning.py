"""Smoke test of the planning benchmark: it runs, reports every case, and the vectorised
descriptors copy the same bytes as the per-block loop. No timing thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import planning_ratios
from .planning_ratios import CASE_NAMES, case, same_bytes

pytestmark = pytest.mark.bench


def test_planning_ratios_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "planning.json"
    assert planning_ratios.main(["--quick", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in cases] == list(CASE_NAMES)
    for c in cases:
        for key in ("vectorised_us", "loop_us", "ratio"):
            assert c[key] > 0, (c["case"], key)
        assert c["regions"] == 72 and c["blocks"] == 63
        assert c["loop_descriptors"] == 72 * 63
        assert c["same_bytes"] is True
    assert "ratio" in capsys.readouterr().out


@pytest.mark.parametrize("name", CASE_NAMES)
def test_vectorised_equals_loop(name: str) -> None:
    c = case(name)
    vectorised, loop = c.vectorised(), c.loop()
    assert same_bytes(vectorised, loop)
    assert vectorised.total_bytes == sum(loop[2])
    coalesced = name == "TP1->TP1 contiguous"
    assert len(vectorised) == (72 if coalesced else 72 * 63)
