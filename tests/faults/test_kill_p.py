"""P killed (SIGKILL, the whole node with its bootstrap server) while D's pull waits for its
prefill. D's request fails by its timer: pdwire/2, the deadline, then the receive timeout of the
cancel that no one answers releases the blocks; legacy, the pull's receive timeout. D's pool
drains; a replacement P, started after the kill, serves D."""

from __future__ import annotations

import concurrent.futures

import pytest

from pdwire.versions import LEGACY, PDWIRE_2

from .conftest import Shared
from .deployment import (
    RECEIVE,
    SLACK,
    Deployment,
    Requests,
    kill,
    load_failed,
    loaded,
    node,
    pools_drained,
    pulls_received,
    transfer,
    wait_for,
)

pytestmark = pytest.mark.faults

DEADLINE_MS = 1500


@pytest.mark.parametrize("profile", [PDWIRE_2, LEGACY])
def test_kill_p_mid_transfer(
    shared: Shared, deployment: Deployment, requests: Requests, profile: str
) -> None:
    (d,) = shared.get(("decode", {"profile": profile}))
    # P's ready wait far outlasts the test: alive, it would answer the pull on its own
    doomed = deployment.node("prefill", profile=profile, prefill_delay=10.0, abort_timeout=60.0)
    v2 = profile == PDWIRE_2
    bound = DEADLINE_MS / 1000 + RECEIVE if v2 else RECEIVE
    p_leg, d_leg = transfer(
        requests, doomed, d, 1, d_bound=bound, deadline_ms=DEADLINE_MS if v2 else None
    )
    wait_for(lambda: pulls_received(doomed) >= 1, 5.0, "D's pull reached P")
    kill(doomed)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        replacement = pool.submit(node, "prefill", profile=profile)
        requests.terminal(d_leg, p_leg)
        message = load_failed(d_leg)
        assert ("DEADLINE_EXCEEDED" if v2 else "transfer failed") in message, message
        assert p_leg.future.exception(0) is not None  # P died under it
        pools_drained(d, timeout=SLACK)
        p = replacement.result(60.0)
    deployment.parts.append(p)
    _, d_leg2 = transfer(requests, p, d, 2, d_bound=5.0)
    requests.terminal()
    loaded(d_leg2)
    pools_drained(p, d, timeout=SLACK)
