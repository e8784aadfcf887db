"""P killed and restarted under the same engine id, with its bootstrap server on the same port
and new side-channel ports. D's request in flight at the kill fails by its deadline; D (pdwire/2)
then forgets the engine's cached addresses (4.2-R12), so a fresh request queries the bootstrap
server again and loads from the restarted P."""

from __future__ import annotations

import pytest

from conformance.ports import free_port

from .conftest import Shared
from .deployment import (
    RECEIVE,
    SLACK,
    Deployment,
    Requests,
    d_body,
    kill,
    load_failed,
    loaded,
    new_transfer_id,
    pools_drained,
    prompt,
    pulls_received,
    stats,
    transfer,
    wait_for,
)

pytestmark = pytest.mark.faults

ENGINE = "fault-restarted-p"
DEADLINE_MS = 1500


def test_p_restarted_under_same_engine_id(
    shared: Shared, deployment: Deployment, requests: Requests
) -> None:
    (d,) = shared.get(("decode", {}))
    port = free_port()
    same = {"extra": ("--engine-id", ENGINE), "bootstrap_port": port}
    old = deployment.node("prefill", **same)
    _, warm = transfer(requests, old, d, 1, d_bound=5.0)  # D caches the engine's addresses
    requests.terminal(warm)
    loaded(warm)
    old_addr = stats(old)["workers"][0]["address"]

    # in flight at the kill: D's pull waits at P for a prefill that never comes
    tid = new_transfer_id()
    body = d_body(prompt(2), tid, ENGINE, old.bootstrap, DEADLINE_MS)
    in_flight = requests.post("D leg, P killed", d.url, body, DEADLINE_MS / 1000 + RECEIVE)
    wait_for(lambda: pulls_received(old) >= 2, 5.0, "D's pull reached the old P")
    kill(old)
    new = deployment.node("prefill", **same)
    assert stats(new)["workers"][0]["address"] != old_addr
    requests.terminal(in_flight)
    assert "DEADLINE_EXCEEDED" in load_failed(in_flight)

    _, fresh = transfer(requests, new, d, 3, d_bound=5.0)
    requests.terminal(fresh)
    loaded(fresh)
    pools_drained(new, d, timeout=SLACK)
