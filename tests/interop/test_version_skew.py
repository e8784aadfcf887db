"""The version-skew matrix stays alive and true: two of its cells, run as ``make matrix`` runs
them (``skew``), must read as ``docs/compatibility.md`` says. One pair of releases that works
together, and one whose P and D cannot transfer at all, which also shows the matrix's gate
blocking the rest of a cell with the error the pair exchanged."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from . import releases, skew

pytestmark = [pytest.mark.vllm, pytest.mark.conformance]
pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

#: P 0.28.0 x D 0.34.0: two layout generations apart in the connector, one engine layout.
WORKS = ("0.28.0", "0.34.0")
#: P 0.20.0 x D 0.28.0: vLLM 0.28's engine lays a block's K and V out together.
BROKEN = ("0.20.0", "0.28.0")


def _documented(prefill: str, decode: str) -> str:
    """The cell the docs' table gives the pair."""
    rows = [line for line in skew.documented().splitlines() if line.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0] == f"**vllm-{prefill}**":
            return cells[head.index(f"vllm-{decode}")]
    raise AssertionError(f"docs/compatibility.md has no row for P vllm-{prefill}")


def _cell(tmp_path: Path, prefill: str, decode: str) -> dict[str, Any]:
    doc = skew.run([prefill], [decode], tmp_path / f"{prefill}-{decode}.json")
    (cell,) = doc["results"]
    return dict(cell)


def test_cross_release_cell_reads_as_documented(tmp_path: Path) -> None:
    cell = _cell(tmp_path, *WORKS)
    assert not cell["error"], cell["error"]
    verdicts = {c["id"]: c["verdict"] for c in cell["cases"]}
    assert verdicts[skew.GATE] == "pass", cell
    assert skew.cell_text(cell) == _documented(*WORKS)


def test_layout_skew_fails_the_gate_and_blocks_the_rest(tmp_path: Path) -> None:
    cell = _cell(tmp_path, *BROKEN)
    verdicts = {c["id"]: c["verdict"] for c in cell["cases"]}
    assert verdicts.pop(skew.GATE) == "fail"
    assert set(verdicts.values()) == {"blocked"}
    # what vLLM 0.20's P answered, as the gate relayed it
    assert re.search(r"ERROR: Mooncake .*KV region", skew.gate_failure(cell)), cell
    assert skew.cell_text(cell) == _documented(*BROKEN)


def test_every_release_has_a_row_and_a_column() -> None:
    for p in releases.RELEASES:
        for d in releases.RELEASES:
            assert _documented(p, d)
