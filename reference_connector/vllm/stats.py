"""The connector's figures through vLLM's KV connector stats: what its agents counted in each
interval (``metrics.Counts``: counters and histograms), carried from the workers to vLLM's
loggers, logged as ``KV Transfer metrics: ...`` and exposed on vLLM's ``/metrics`` as the
counters of ``metrics.METRICS`` with vLLM's engine labels. A histogram is exposed there as the
counter of its total seconds (``pdwire_p_write_seconds_total``): divide its rate by the rate of
``pdwire_p_writes_total`` (or ``pdwire_d_loads_total{outcome="loaded"}``) for the mean."""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from ..metrics import BY_NAME, METRICS, Counts, add_up, summary


class PdwireStats(KVConnectorStats):
    """``data`` is a ``Counts`` snapshot of one interval (its gauges left out)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = Counts().snapshot()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = add_up([self.data, other.data])
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(summary(self.data))

    def is_empty(self) -> bool:
        return not self.data.get("values") and not self.data.get("histograms")


#: The agents' metrics vLLM's /metrics carries: each counter, and each histogram's seconds.
AGENT_METRICS = tuple(
    m for m in METRICS if m.name.startswith(("pdwire_p_", "pdwire_d_")) and m.kind != "gauge"
)


class PdwirePromMetrics(KVConnectorPromMetrics):
    """Registers ``AGENT_METRICS`` with vLLM's metric classes, one series per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for m in AGENT_METRICS:
            extra = [m.label] if m.label else []
            self._counters[m.name] = self._counter_cls(
                name=m.name.removesuffix("_total"),  # the class adds it
                documentation=m.help if m.kind == "counter" else f"Total seconds. {m.help}",
                labelnames=[*labelnames, *extra],
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for name, series in transfer_stats_data.get("values", {}).items():
            counter = self._counters.get(name)
            if counter is None:
                continue
            for label, value in series.items():
                labels = [*engine, label] if BY_NAME[name].label else engine
                counter.labels(*labels).inc(value)
        for name, h in transfer_stats_data.get("histograms", {}).items():
            if name in self._counters:
                self._counters[name].labels(*engine).inc(h[-2])
