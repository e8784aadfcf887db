"""A P slower than the timers (``--prefill-delay``): the pull waits at P past D's deadline
(pdwire/2) or past P's own ready wait (legacy). D's request fails by that timer; P's blocks,
recorded late, are freed by the cancel or after the abort timeout; no block is left."""

from __future__ import annotations

import pytest

from pdwire.versions import LEGACY

from .conftest import Shared
from .deployment import (
    ABORT,
    SLACK,
    SLOW_PREFILL,
    Requests,
    load_failed,
    pools_drained,
    transfer,
)

pytestmark = pytest.mark.faults

DEADLINE_MS = 1000


def test_slow_p_v2_d_fails_by_its_deadline(shared: Shared, requests: Requests) -> None:
    p, d = shared.get(("prefill", {"prefill_delay": SLOW_PREFILL}), ("decode", {}))
    p_leg, d_leg = transfer(requests, p, d, 1, d_bound=DEADLINE_MS / 1000, deadline_ms=DEADLINE_MS)
    requests.terminal(d_leg)
    assert "DEADLINE_EXCEEDED" in load_failed(d_leg)
    assert d_leg.took >= DEADLINE_MS / 1000
    requests.terminal(p_leg)
    assert p_leg.response().status_code == 200
    pools_drained(p, d, timeout=ABORT + SLACK)


def test_slow_p_legacy_d_fails_by_p_ready_wait(shared: Shared, requests: Requests) -> None:
    p, d = shared.get(
        ("prefill", {"prefill_delay": SLOW_PREFILL, "profile": LEGACY}),
        ("decode", {"profile": LEGACY}),
    )
    p_leg, d_leg = transfer(requests, p, d, 2, d_bound=ABORT)
    requests.terminal(d_leg)
    assert "Timeout waiting for P side ready." in load_failed(d_leg)
    assert d_leg.took >= ABORT
    requests.terminal(p_leg)
    assert p_leg.response().status_code == 200
    # recorded after the ready wait: the retention timer frees them ABORT later
    pools_drained(p, d, timeout=ABORT + SLACK)
