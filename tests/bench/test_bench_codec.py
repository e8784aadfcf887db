"""Codec benchmarks: pdwire against bare msgspec on the identical structs, per workload.

With ``--benchmark-disable`` (the default) each runs once as a smoke test; ``make bench`` times
them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from . import codec_ratios
from .codec_ratios import OPS, WORKLOAD_NAMES, Workload, workload

pytestmark = pytest.mark.bench


def _roundtrip(w: Workload, impl: str) -> Any:
    codec = w.codecs[impl]
    encode, decode, msg = codec.encode, codec.decode, w.msg
    return lambda: decode(encode(msg))


def _assert_legacy_bytes_match(w: Workload) -> None:
    assert w.codecs["pdwire"].encode(w.msg) == w.codecs["msgspec"].encode(w.msg)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_pdwire_encode_decode(benchmark: Any, name: str) -> None:
    w = workload(name)
    benchmark.group = name
    decoded = benchmark(_roundtrip(w, "pdwire"))
    assert decoded == w.expected("pdwire")
    _assert_legacy_bytes_match(w)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_msgspec_encode_decode(benchmark: Any, name: str) -> None:
    w = workload(name)
    benchmark.group = name
    decoded = benchmark(_roundtrip(w, "msgspec"))
    assert decoded == w.expected("msgspec")
    _assert_legacy_bytes_match(w)


def test_codec_ratios_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ratios.json"
    assert codec_ratios.main(["--quick", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert {(c["workload"], c["op"]) for c in cases} == {
        (name, op) for name in WORKLOAD_NAMES for op in OPS
    }
    assert len(cases) == len(WORKLOAD_NAMES) * len(OPS)
    for case in cases:
        assert set(case) == set(codec_ratios.KEYS)
        for key in ("pdwire_us", "msgspec_us", "pydantic_us", "bytes"):
            assert case[key] > 0, (case["workload"], case["op"], key)
    assert "ratio" in capsys.readouterr().out
