"""One worker of a TP 2 D node killed (SIGKILL) while its pull waits at a slow P. The D node
sees a worker gone and stops itself (its health fails), ending its in-flight request; P's
transfer then finishes with one D worker gone and P frees the blocks by its abort timeout; P
keeps serving a fresh D."""

from __future__ import annotations

import os
import signal

import pytest

from .conftest import Shared
from .deployment import (
    ABORT,
    SLACK,
    SLOW_PREFILL,
    START_TIMEOUT,
    Deployment,
    Requests,
    loaded,
    pid_gone,
    pools_drained,
    pulls_received,
    transfer,
    wait_for,
    worker_pids,
)

pytestmark = pytest.mark.faults

STOP_BOUND = 10.0  # the node's health poll, then its HTTP server's graceful stop


def test_kill_d_worker_mid_pull(shared: Shared, deployment: Deployment, requests: Requests) -> None:
    doomed = deployment.node("decode", tp=2, wait=False)  # starts beside the shared nodes
    p, fresh = shared.get(("prefill", {"prefill_delay": SLOW_PREFILL}), ("decode", {}))
    doomed.wait_healthy(START_TIMEOUT)
    pids = worker_pids(doomed)
    before = pulls_received(p)
    p_leg, d_leg = transfer(requests, p, doomed, 1, d_bound=STOP_BOUND, deadline_ms=30_000)
    wait_for(lambda: pulls_received(p) >= before + 2, 5.0, "both D workers' pulls reached P")
    os.kill(pids[0], signal.SIGKILL)
    requests.terminal(d_leg, p_leg)
    assert d_leg.outcome() != "HTTP 200", d_leg.response().text
    assert p_leg.response().status_code == 200
    wait_for(lambda: not doomed.alive(), STOP_BOUND, "the D node stopped itself")
    wait_for(lambda: all(pid_gone(pid) for pid in pids), STOP_BOUND, "D's workers exited")
    pools_drained(p, timeout=ABORT + SLACK)
    _, d_leg2 = transfer(requests, p, fresh, 2, d_bound=2.0, together=False)
    requests.terminal(d_leg2)
    loaded(d_leg2)
    pools_drained(p, fresh, timeout=SLACK)
