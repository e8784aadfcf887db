"""A stop token as the first (and only) prefill token, under load: 16 requests through the
proxy, 8 at a time, each with ``stop_token_ids`` holding its own first token. P will not send
(10.11.1): it frees the blocks at once and answers D's pulls at once, so D fails the load
(policy fail) or recomputes and stops (policy recompute), well before any timer."""

from __future__ import annotations

import httpx
import pytest

from .conftest import Shared
from .deployment import SLACK, Deployment, Requests, pools_drained, prompt

pytestmark = pytest.mark.faults

REQUESTS, CONCURRENCY = 16, 8
FAST = 2.0  # no timer: will-not-send is answered at once


def first_token(url: str, text: str) -> int:
    body = {"prompt": text, "max_tokens": 1, "return_token_ids": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=10.0)
    reply.raise_for_status()
    token: int = reply.json()["choices"][0]["token_ids"][0]
    return token


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_stop_token_first_under_load(shared: Shared, deployment: Deployment, policy: str) -> None:
    options = {} if policy == "fail" else {"extra": ("--load-failure-policy", policy)}
    p, d = shared.get(("prefill", {}), ("decode", options))
    proxy = deployment.proxy(p.url, p.bootstrap, d, "pdwire/2")
    prompts = [prompt(100 + i) for i in range(REQUESTS)]
    bodies = [
        {"prompt": text, "max_tokens": 4, "stop_token_ids": [first_token(d.url, text)]}
        for text in prompts
    ]
    requests = Requests(CONCURRENCY)
    try:
        calls = [
            requests.post(f"stop-first {i}", proxy.url, body, FAST) for i, body in enumerate(bodies)
        ]
        requests.terminal(*calls)
        for call in calls:
            reply = call.response()
            if policy == "fail":
                assert reply.status_code == 500, reply.text
                assert "WILL_NOT_SEND" in reply.json()["message"], reply.text
            else:
                assert reply.status_code == 200, reply.text
                choice = reply.json()["choices"][0]
                assert choice["finish_reason"] == "stop" and choice["text"] == "", choice
                assert reply.json()["pdwire"]["recomputed"] is True
    finally:
        requests.close()
    pools_drained(p, d, timeout=SLACK)
