"""What a simulation run measured."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from .cluster import Cluster, SimParams

#: A request counts as late when it was not terminal this long after its deadline (latency).
SLACK_SECONDS = 1.0
#: A request that took at least this long waited for a 480 s timer of the legacy protocol.
STALL_SECONDS = 479.0


@dataclasses.dataclass(frozen=True)
class Report:
    requests: int
    completed: int
    failed: int
    not_terminal: int
    early_frees: int
    leaked_blocks: int
    leaked_blocks_prefill: int
    leaked_blocks_decode: int
    late_terminal: int
    stalled: int
    p50_terminal_seconds: float
    p99_terminal_seconds: float
    max_terminal_seconds: float
    control_messages_per_request: float
    writes_per_request: float
    bytes_per_request: float
    descriptors_per_request: float
    rejected_requests: int
    faults: dict[str, int]
    virtual_seconds: float
    params: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def simulate(params: SimParams, progress: Any = None) -> Report:
    """Run the cluster to quiescence (every timer fired) and measure."""
    cluster = Cluster(params)
    cluster.progress = progress
    cluster.run()
    reqs = cluster.requests
    durations = [r.terminal - r.arrival for r in reqs if r.terminal is not None]
    late = sum(
        1
        for r in reqs
        if r.terminal is None or r.terminal - r.arrival > params.deadline + SLACK_SECONDS
    )
    leaked_p, leaked_d = cluster.leaked_blocks()
    n = max(1, len(reqs))
    c = cluster.counters
    return Report(
        requests=len(reqs),
        completed=sum(1 for r in reqs if r.terminal is not None and not r.failed),
        failed=sum(1 for r in reqs if r.terminal is not None and r.failed),
        not_terminal=sum(1 for r in reqs if r.terminal is None),
        early_frees=c.early_frees,
        leaked_blocks=leaked_p + leaked_d,
        leaked_blocks_prefill=leaked_p,
        leaked_blocks_decode=leaked_d,
        late_terminal=late,
        stalled=sum(1 for d in durations if d >= STALL_SECONDS),
        p50_terminal_seconds=_quantile(durations, 0.50),
        p99_terminal_seconds=_quantile(durations, 0.99),
        max_terminal_seconds=max(durations, default=0.0),
        control_messages_per_request=c.control_messages / n,
        writes_per_request=c.writes / n,
        bytes_per_request=c.bytes_written / n,
        descriptors_per_request=c.descriptors / n,
        rejected_requests=c.rejected,
        faults=dict(Counter(r.fault for r in reqs if r.fault)),
        virtual_seconds=cluster.now,
        params={k: v for k, v in dataclasses.asdict(params).items() if k != "geometry"},
    )
