"""The metrics' counts, their sum over workers, and their Prometheus text."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from reference_connector import metrics
from reference_connector.metrics import Counts


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_workers_add_up_and_render_as_prometheus_text() -> None:
    a, b = Counts(), Counts()
    a.inc("pdwire_p_replies_sent_total", "FINISH", 2)
    b.inc("pdwire_p_replies_sent_total", "FINISH")
    b.inc("pdwire_p_replies_sent_total", "ERROR")
    for seconds in (0.001, 0.1, 0.3):  # a bound itself falls in its own bucket (le)
        a.observe("pdwire_p_write_seconds", seconds)
    b.observe("pdwire_p_write_seconds", 600.0)
    total = metrics.add_up([a.snapshot(), b.snapshot()])
    s = _samples(metrics.render(total, {"pdwire_node_held_transfers": {"": 4.0}}))
    assert s[("pdwire_p_replies_sent_total", (("status", "FINISH"),))] == 3
    assert s[("pdwire_p_replies_sent_total", (("status", "ERROR"),))] == 1
    bucket = "pdwire_p_write_seconds_bucket"
    assert s[(bucket, (("le", "0.001"),))] == 1
    assert s[(bucket, (("le", "0.1"),))] == 2
    assert s[(bucket, (("le", "0.5"),))] == 3
    assert s[(bucket, (("le", "480.0"),))] == 3 and s[(bucket, (("le", "+Inf"),))] == 4
    assert s[("pdwire_p_write_seconds_count", ())] == 4
    assert s[("pdwire_p_write_seconds_sum", ())] == pytest.approx(600.401)
    assert s[("pdwire_node_held_transfers", ())] == 4


def test_a_node_s_stats_become_its_metrics() -> None:
    worker = Counts()
    worker.inc("pdwire_d_loads_total", "loaded", 5)
    stats = {
        "blocks_total": 512,
        "blocks_in_use": 12,
        "transfers_held": 0,
        "oldest_held_s": 0.0,
        "requests": {"total": 5, "active": 1, "verified": 5},
        "workers": [{"metrics": worker.snapshot()}, {"name": "a worker that did not answer"}],
    }
    s = _samples(metrics.of_node(stats))
    assert s[("pdwire_d_loads_total", (("outcome", "loaded"),))] == 5
    assert s[("pdwire_node_blocks", (("state", "free"),))] == 500
    assert s[("pdwire_node_requests_total", (("kind", "verified"),))] == 5
    assert ("pdwire_node_requests_total", (("kind", "active"),)) not in s


def test_every_metric_follows_the_naming_conventions() -> None:
    for m in metrics.METRICS:
        assert m.name.startswith("pdwire_") and m.name == m.name.lower(), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert m.help.endswith(".") and m.action, m.name
    with pytest.raises(AssertionError):
        Counts().inc("pdwire_no_such_metric_total")


def test_an_interval_is_what_counters_and_histograms_gained_and_sums_up_in_a_line() -> None:
    c = Counts()
    c.inc("pdwire_d_loads_total", "loaded", 2)
    c.inc("pdwire_d_leases", by=3)  # a gauge: an interval leaves it out
    c.observe("pdwire_d_pull_seconds", 0.2)
    before = c.snapshot()
    c.inc("pdwire_d_loads_total", "loaded")
    c.inc("pdwire_d_loads_total", "failed")
    c.observe("pdwire_d_pull_seconds", 0.4)
    gained = metrics.difference(c.snapshot(), before)
    assert gained["values"] == {"pdwire_d_loads_total": {"loaded": 1, "failed": 1}}
    assert gained["histograms"]["pdwire_d_pull_seconds"][-2:] == pytest.approx([0.4, 1])
    assert metrics.difference(c.snapshot(), c.snapshot()) == {"values": {}, "histograms": {}}
    assert metrics.summary(gained) == {
        "d_loads[failed]": 1,
        "d_loads[loaded]": 1,
        "d_pull_count": 1,
        "d_pull_mean_ms": 400.0,
    }
