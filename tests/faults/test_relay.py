"""Side-channel messages dropped or duplicated by the tests' ZMQ relay between D's workers and
P's ROUTER. A bootstrap server of the test's offers P's engine at the relay's address, and D's
legs name that server. A lost pull or reply fails D's request by its deadline and P frees its
blocks (served, cancelled or expired); a duplicated pull or reply leaves D's load intact.

Each case registers P under an engine id of its own: D caches an engine's addresses by its id
(as vLLM does), and a cached entry would point at an earlier case's relay."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

from .conftest import Shared
from .deployment import (
    ABORT,
    RECEIVE,
    SLACK,
    Deployment,
    Requests,
    Tracked,
    load_failed,
    loaded,
    pools_drained,
    transfer,
)
from .zmq_relay import Policy, Relay

if TYPE_CHECKING:
    from conformance.testees import Testee

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

DEADLINE_MS = 1500


def register_through(bootstrap: str, p: Testee, relay: Relay, engine: str) -> None:
    """Register P's workers at ``bootstrap`` as P's own server has them, but at the relay and
    under the engine id ``engine`` (P's workers do not check it)."""
    (entry,) = httpx.get(f"{p.bootstrap}/query", timeout=5.0).json().values()
    shared = {k: v for k, v in entry.items() if k not in ("engine_id", "worker_addr")}
    for tp, addr in entry["worker_addr"]["0"].items():
        assert addr == relay.upstream, "one P worker: one relay"
        payload = {"engine_id": engine, "dp_rank": 0, "tp_rank": int(tp)}
        payload |= {"pp_rank": 0, "addr": relay.address, **shared}
        httpx.post(f"{bootstrap}/register", json=payload, timeout=5.0).raise_for_status()


def failed_by_deadline(d_leg: Tracked) -> None:
    assert "DEADLINE_EXCEEDED" in load_failed(d_leg)


CASES: dict[str, tuple[Policy, Policy, Callable[[Tracked], object]]] = {
    "pull dropped": (Policy.dropping(1), Policy(), failed_by_deadline),
    "reply dropped": (Policy(), Policy.dropping(1), failed_by_deadline),
    "pull duplicated": (Policy.duplicating(1), Policy(), loaded),
    "reply duplicated": (Policy(), Policy.duplicating(1), loaded),
}


@pytest.mark.parametrize("case", CASES)
def test_relayed_message_lost_or_repeated(
    shared: Shared, deployment: Deployment, requests: Requests, case: str
) -> None:
    to_p, to_d, check = CASES[case]
    p, d = shared.get(("prefill", {}), ("decode", {}))
    bootstrap = deployment.bootstrap()
    p_side = httpx.get(f"{p.url}/pdwire/stats", timeout=5.0).json()["workers"][0]["address"]
    with Relay(p_side, to_p=to_p, to_d=to_d) as relay:
        engine = f"relayed-{uuid.uuid4().hex}"
        register_through(bootstrap.url, p, relay, engine)
        _, d_leg = transfer(
            requests,
            p,
            d,
            1,
            d_bound=DEADLINE_MS / 1000 + RECEIVE,
            deadline_ms=DEADLINE_MS,
            bootstrap=bootstrap.url,
            engine=engine,
            together=False,
        )
        requests.terminal()
        check(d_leg)
        pools_drained(p, d, timeout=ABORT + SLACK)
        counts = relay.snapshot()
    assert sum(c.dropped + c.duplicated for c in counts.values()) == 1, counts
    logger.info("%s: relay saw %s", case, counts)
