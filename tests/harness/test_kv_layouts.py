"""``--kv-layout``: a layer's K and V as regions of their own (FlashAttention's layout) or as one
region whose blocks hold both (vLLM's CPU backend). The fake D takes the layout it is told; the
reference node lays its pool out either way; a pair whose layouts differ cannot transfer
(9.1-R2), one whose layouts agree moves the prompt's KV byte for byte."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from conformance import cli, testees
from pdwire.sim.geometry import Geometry
from tests import suite_report

pytestmark = pytest.mark.conformance
pytest.importorskip("mooncake.engine")

TRANSFER: Final = "producer/3.4/1"


def test_together_is_one_region_per_layer_of_both_halves() -> None:
    apart = Geometry(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, num_blocks=16)
    together = Geometry(
        num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, num_blocks=16, kv_together=True
    )
    a, t = apart.side(2, 1, 1, 0, 0).regions, together.side(2, 1, 1, 0, 0).regions
    assert len(a) == 6 and len(t) == 3
    assert [r.layer_name for r in t] == [r.layer_name for r in a[::2]]
    for r, k in zip(t, a[::2], strict=True):
        assert r.kv_block_len == r.block_len == 2 * k.kv_block_len
        assert r.row_offset == -1
    starts = [r.base_addr for r in t]
    assert all(b - a_ == 16 * t[0].block_len for a_, b in itertools.pairwise(starts))
    with pytest.raises(ValueError, match="packed rows"):
        Geometry(packed_rows=True, kv_together=True)


@pytest.fixture(scope="module")
def p_together() -> Iterator[testees.Testee]:
    p = testees.start_node("prefill", profile="legacy", extra=["--kv-layout", "together"])
    try:
        yield p
    finally:
        p.stop()


def _producer(p: testees.Testee, tmp_path: Path, *layout: str) -> dict[str, dict[str, str]]:
    _, doc = suite_report.run(
        tmp_path, "run",
        ["producer", "--api", p.url, "--bootstrap", p.bootstrap, *testees.GEOMETRY, *layout,
         "--timeout", "3", "--cases", TRANSFER],
    )  # fmt: skip
    return suite_report.cases(doc)


def test_the_fake_d_takes_the_layout_it_is_told(p_together: testees.Testee, tmp_path: Path) -> None:
    assert _producer(p_together, tmp_path, "--kv-layout", "together")[TRANSFER]["verdict"] == "pass"
    wrong = _producer(p_together, tmp_path, "--kv-layout", "apart")[TRANSFER]
    assert wrong["verdict"] == "fail"
    assert "ERROR" in wrong["detail"], wrong["detail"]


@pytest.mark.parametrize("d_layout", ["together", "apart"])
def test_a_pair_transfers_only_between_equal_layouts(
    p_together: testees.Testee, tmp_path: Path, d_layout: str
) -> None:
    d = testees.start_node("decode", profile="legacy", extra=["--kv-layout", d_layout])
    try:
        _, doc = suite_report.run(
            tmp_path, "pair",
            ["pair", "--prefill", f"{p_together.url}@{p_together.bootstrap}", "--decode", d.url,
             "--cases", "pair/5.2/1"],
        )  # fmt: skip
        case = suite_report.only(doc)
    finally:
        d.stop()
    # D checks every byte it loaded against the prompt's KV (the node's --verify-kv default)
    assert case["verdict"] == ("pass" if d_layout == "together" else "fail"), case["detail"]


def test_heads_split_over_tp_within_blocks_that_hold_k_and_v(tmp_path: Path) -> None:
    """P of TP 2 writes each half of the heads into D's blocks of TP 1, K and V together: the
    TP rules of §10.8 hold for that layout as they are (D checks every byte it loaded)."""
    layout = ("--kv-layout", "together")
    p = testees.start_node("prefill", tp=2, profile="legacy", extra=layout)
    d = testees.start_node("decode", profile="legacy", extra=layout)
    try:
        _, doc = suite_report.run(
            tmp_path, "pair",
            ["pair", "--prefill", f"{p.url}@{p.bootstrap}", "--decode", d.url,
             "--cases", "pair/5.2/1"],
        )  # fmt: skip
        case = suite_report.only(doc)
    finally:
        p.stop()
        d.stop()
    assert case["verdict"] == "pass", case["detail"]


def _preflight(p: testees.Testee, d: testees.Testee, capsys: pytest.CaptureFixture[str]) -> Any:
    capsys.readouterr()
    code = cli.main(
        ["preflight", "--prefill", f"{p.url}@{p.bootstrap}", "--decode", d.url, "--json"]
    )
    doc = json.loads(capsys.readouterr().out)
    (layout,) = (f for f in doc["findings"] if f["check"] == "kv layout")
    return code, layout


@pytest.mark.parametrize("d_layout", ["together", "apart"])
def test_preflight_names_a_layout_mismatch_before_any_traffic(
    p_together: testees.Testee, d_layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    d = testees.start_node("decode", profile="legacy", extra=["--kv-layout", d_layout])
    try:
        code, layout = _preflight(p_together, d, capsys)
    finally:
        d.stop()
    if d_layout == "together":
        assert (code, layout["status"]) == (0, "ok"), layout
    else:
        assert (code, layout["status"]) == (1, "PROBLEM"), layout
        assert "'together', D's 'apart'" in layout["detail"]
