"""``GET /metrics`` of a running deployment (P node with its bootstrap server, D node, proxy)
scraped after a known set of requests: each counter says what was sent."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conformance import testees
from reference_connector.proxy import Prefill, ProxyServer

pytest.importorskip("mooncake.engine")
TIMEOUT = 30.0
REQUESTS = 3

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    reply = httpx.get(f"{url}/metrics", timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[testees.Testee, testees.Testee, ProxyServer, list[int]]]:
    """The deployment, after REQUESTS completions and one malformed request through the
    proxy; with the bytes D verified for each completion."""
    p = testees.start_node("prefill")
    d = testees.start_node("decode")
    proxy = ProxyServer([Prefill(p.url, p.bootstrap)], [d.url], client_timeout=TIMEOUT)
    try:
        proxy.start("127.0.0.1", 0, TIMEOUT)
        proxy.wait_ready(TIMEOUT)
        verified = []
        for i in range(REQUESTS):
            body = {"model": "m", "prompt": list(range(1, 41 + i)), "max_tokens": 2}
            answer = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=TIMEOUT)
            assert answer.status_code == 200, answer.text
            verified.append(answer.json()["pdwire"]["bytes_verified"])
        bad = httpx.post(f"{proxy.url}/v1/completions", content=b"not json", timeout=TIMEOUT)
        assert bad.status_code == 400
        assert p.settled(TIMEOUT) and d.settled(TIMEOUT)
        yield p, d, proxy, verified
    finally:
        proxy.stop()
        d.stop()
        p.stop()


def test_p_counts_each_pull_reply_and_write(
    deployment: tuple[testees.Testee, testees.Testee, ProxyServer, list[int]],
) -> None:
    p, _, _, verified = deployment
    m = scrape(p.url)
    assert value(m, "pdwire_p_messages_received_total") == REQUESTS
    assert value(m, "pdwire_p_replies_sent_total", status="FINISH") == REQUESTS
    assert value(m, "pdwire_p_replies_sent_total", status="ERROR") == 0
    assert value(m, "pdwire_p_writes_total", result="ok") == REQUESTS
    assert value(m, "pdwire_p_written_bytes_total") == sum(verified) > 0
    assert value(m, "pdwire_p_write_seconds_count") == REQUESTS
    assert value(m, "pdwire_p_write_seconds_bucket", le="+Inf") == REQUESTS
    assert 0 < value(m, "pdwire_p_write_seconds_sum") < TIMEOUT
    assert value(m, "pdwire_node_requests_total", kind="total") == REQUESTS
    assert value(m, "pdwire_node_blocks", state="in_use") == 0
    assert value(m, "pdwire_node_held_transfers") == 0
    assert value(m, "pdwire_p_transfers", state="ready") == 0


def test_d_counts_each_pull_and_load(
    deployment: tuple[testees.Testee, testees.Testee, ProxyServer, list[int]],
) -> None:
    _, d, _, _ = deployment
    m = scrape(d.url)
    assert value(m, "pdwire_d_messages_sent_total", kind="pull") == REQUESTS
    assert value(m, "pdwire_d_loads_total", outcome="loaded") == REQUESTS
    assert value(m, "pdwire_d_loads_total", outcome="failed") == 0
    assert value(m, "pdwire_d_pull_seconds_count") == REQUESTS
    assert value(m, "pdwire_node_requests_total", kind="verified") == REQUESTS
    assert value(m, "pdwire_node_blocks", state="free") > 0


def test_the_proxy_and_the_bootstrap_server_count_what_they_served(
    deployment: tuple[testees.Testee, testees.Testee, ProxyServer, list[int]],
) -> None:
    p, _, proxy, _ = deployment
    m = scrape(proxy.url)
    assert value(m, "pdwire_proxy_requests_total", outcome="ok") == REQUESTS
    assert value(m, "pdwire_proxy_requests_total", outcome="bad_request") == 1
    b = scrape(p.bootstrap)
    assert value(b, "pdwire_bootstrap_registrations_total", result="ok") == 1  # P's one worker
    assert value(b, "pdwire_bootstrap_workers") == 1
    assert value(b, "pdwire_bootstrap_queries_total") >= 2  # the proxy's and D's
