"""The tax figures of ``pdwire run`` from the stats and timings the nodes report."""

from __future__ import annotations

from typing import Any

import pytest

from reference_connector import run_tax
from reference_connector.run_tax import Tax


def _write(d_reqs: list[str], started: float, ms: float, nbytes: int, status: int = 0) -> Any:
    return {"d_req_ids": d_reqs, "started": started, "ms": ms, "bytes": nbytes, "status": status}


P_STATS = {
    "workers": [
        # Worker 0 writes a's KV in two batches with a gap, then b's with c's.
        {"recent_writes": [_write(["a"], 10.0, 40.0, 400), _write(["a"], 10.1, 20.0, 200)]},
        {"recent_writes": [_write(["b", "c"], 20.0, 100.0, 1000)]},
        # A failed write counts for the span, not for the speed; "z" is another run's.
        {"recent_writes": [_write(["a"], 10.05, 10.0, 0, status=-1), _write(["z"], 1.0, 5, 9)]},
    ]
}


def test_write_time_spans_every_batch_of_the_request_over_every_worker() -> None:
    got = run_tax.write_ms(P_STATS, ["a", "b", "c"])
    assert got == pytest.approx({"a": 120.0, "b": 100.0, "c": 100.0})


def test_a_request_p_never_wrote_has_no_write_time() -> None:
    assert run_tax.write_ms(P_STATS, ["nobody"]) == {}
    assert run_tax.write_ms({"workers": [{"name": "a foreign agent's worker"}]}, ["a"]) == {}


def test_write_speed_counts_the_successful_writes_of_the_run_only() -> None:
    # 1600 bytes in 160 ms of successful writes for a, b and c.
    assert run_tax.write_gbps(P_STATS, ["a", "b", "c"]) == pytest.approx(1600 / 0.160 / 1e9)
    assert run_tax.write_gbps(P_STATS, ["nobody"]) is None


def test_overhead_is_ttft_less_the_compute_and_the_check() -> None:
    d = {"first_step": 1.0, "verify": 30.0}
    assert run_tax.overhead_ms(200.0, {"prefill": 100.0}, d) == pytest.approx(69.0)
    assert run_tax.overhead_ms(None, {"prefill": 100.0}, d) is None
    assert run_tax.overhead_ms(200.0, None, d) is None
    assert run_tax.overhead_ms(200.0, {"prefill": 100.0}, {"verify": 30.0}) is None


def test_targets_are_met_or_missed_by_the_medians() -> None:
    # raw 1 GB/s, 100 MB a request: the raw engine takes 100 ms, the overhead bound 125 ms.
    rows: list[dict[str, float | None]] = [
        {"write": 100.0, "pull": 150.0, "overhead": 120.0},
        {"write": 110.0, "pull": 170.0, "overhead": 130.0},
        {"write": None, "pull": None, "overhead": None},
        {"write": 90.0, "pull": 160.0, "overhead": 124.0},
    ]
    tax = Tax(rows, write_gbps=0.95, raw_gbps=1.0, kv_bytes=100_000_000)
    assert tax.p50() == {"write": 100.0, "pull": 160.0, "overhead": 124.0}
    assert tax.overhead_target_ms == pytest.approx(125.0)
    summary = tax.as_dict()
    assert summary["write_met"] is True and summary["overhead_met"] is True
    slow = Tax(rows, write_gbps=0.85, raw_gbps=1.0, kv_bytes=90_000_000)
    assert slow.as_dict()["write_met"] is False and slow.as_dict()["overhead_met"] is False


def test_without_the_raw_engine_no_target_is_judged() -> None:
    tax = Tax([{"write": 1.0, "pull": 2.0, "overhead": 3.0}], 1.0, None, 100)
    assert tax.write_ratio is None and tax.overhead_target_ms is None
    assert tax.as_dict()["write_met"] is None and tax.as_dict()["overhead_met"] is None
