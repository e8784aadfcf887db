"""The disaggregation tax of a ``pdwire run``: what moving a request's KV from P to D cost it.

Per request, in ms:

- ``write``: P's batch writes that carried the request, from the first transfer engine call's
  start to the last one's return, over every P worker (``recent_writes`` of P's
  ``/pdwire/stats``; their clock is the host's monotonic clock).
- ``pull``: D's pulls, from the first pull that carried the request leaving a D worker to the
  reply that completed the last worker's load (``timings_ms.pull`` of D's response).
- ``overhead``: ``TTFT - P.prefill - D.first_step - D.verify``, everything that is neither
  computing the prompt, computing the first token, nor checking the KV: the HTTP hops, both
  queues, the pull and the write.

Targets, printed beside the figures: the write runs at no less than
``WRITE_TARGET`` of the raw engine's GB/s, and the overhead stays within ``OVERHEAD_FACTOR``
times the raw engine's time for the request's bytes plus ``OVERHEAD_SLACK_MS``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

WRITE_TARGET: Final = 0.9
OVERHEAD_FACTOR: Final = 1.2
OVERHEAD_SLACK_MS: Final = 5.0
TAX_KEYS: Final = ("write", "pull", "overhead")


def _writes(p_stats: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for worker in p_stats.get("workers", []):
        yield from worker.get("recent_writes", [])


def write_ms(p_stats: Mapping[str, Any], d_req_ids: Iterable[str]) -> dict[str, float]:
    """Per D request id: the time P's batch writes for it took (module docstring)."""
    wanted = set(d_req_ids)
    spans: dict[str, tuple[float, float]] = {}
    for write in _writes(p_stats):
        start = float(write["started"])
        end = start + float(write["ms"]) / 1000
        for d_req in wanted.intersection(write["d_req_ids"]):
            first, last = spans.get(d_req, (start, end))
            spans[d_req] = (min(first, start), max(last, end))
    return {d_req: (end - start) * 1000 for d_req, (start, end) in spans.items()}


def write_gbps(p_stats: Mapping[str, Any], d_req_ids: Iterable[str]) -> float | None:
    """Bytes over seconds of P's successful batch writes that carried any of ``d_req_ids``:
    the engine's speed per write, as ``raw_write`` is timed."""
    wanted = set(d_req_ids)
    nbytes, ms = 0, 0.0
    for write in _writes(p_stats):
        if write["status"] == 0 and wanted.intersection(write["d_req_ids"]):
            nbytes += int(write["bytes"])
            ms += float(write["ms"])
    return nbytes / ms / 1e6 if ms > 0 else None


def overhead_ms(
    ttft: float | None, p_timings: Mapping[str, Any] | None, d_timings: Mapping[str, Any]
) -> float | None:
    """``TTFT - P.prefill - D.first_step - D.verify``; None when a figure is missing."""
    prefill = None if p_timings is None else p_timings.get("prefill")
    first_step, verify = d_timings.get("first_step"), d_timings.get("verify")
    if ttft is None or prefill is None or first_step is None or verify is None:
        return None
    return ttft - float(prefill) - float(first_step) - float(verify)


def overhead_target_ms(kv_bytes: int, raw_gbps: float | None) -> float | None:
    """``OVERHEAD_FACTOR`` x the raw engine's time for ``kv_bytes`` + ``OVERHEAD_SLACK_MS``."""
    if raw_gbps is None or raw_gbps <= 0:
        return None
    return OVERHEAD_FACTOR * kv_bytes / raw_gbps / 1e6 + OVERHEAD_SLACK_MS


@dataclasses.dataclass(frozen=True)
class Tax:
    """The run's tax: per request ``{write, pull, overhead}`` (a value None when unmeasured),
    P's write speed, and the targets."""

    per_request: Sequence[dict[str, float | None]]
    write_gbps: float | None
    raw_gbps: float | None
    kv_bytes: int

    @property
    def write_ratio(self) -> float | None:
        if self.write_gbps is None or not self.raw_gbps:
            return None
        return self.write_gbps / self.raw_gbps

    @property
    def overhead_target_ms(self) -> float | None:
        return overhead_target_ms(self.kv_bytes, self.raw_gbps)

    def p50(self) -> dict[str, float | None]:
        result: dict[str, float | None] = {}
        for key in TAX_KEYS:
            values = [v for r in self.per_request if (v := r.get(key)) is not None]
            result[key] = statistics.median(values) if values else None
        return result

    def as_dict(self) -> dict[str, Any]:
        p50 = self.p50()
        target = self.overhead_target_ms
        ratio = self.write_ratio
        return {
            "p50_ms": {k: None if v is None else round(v, 3) for k, v in p50.items()},
            "write_gbps": None if self.write_gbps is None else round(self.write_gbps, 4),
            "write_to_raw_ratio": None if ratio is None else round(ratio, 4),
            "write_target_ratio": WRITE_TARGET,
            "overhead_target_ms": None if target is None else round(target, 3),
            "write_met": None if ratio is None else ratio >= WRITE_TARGET,
            "overhead_met": _within(p50["overhead"], target),
        }


def _within(value: float | None, bound: float | None) -> bool | None:
    return None if value is None or bound is None else value <= bound
