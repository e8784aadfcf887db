"""vLLM's own worker code over the CPU backend's KV layout: given one cache per layer shaped
[blocks, heads, tokens, K and V] (``pdwire node --kv-layout together``), vLLM 0.32's P
registers one region per layer, and the harness's fake D, told ``--kv-layout together``, pairs
with it and gets every block it asked for; told ``apart``, vLLM's P refuses its pull."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest

from tests import suite_report

from .test_vllm_conformance import GEOMETRY, _node

pytestmark = [pytest.mark.vllm, pytest.mark.conformance]
pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

TRANSFER: Final = "producer/3.4/1"


def test_vllm_p_on_the_cpu_layout_pairs_with_a_fake_d_of_that_layout(tmp_path: Path) -> None:
    p = _node("prefill", "0.32.0", "--kv-layout", "together")
    try:
        verdicts = {}
        for layout in ("together", "apart"):
            _, doc = suite_report.run(
                tmp_path, layout,
                ["producer", "--api", p.url, "--bootstrap", p.bootstrap, *GEOMETRY,
                 "--kv-layout", layout, "--timeout", "5", "--cases", TRANSFER],
            )  # fmt: skip
            case = suite_report.only(doc)
            verdicts[layout] = (case["verdict"], case["detail"])
    finally:
        p.stop()
    assert verdicts["together"][0] == "pass", verdicts["together"]
    assert verdicts["apart"][0] == "fail"
    assert "Mooncake KV region length mismatch" in verdicts["apart"][1], verdicts["apart"]
