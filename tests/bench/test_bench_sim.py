"""The simulator scaling script runs and its figures hold the invariants."""

from __future__ import annotations

import json
from pathlib import Path

from . import sim_scaling


def test_quick_scaling_run(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    assert sim_scaling.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["cases"]
    assert len(rows) == 7
    assert all(r["wall_seconds"] > 0 and r["us_per_request"] > 0 for r in rows)
    assert all(r["early_frees"] == 0 and r["leaked_blocks"] == 0 for r in rows)
    faulty = {r["profile"]: r for r in rows if r["fault_rate"] > 0}
    assert faulty["pdwire/2"]["late_terminal"] == 0
    assert faulty["legacy"]["late_terminal"] > 0
