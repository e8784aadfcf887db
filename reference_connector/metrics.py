"""The metrics of the reference deployment, for ``GET /metrics`` in the Prometheus text format.

Every metric is declared once here (``METRICS``), with what an operator does when it moves; the
docs list them from the same declarations. Workers count with ``Counts`` (plain numbers, so a
worker process imports no metrics library) and hand a snapshot over in their stats; the node,
the proxy and the bootstrap server add them up and render them with ``prometheus_client`` at
each scrape.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

Kind = Literal["counter", "gauge", "histogram"]

#: Histogram bounds in seconds: a release-only pull takes about 1 ms, the seeds' write 100 ms,
#: and a legacy stall 480 s.
SECONDS_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 480.0)


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    label: str | None  # the one label, if any
    action: str  # what an operator does when it moves


def _m(name: str, kind: Kind, label: str | None, help: str, action: str) -> Metric:
    return Metric(name, kind, help, label, action)


METRICS: Final = (
    # P's workers
    _m("pdwire_p_messages_received_total", "counter", None,
       "Side-channel messages P's workers received (pulls, cancels, heartbeats).",
       "Flat while D serves requests: D cannot reach P's workers (check /query and the ports)."),
    _m("pdwire_p_replies_sent_total", "counter", "status",
       "Replies P's workers sent, by status (FINISH, CONTINUE, ERROR, LAYOUT_MISS).",
       "ERROR rising: read pdwire_p_failures_total for why; LAYOUT_MISS rising: P restarts or "
       "evicts layouts."),
    _m("pdwire_p_failures_total", "counter", "code",
       "Requests P's replies failed, by error code (UNKNOWN: a legacy reply names no code).",
       "Each code has its fix in the failure table of the operations docs."),
    _m("pdwire_p_writes_total", "counter", "result",
       "Batch writes into D's memory, by result (ok, failed).",
       "failed rising: the transfer engine cannot reach D (network, D restarted)."),
    _m("pdwire_p_written_bytes_total", "counter", None,
       "Bytes of KV the successful batch writes moved.",
       "Divide by the requests to see the KV per request; flat with traffic: nothing is sent."),
    _m("pdwire_p_write_seconds", "histogram", None,
       "Time of each batch write, from the transfer engine call to its return.",
       "Rising: the network or the engine is the bottleneck (compare with a raw engine run)."),
    _m("pdwire_p_transfers", "gauge", "state",
       "Transfers P's workers know, by state (placeholder: named by a pull before P's "
       "scheduler; recorded; ready: KV held for D; and the remembered ends).",
       "placeholder growing: D pulls transfers P never got (lost P legs); ready growing: D "
       "does not pull what P holds."),
    # D's workers
    _m("pdwire_d_messages_sent_total", "counter", "kind",
       "Side-channel messages D's workers sent, by kind (pull, cancel, heartbeat).",
       "heartbeat rising with no pull: requests wait in D's queue; cancel rising: aborts."),
    _m("pdwire_d_loads_total", "counter", "outcome",
       "Requests whose KV load settled, by outcome (loaded, failed).",
       "failed rising: read pdwire_d_failures_total."),
    _m("pdwire_d_failures_total", "counter", "code",
       "Failed loads by error code.",
       "Each code has its fix in the failure table of the operations docs."),
    _m("pdwire_d_pull_seconds", "histogram", None,
       "Time from the first pull of a request to the reply that completed its load.",
       "Its tail near 480 s: D waits on P's ready timer (a lost P leg); run pdwire tap."),
    _m("pdwire_d_leases", "gauge", None,
       "Requests whose P-side KV lease D renews now.",
       "Growing: requests wait long in D's queue; their blocks stay held on P."),
    # the node
    _m("pdwire_node_blocks", "gauge", "state",
       "KV blocks of the node's pool, by state (in_use, free).",
       "free near 0: requests wait for blocks; on P with no traffic: leaked transfers."),
    _m("pdwire_node_held_transfers", "gauge", None,
       "P: finished requests whose blocks wait for D's pulls.",
       "Growing without traffic: D does not pull (read pdwire_node_oldest_held_seconds)."),
    _m("pdwire_node_oldest_held_seconds", "gauge", None,
       "P: age of the oldest request whose blocks wait for D's pulls.",
       "Near the abort timeout (480 s): D will never pull it; find the lost D leg."),
    _m("pdwire_node_requests_total", "counter", "kind",
       "Completions the node served, by kind (total, remote loads, verified, failed, "
       "recomputed).",
       "failed or recomputed rising on D: the loads fail; read pdwire_d_failures_total."),
    # the proxy and the bootstrap server
    _m("pdwire_proxy_requests_total", "counter", "outcome",
       "Completions through the proxy, by outcome (ok, prefill_error, decode_error, "
       "unavailable).",
       "prefill_error: P's leg failed (P down or overloaded); unavailable: not ready."),
    _m("pdwire_bootstrap_registrations_total", "counter", "result",
       "Worker registrations, by result (ok, rejected).",
       "rejected: read the server's log; a P whose workers cannot register does not start."),
    _m("pdwire_bootstrap_queries_total", "counter", None, "GET /query answered.",
       "Flat while D serves: D does not reach this server."),
    _m("pdwire_bootstrap_workers", "gauge", None, "Worker addresses registered.",
       "Below P's TP x PP: a worker did not register."),
)  # fmt: skip
BY_NAME: Final = {m.name: m for m in METRICS}


class Counts:
    """A worker's counters and histograms, as plain numbers: ``snapshot()`` is what it reports
    in its stats and ``add_up`` reads. Any thread may count or read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[str, float]] = {}
        self._histograms: dict[str, list[float]] = {}  # bucket counts, then sum, then count

    def inc(self, name: str, label: str = "", by: float = 1) -> None:
        assert name in BY_NAME, name
        with self._lock:
            series = self._values.setdefault(name, {})
            series[label] = series.get(label, 0) + by

    def observe(self, name: str, seconds: float) -> None:
        assert BY_NAME[name].kind == "histogram", name
        with self._lock:
            h = self._histograms.setdefault(name, [0.0] * (len(SECONDS_BUCKETS) + 3))
            h[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
            h[-2] += seconds
            h[-1] += 1

    def add(self, snapshot: Mapping[str, Any]) -> None:
        """Add another ``snapshot()`` to these counts."""
        with self._lock:
            for name, series in snapshot.get("values", {}).items():
                mine = self._values.setdefault(name, {})
                for label, value in series.items():
                    mine[label] = mine.get(label, 0) + value
            for name, h in snapshot.get("histograms", {}).items():
                sums = self._histograms.setdefault(name, [0.0] * len(h))
                for i, v in enumerate(h):
                    sums[i] += v

    def total(self, name: str) -> float:
        """A counter's value, over all its labels."""
        with self._lock:
            return sum(self._values.get(name, {}).values())

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "values": {k: dict(v) for k, v in self._values.items()},
                "histograms": {k: list(v) for k, v in self._histograms.items()},
            }


def add_up(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The sum of ``Counts`` snapshots (of each worker of a node)."""
    total = Counts()
    for snap in snapshots:
        total.add(snap)
    return total.snapshot()


def difference(now: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """What the counters and histograms of snapshot ``now`` gained since ``before`` (gauges
    are left out: an interval's gauge means nothing once intervals are added up)."""
    values: dict[str, dict[str, float]] = {}
    for name, series in now.get("values", {}).items():
        if BY_NAME[name].kind != "counter":
            continue
        old = before.get("values", {}).get(name, {})
        gained = {k: v - old.get(k, 0) for k, v in series.items() if v != old.get(k, 0)}
        if gained:
            values[name] = gained
    histograms = {}
    for name, h in now.get("histograms", {}).items():
        old_h = before.get("histograms", {}).get(name, [0.0] * len(h))
        if h[-1] != old_h[-1]:
            histograms[name] = [a - b for a, b in zip(h, old_h, strict=True)]
    return {"values": values, "histograms": histograms}


def summary(snapshot: Mapping[str, Any]) -> dict[str, float]:
    """One line's worth of a snapshot: each counter series (``name[label]``, ``pdwire_`` and
    ``_total`` left out) and each histogram's count and mean in ms."""
    out: dict[str, float] = {}
    for name, series in sorted(snapshot.get("values", {}).items()):
        short = name.removeprefix("pdwire_").removesuffix("_total")
        for label, value in sorted(series.items()):
            out[f"{short}[{label}]" if label else short] = value
    for name, h in sorted(snapshot.get("histograms", {}).items()):
        short = name.removeprefix("pdwire_").removesuffix("_seconds")
        out[f"{short}_count"] = h[-1]
        out[f"{short}_mean_ms"] = round(h[-2] / h[-1] * 1000, 3) if h[-1] else 0.0
    return out


def render(snapshot: Mapping[str, Any], gauges: Mapping[str, Mapping[str, float]]) -> bytes:
    """The Prometheus text of a snapshot plus ``gauges`` (name -> label -> value)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    families: list[Any] = []
    values = {**snapshot.get("values", {}), **gauges}
    for name, series in values.items():
        m = BY_NAME[name]
        labels = [m.label] if m.label else []
        if m.kind == "counter":
            family: Any = CounterMetricFamily(name.removesuffix("_total"), m.help, labels=labels)
        else:
            family = GaugeMetricFamily(name, m.help, labels=labels)
        for label, value in sorted(series.items()):
            family.add_metric([label] if m.label else [], value)
        families.append(family)
    for name, h in snapshot.get("histograms", {}).items():
        cumulative, running = [], 0.0
        for bound, count in zip([*SECONDS_BUCKETS, float("inf")], h[:-2], strict=True):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else str(bound), running))
        families.append(
            HistogramMetricFamily(name, BY_NAME[name].help, buckets=cumulative, sum_value=h[-2])
        )

    class _Scrape:
        def collect(self) -> Iterable[Any]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape())
    return generate_latest(registry)


def of_node(stats: Mapping[str, Any]) -> bytes:
    """The metrics of a node, from its ``/pdwire/stats`` (its workers' counts added up)."""
    snapshot = add_up(w.get("metrics", {}) for w in stats.get("workers", []))
    requests = {k: float(v) for k, v in stats.get("requests", {}).items() if k != "active"}
    snapshot["values"]["pdwire_node_requests_total"] = requests
    in_use = float(stats["blocks_in_use"])
    gauges = {
        "pdwire_node_blocks": {"in_use": in_use, "free": stats["blocks_total"] - in_use},
        "pdwire_node_held_transfers": {"": float(stats.get("transfers_held", 0))},
        "pdwire_node_oldest_held_seconds": {"": float(stats.get("oldest_held_s", 0.0))},
    }
    return render(snapshot, gauges)


#: The content type of ``render``'s bytes.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
