"""The bootstrap server down when P starts, up later on the same port. P's workers retry their
registration (4.4: three attempts, 1 s then 2 s apart), so the server comes up once the first
attempt has failed. Meanwhile every request fails fast: P's HTTP server is not up yet, D's query
of the bootstrap fails, the proxy answers 503. Once P registered, requests through the proxy
load."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from conformance.ports import free_port
from reference_connector.bootstrap import BootstrapServer

from .conftest import Shared
from .deployment import (
    SLACK,
    START_TIMEOUT,
    Deployment,
    Requests,
    d_body,
    loaded,
    log_has,
    new_transfer_id,
    p_body,
    pools_drained,
    prompt,
    wait_for,
)

pytestmark = pytest.mark.faults
logger = logging.getLogger(__name__)

FAST = 1.0  # a refusal: no timer involved


def ready(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=2.0).status_code == 200


def test_bootstrap_down_at_start_then_up(
    shared: Shared, deployment: Deployment, requests: Requests
) -> None:
    (d,) = shared.get(("decode", {}))
    port, p_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    # the proxy, a process of its own, starts first: the server must come up within 3 s of P's
    # first attempt, and nothing slow may run in between
    proxy = deployment.proxy(f"http://127.0.0.1:{p_port}", url, d, "pdwire/2", ready=False)
    p = deployment.node("prefill", bootstrap=url, port=p_port, wait=False)
    tid = new_transfer_id()
    down = [
        requests.post("P leg, P unregistered", p.url, p_body(prompt(1), tid), FAST),
        requests.post("D leg, bootstrap down", d.url, d_body(prompt(1), tid, "any", url), FAST),
        requests.post("proxy, not ready", proxy.url, {"prompt": prompt(1)}, FAST),
    ]
    requests.terminal(*down)
    p_leg, d_leg, via_proxy = down
    assert p_leg.outcome() == "ConnectError"
    assert d_leg.response().status_code == 500 and "not found" in d_leg.response().text
    assert via_proxy.response().status_code == 503
    # the first attempt failed: the server must be up before the third, 3 s later. It runs in
    # this process, which has FastAPI loaded already, so that it is up well within that time.
    wait_for(lambda: log_has(p, "registration attempt 1/3"), START_TIMEOUT, "P tried to register")
    t0 = time.monotonic()
    server = BootstrapServer().start("127.0.0.1", port)
    try:
        logger.info("bootstrap up %.2fs after P's first attempt", time.monotonic() - t0)
        p.wait_healthy(START_TIMEOUT)  # raises if P gave up: the server took over 3 s to start
        wait_for(lambda: ready(proxy.url), START_TIMEOUT, "the proxy found P's engine")
        ok = [requests.post(f"proxy {i}", proxy.url, {"prompt": prompt(i)}, 5.0) for i in (2, 3)]
        requests.terminal(*ok)
        for call in ok:
            loaded(call)
        pools_drained(p, d, timeout=SLACK)
    finally:
        deployment.stop()  # P and the proxy first: they talk to the server
        server.stop()
