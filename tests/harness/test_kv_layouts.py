"""``--kv-layout``: a layer's K and V as regions of their own (FlashAttention's layout), as one
region whose blocks hold both (vLLM's CPU backend), or an MLA model's one latent region per layer.
The fake D takes the layout it is told, or the one P's fingerprint names (§3.6.1); the reference
node lays its pool out each way; a pair whose layouts differ cannot transfer (9.1-R2), one whose
layouts agree moves the prompt's KV byte for byte."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import pytest

from conformance import cli, testees
from pdwire.messages import layout_named
from pdwire.sim.geometry import Geometry
from tests import suite_report

pytestmark = pytest.mark.conformance
pytest.importorskip("mooncake.engine")

TRANSFER: Final = "producer/3.4/1"
#: Each run's wait for the testee (``--timeout``): the vLLM servers of another module may be
#: starting beside these runs. A case that passes or fails on an answer takes no longer for it.
WAIT: Final = "30"


def test_together_is_one_region_per_layer_of_both_halves() -> None:
    apart = Geometry(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, num_blocks=16)
    together = Geometry(
        num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, num_blocks=16, kv_layout="together"
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
        Geometry(packed_rows=True, kv_layout="together")


def test_mla_is_one_latent_region_per_layer_that_every_tp_rank_holds_whole() -> None:
    mla = Geometry(num_layers=3, num_kv_heads=1, head_dim=24, block_size=4, kv_layout="mla")
    for tp in (1, 2, 4):
        side = mla.side(tp, tp - 1, 1, 0, 0)
        assert [r.layer_index for r in side.regions] == [0, 1, 2]
        assert {r.kv_block_len for r in side.regions} == {24 * 4 * 2}
        assert side.replicated == (tp > 1)
    with pytest.raises(ValueError, match="1 KV head"):
        Geometry(num_kv_heads=2, kv_layout="mla")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        Geometry(kv_layout="sideways")


def test_the_fingerprint_names_each_layout_as_the_spec_registers_it() -> None:
    names = {
        layout: Geometry(num_kv_heads=1, kv_layout=layout).fingerprint("m").kv_layout
        for layout in ("apart", "together", "mla")
    }
    assert names == {"apart": "LBHNC", "together": "LBHN2C", "mla": "LBNC"}
    assert {layout_named(name) for name in names.values()} == set(names)
    assert layout_named("NHD") is None
    # packed rows place regions in rows; what a region's block holds is still LBHNC
    assert Geometry(packed_rows=True).fingerprint("m").kv_layout == "LBHNC"


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
         "--timeout", WAIT, "--cases", TRANSFER],
    )  # fmt: skip
    return suite_report.cases(doc)


def test_the_fake_d_takes_the_layout_it_is_told(p_together: testees.Testee, tmp_path: Path) -> None:
    assert _producer(p_together, tmp_path, "--kv-layout", "together")[TRANSFER]["verdict"] == "pass"
    wrong = _producer(p_together, tmp_path, "--kv-layout", "apart")[TRANSFER]
    assert wrong["verdict"] == "fail"
    assert "ERROR" in wrong["detail"], wrong["detail"]


def _pair_case(tmp_path: Path, p: testees.Testee, d: testees.Testee) -> dict[str, Any]:
    """pair/5.2/1 between ``p`` and ``d``: D's text equals its local one, and D checks every
    byte it loaded against the prompt's KV (the node's --verify-kv default)."""
    _, doc = suite_report.run(
        tmp_path, "pair",
        ["pair", "--prefill", f"{p.url}@{p.bootstrap}", "--decode", d.url, "--timeout", WAIT,
         "--cases", "pair/5.2/1"],
    )  # fmt: skip
    return suite_report.only(doc)


def _new_pair_case(tmp_path: Path, tp: int, profile: str, layout: Sequence[str]) -> dict[str, Any]:
    """``_pair_case`` between a new P of ``tp`` and a new D of TP 1, both started with
    ``layout``."""
    p = testees.start_node("prefill", tp=tp, profile=profile, extra=layout)
    d = testees.start_node("decode", profile=profile, extra=layout)
    try:
        return _pair_case(tmp_path, p, d)
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("d_layout", ["together", "apart"])
def test_a_pair_transfers_only_between_equal_layouts(
    p_together: testees.Testee, tmp_path: Path, d_layout: str
) -> None:
    d = testees.start_node("decode", profile="legacy", extra=["--kv-layout", d_layout])
    try:
        case = _pair_case(tmp_path, p_together, d)
    finally:
        d.stop()
    assert case["verdict"] == ("pass" if d_layout == "together" else "fail"), case["detail"]


def test_heads_split_over_tp_within_blocks_that_hold_k_and_v(tmp_path: Path) -> None:
    """P of TP 2 writes each half of the heads into D's blocks of TP 1, K and V together: the
    TP rules of §10.8 hold for that layout as they are (D checks every byte it loaded)."""
    case = _new_pair_case(tmp_path, 2, "legacy", ("--kv-layout", "together"))
    assert case["verdict"] == "pass", case["detail"]


def _preflight(p: testees.Testee, d: testees.Testee, capsys: pytest.CaptureFixture[str]) -> Any:
    capsys.readouterr()
    target = ["--prefill", f"{p.url}@{p.bootstrap}", "--decode", d.url]
    code = cli.main(["preflight", *target, "--json", "--timeout", WAIT])
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


def test_a_pdwire2_p_names_its_layout_and_the_suite_takes_it(tmp_path: Path) -> None:
    """Given no --kv-layout, the producer suite lays the fake D out as P's fingerprint names
    it; producer/3.6/4 checks that name."""
    p = testees.start_node("prefill", extra=["--kv-layout", "together"])
    try:
        _, doc = suite_report.run(
            tmp_path, "named",
            ["producer", "--api", p.url, "--bootstrap", p.bootstrap, *testees.GEOMETRY,
             "--timeout", WAIT, "--cases", f"{TRANSFER},producer/3.6/4"],
        )  # fmt: skip
    finally:
        p.stop()
    verdicts = suite_report.verdicts(doc)
    assert verdicts == {TRANSFER: "pass", "producer/3.6/4": "pass"}, doc["cases"]


#: An MLA model's geometry: one latent "head" of 32 elements; and as node flags, with its layout.
MLA_GEOMETRY: Final = ("--layers", "4", "--kv-heads", "1", "--head-dim", "32", "--block-size", "4")
MLA: Final = (*MLA_GEOMETRY, "--kv-layout", "mla")


@pytest.mark.parametrize("profile", ["legacy", "pdwire/2"])
def test_an_mla_p_serves_the_fake_d_of_its_layout(profile: str, tmp_path: Path) -> None:
    """A legacy P is told --kv-layout mla; a pdwire/2 P names it in its fingerprint."""
    p = testees.start_node("prefill", tp=2, profile=profile, extra=MLA)
    told = ("--kv-layout", "mla") if profile == "legacy" else ()
    try:
        _, doc = suite_report.run(
            tmp_path, "mla",
            ["producer", "--api", p.url, "--bootstrap", p.bootstrap, *MLA_GEOMETRY, *told,
             "--timeout", WAIT, "--cases", TRANSFER],
        )  # fmt: skip
    finally:
        p.stop()
    case = suite_report.only(doc)
    assert case["verdict"] == "pass", case["detail"]


def test_an_mla_pair_moves_the_latent_from_tp2_to_tp1(tmp_path: Path) -> None:
    """P of TP 2 holds the whole latent on each rank; D of TP 1 loads it from one of them and
    checks every byte."""
    case = _new_pair_case(tmp_path, 2, "pdwire/2", MLA)
    assert case["verdict"] == "pass", case["detail"]
