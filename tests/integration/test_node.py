"""The engine node end to end, with real parts: worker processes holding KV pools, the Mooncake
transfer engine over loopback TCP, ZMQ side channels, a uvicorn bootstrap server and the nodes'
own uvicorn servers, all on free loopback ports.

P and D are driven as a proxy drives them (no proxy here): the P leg with PrefillParams and the
D leg with DecodeParams of the same transfer_id. D checks every loaded byte against the prompt's
KV before it decodes, and its text must be that of its own local completion. The nodes are
started once for the module (in parallel); after each test every pool must be empty again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pdwire import error_strings
from reference_connector.kv_content import KVShape, render, tokenize
from reference_connector.kv_values import reference_completion
from reference_connector.node import NodeConfig, Policy
from reference_connector.node_api import NodeServer
from reference_connector.node_worker import WorkerError

SHAPE = KVShape(num_layers=4, num_kv_heads=8, head_dim=16, block_size=4, num_blocks=192, vocab=256)
MAX_TOKENS = 6
WAIT = 30.0  # seconds any HTTP request may take
#: name -> (role, TP, PP, load-failure policy, KV geometry beyond SHAPE's: rows of 2 tokens,
#: 10.6.6)
NODES: dict[str, tuple[str, int, int, Policy, dict[str, Any]]] = {
    "p1": ("prefill", 1, 1, "fail", {}),
    "p_tp2": ("prefill", 2, 1, "fail", {}),
    "p_pp2": ("prefill", 1, 2, "fail", {}),
    "p_tp2_k2": ("prefill", 2, 1, "fail", {"kernel_block_size": 2}),
    "d1": ("decode", 1, 1, "fail", {}),
    "d_tp2": ("decode", 2, 1, "recompute", {}),
    "d_k2": ("decode", 1, 1, "fail", {"kernel_block_size": 2}),
}
#: KV geometries of two KV-cache groups or packed rows, each run as a P and D of its own (so
#: that the module's nodes and theirs do not all start at once): name -> (P TP, D TP, geometry
#: beyond SHAPE's). A sliding window of 4 tokens over the odd layers keeps 2 of a prompt's
#: blocks (10.4.7); state-space odd layers (10.6.3); rows that pack every layer (3.2-R10),
#: registered whole and shared by both groups (10.6.7).
GEOMETRIES: dict[str, tuple[int, int, dict[str, Any]]] = {
    "sliding-window": (2, 1, {"sliding_window": 4}),
    "state-space": (1, 2, {"mamba": True}),
    "packed-rows": (2, 1, {"packed_rows": True}),
    "opaque-rows": (1, 1, {"sliding_window": 4, "opaque_rows": True}),
}


class Cluster:
    def __init__(self, nodes: dict[str, NodeServer]) -> None:
        self.nodes = nodes
        self.http = httpx.Client(timeout=WAIT)

    def complete(self, node: str, prompt: str, max_tokens: int = MAX_TOKENS, **body: Any) -> Any:
        url = f"{self.nodes[node].url}/v1/completions"
        return self.http.post(url, json={"prompt": prompt, "max_tokens": max_tokens, **body})

    def local_text(self, node: str, prompt: str) -> str:
        reply = self.complete(node, prompt)
        assert reply.status_code == 200, reply.text
        text: str = reply.json()["choices"][0]["text"]
        return text

    def decode_params(self, p: str, transfer_id: str) -> dict[str, Any]:
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": self.nodes[p].engine.bootstrap_url,
            "remote_engine_id": self.nodes[p].engine.engine_id,
            "transfer_id": transfer_id,
        }

    def stats(self, node: str) -> dict[str, Any]:
        reply = self.http.get(f"{self.nodes[node].url}/pdwire/stats")
        assert reply.status_code == 200
        stats: dict[str, Any] = reply.json()
        return stats

    def disaggregated(
        self, p: str, d: str, prompt: str, *, together: bool = True, **d_body: Any
    ) -> tuple[Any, Any]:
        """The P leg and the D leg of one request: sent at once (D first, so its pull may
        arrive before P is ready), or P to the end first."""
        tid = f"xfer-{uuid.uuid4()}"
        p_leg = functools.partial(
            self.complete,
            p,
            prompt,
            1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": tid,
            },
        )
        d_leg = functools.partial(
            self.complete, d, prompt, kv_transfer_params=self.decode_params(p, tid), **d_body
        )
        if not together:
            p_reply = p_leg()
            return p_reply, d_leg()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            d_future = pool.submit(d_leg)
            p_reply = pool.submit(p_leg).result()
            return p_reply, d_future.result()


def _shape(node: str) -> KVShape:
    return dataclasses.replace(SHAPE, **NODES[node][4])


def _start(name: str) -> NodeServer:
    role, tp, pp, policy, _ = NODES[name]
    return _start_node(role, tp, pp, policy, _shape(name))


def _start_node(role: str, tp: int, pp: int, policy: Policy, shape: KVShape) -> NodeServer:
    """A node; a P serves its own bootstrap server on a free port (one per P instance)."""
    config = NodeConfig(
        role="prefill" if role == "prefill" else "decode",
        shape=shape,
        tp_size=tp,
        pp_size=pp,
        bootstrap_port=0,
        load_failure_policy=policy,
        load_timeout=20.0,
    )
    return NodeServer(config).start()


def started(starts: dict[str, Callable[[], NodeServer]]) -> Iterator[Cluster]:
    """The nodes ``starts`` start, started at once, as a ``Cluster`` until it is closed;
    skips when the Mooncake transfer engine is unavailable."""
    nodes: dict[str, NodeServer] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
            futures = {name: pool.submit(start) for name, start in starts.items()}
            for name, future in futures.items():
                try:
                    nodes[name] = future.result()
                except WorkerError as exc:
                    if "TransportUnavailable" in str(exc):
                        pytest.skip(f"Mooncake transfer engine unavailable: {exc}")
                    raise
        c = Cluster(nodes)
        yield c
        c.http.close()
    finally:
        with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
            list(pool.map(NodeServer.stop, nodes.values()))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from started({name: functools.partial(_start, name) for name in NODES})


@pytest.fixture(autouse=True)
def pools_empty_after(cluster: Cluster) -> Iterator[None]:
    """After each test, every node's pool holds no block (P frees once its agents do)."""
    yield
    for name in NODES:
        expect_no_blocks_held(cluster, name)


@functools.cache
def probe(stop: bool) -> str:
    """A fixed prompt of 10 words (3 blocks, the last one partial) whose first generated token
    is the stop token (``stop``), or which decodes MAX_TOKENS tokens without it."""
    for i in range(5000):
        prompt = f"the quick brown fox number {i} jumps over the dog{i}"
        out = reference_completion(SHAPE, tokenize(prompt, SHAPE.vocab), MAX_TOKENS)
        if (stop and not out) or (not stop and len(out) == MAX_TOKENS):
            return prompt
    raise AssertionError("no such prompt in the first 5000")


def _prompt_bytes(prompt: str, shape: KVShape = SHAPE) -> int:
    """The KV bytes of the prompt's blocks each KV-cache group keeps, over every layer and
    head."""
    n = shape.blocks_for(len(tokenize(prompt, shape.vocab)))
    geometry = shape.geometry()
    firsts = geometry.firsts(n)
    kept = sum(n - firsts[geometry.group_of(layer)] for layer in range(shape.num_layers))
    return kept * 2 * shape.num_kv_heads * shape.block_size * shape.head_dim * 2


# -- the HTTP surface ------------------------------------------------------------------------


def test_health_models_and_stats(cluster: Cluster) -> None:
    for name, (role, tp, pp, *_) in NODES.items():
        url = cluster.nodes[name].url
        assert cluster.http.get(f"{url}/health").status_code == 200
        models = cluster.http.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == "pdwire-synthetic"
        stats = cluster.stats(name)
        assert stats["role"] == role and len(stats["workers"]) == tp * pp
        assert all(w["alive"] for w in stats["workers"])


def test_local_text_is_the_same_on_every_node(cluster: Cluster) -> None:
    """The text depends on the prompt's KV bytes only, not on how TP and PP split them, nor on
    kernel blocks."""
    prompt = probe(stop=False)
    expected = render(reference_completion(SHAPE, tokenize(prompt, SHAPE.vocab), MAX_TOKENS))
    assert len(expected.split()) == MAX_TOKENS
    for name in NODES:
        assert cluster.local_text(name, prompt) == expected, name


def test_chat_completion(cluster: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
    reply = cluster.http.post(f"{cluster.nodes['d1'].url}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "chat.completion"
    ids = tokenize("user: hi there", SHAPE.vocab)
    assert data["choices"][0]["message"]["content"] == render(reference_completion(SHAPE, ids, 3))


# -- P to D ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "d"),
    [("p1", "d1"), ("p_tp2", "d1"), ("p1", "d_tp2"), ("p_pp2", "d1"), ("p_tp2_k2", "d_k2")],
)
def test_disaggregated_text_equals_local(cluster: Cluster, p: str, d: str) -> None:
    expect_disaggregated(cluster, p, d, _shape(d))


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_a_geometry_of_groups_or_packed_rows_decodes_its_own_text(geometry: str) -> None:
    """A P and D of this geometry: the transfer verifies and D decodes the text of the bytes
    its KV-cache groups hold, another than a one-group model's; no block is left held."""
    p_tp, d_tp, extra = GEOMETRIES[geometry]
    shape = dataclasses.replace(SHAPE, **extra)
    starts: dict[str, Callable[[], NodeServer]] = {
        "p": functools.partial(_start_node, "prefill", p_tp, 1, "fail", shape),
        "d": functools.partial(_start_node, "decode", d_tp, 1, "fail", shape),
    }
    with contextlib.contextmanager(started)(starts) as pair:
        expect_disaggregated(pair, "p", "d", shape)
        for node in ("p", "d"):
            expect_no_blocks_held(pair, node)
    ids = tokenize(probe(stop=False), SHAPE.vocab)
    one_group = reference_completion(shape, ids, MAX_TOKENS) == reference_completion(
        SHAPE, ids, MAX_TOKENS
    )
    assert one_group == (shape.geometry().num_groups == 1)


def expect_no_blocks_held(cluster: Cluster, node: str) -> None:
    deadline = time.monotonic() + 5.0
    while (used := cluster.stats(node)["blocks_in_use"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert used == 0, f"{node} still holds {used} blocks"


def expect_disaggregated(cluster: Cluster, p: str, d: str, shape: KVShape) -> None:
    """A request through P and D (of ``shape``) verifies its KV and decodes D's local text,
    the text ``reference_completion`` gives."""
    prompt = probe(stop=False)
    n = len(tokenize(prompt, SHAPE.vocab))
    p_reply, d_reply = cluster.disaggregated(p, d, prompt)
    assert p_reply.status_code == 200, p_reply.text
    assert d_reply.status_code == 200, d_reply.text
    pr, dr = p_reply.json(), d_reply.json()
    assert pr["kv_transfer_params"] is None
    assert pr["usage"]["completion_tokens"] == 1
    assert dr["pdwire"]["verified"] is True and dr["pdwire"]["recomputed"] is False
    assert dr["pdwire"]["bytes_verified"] == _prompt_bytes(prompt, shape)
    assert set(dr["pdwire"]["timings_ms"]) >= {"queue", "load", "verify", "decode"}
    assert dr["kv_transfer_params"] == {"remote_prefill_cached_tokens": n}
    text = dr["choices"][0]["text"]
    assert text == cluster.local_text(d, prompt)
    assert text == render(reference_completion(shape, tokenize(prompt, SHAPE.vocab), MAX_TOKENS))
    assert pr["choices"][0]["text"] == text.split()[0]
    assert sum(w["bytes_written"] for w in cluster.stats(p)["workers"]) > 0


def test_sleep_and_wake_keep_serving_transfers(cluster: Cluster) -> None:
    """vLLM's sleep mode: a sleeping node refuses completions (503); woken, its workers have
    registered the same memory again, and a transfer between two woken nodes verifies."""
    for node in ("p_tp2", "d_tp2"):
        url = cluster.nodes[node].url
        assert cluster.http.post(f"{url}/sleep", params={"level": 1}).status_code == 200
        assert cluster.http.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        refused = cluster.complete(node, probe(stop=False))
        assert refused.status_code == 503 and "/wake_up" in refused.text
        assert cluster.http.post(f"{url}/wake_up").status_code == 200
        assert cluster.http.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    p_reply, d_reply = cluster.disaggregated("p_tp2", "d_tp2", probe(stop=False))
    assert p_reply.status_code == 200, p_reply.text
    assert d_reply.status_code == 200, d_reply.text
    assert d_reply.json()["pdwire"]["verified"] is True


def test_pull_after_prefill_and_streaming(cluster: Cluster) -> None:
    """P answers first (its KV waits for the pull), D streams its tokens as SSE."""
    prompt = probe(stop=False)
    p_reply, d_reply = cluster.disaggregated("p1", "d1", prompt, together=False, stream=True)
    assert p_reply.status_code == 200 and d_reply.status_code == 200, d_reply.text
    lines = [line[6:] for line in d_reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(chunks) == MAX_TOKENS + 1
    assert text == cluster.local_text("d1", prompt)
    assert chunks[-1]["pdwire"]["verified"] is True
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_params_without_transfer_fields_compute_locally(cluster: Cluster) -> None:
    """5.1-R2 and 5.2-R2: no transfer_id on P, no remote_engine_id on D: plain completions."""
    prompt = probe(stop=False)
    expected = cluster.local_text("d1", prompt)
    p_reply = cluster.complete("p1", prompt, kv_transfer_params={"do_remote_decode": True})
    params = {"do_remote_prefill": True, "transfer_id": "xfer-x", "remote_bootstrap_addr": "x"}
    d_reply = cluster.complete("d1", prompt, kv_transfer_params=params)
    assert p_reply.json()["choices"][0]["text"] == expected
    assert d_reply.json()["choices"][0]["text"] == expected
    assert d_reply.json()["kv_transfer_params"] is None


# -- failures --------------------------------------------------------------------------------


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = call()
    return result, time.perf_counter() - t0


def test_stop_token_fails_fast_under_policy_fail(cluster: Cluster) -> None:
    prompt = probe(stop=True)
    tid = f"xfer-{uuid.uuid4()}"
    body = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    p_reply = cluster.complete("p1", prompt, 1, kv_transfer_params=body)
    assert p_reply.status_code == 200
    choice = p_reply.json()["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "stop"
    params = cluster.decode_params("p1", tid)
    d_reply, took = _timed(lambda: cluster.complete("d1", prompt, kv_transfer_params=params))
    assert d_reply.status_code == 500, d_reply.text
    message = d_reply.json()["message"]
    assert message == f"KV load failed: WILL_NOT_SEND: {error_strings.WILL_NOT_SEND}"
    assert took < 2.0


def test_stop_token_recomputes_under_policy_recompute(cluster: Cluster) -> None:
    prompt = probe(stop=True)
    p_reply, d_reply = cluster.disaggregated("p1", "d_tp2", prompt)
    assert p_reply.status_code == 200 and d_reply.status_code == 200, d_reply.text
    dr = d_reply.json()
    assert dr["pdwire"]["recomputed"] is True and dr["pdwire"]["verified"] is False
    assert dr["kv_transfer_params"] == {"remote_prefill_cached_tokens": 0}
    assert dr["choices"][0]["text"] == cluster.local_text("d_tp2", prompt)


def test_stop_token_ids_and_return_token_ids(cluster: Cluster) -> None:
    """vLLM's request fields: return_token_ids gives the generated and the prompt's ids; a
    generated token in stop_token_ids ends the request with "stop", and on a P leg P will not
    send, so D fails at once."""
    prompt = probe(stop=False)
    ids = tokenize(prompt, SHAPE.vocab)
    plain = cluster.complete("p1", prompt, 1).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    body = cluster.complete("p1", prompt, 1, return_token_ids=True).json()
    first = body["choices"][0]["token_ids"]
    assert first == reference_completion(SHAPE, ids, 1) and body["prompt_token_ids"] == ids
    stopped = cluster.complete("d1", prompt, return_token_ids=True, stop_token_ids=first).json()
    choice = stopped["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == first[0] and choice["token_ids"] == first
    tid = f"xfer-{uuid.uuid4()}"
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    p_reply = cluster.complete("p1", prompt, 1, kv_transfer_params=kv, stop_token_ids=first)
    assert p_reply.status_code == 200, p_reply.text
    assert p_reply.json()["choices"][0]["finish_reason"] == "stop"
    assert p_reply.json()["pdwire"]["sent"] is False
    params = cluster.decode_params("p1", tid)
    d_reply, took = _timed(lambda: cluster.complete("d1", prompt, kv_transfer_params=params))
    assert d_reply.status_code == 500, d_reply.text
    message = d_reply.json()["message"]
    assert message == f"KV load failed: WILL_NOT_SEND: {error_strings.WILL_NOT_SEND}"
    assert took < 2.0
    assert cluster.complete("p1", prompt, 1, stop_token_ids=[True]).status_code == 400


def test_unknown_engine_fails_fast(cluster: Cluster) -> None:
    prompt = probe(stop=False)
    params = {**cluster.decode_params("p1", f"xfer-{uuid.uuid4()}"), "remote_engine_id": "nope"}
    d_reply, took = _timed(lambda: cluster.complete("d1", prompt, kv_transfer_params=params))
    assert d_reply.status_code == 500
    assert "remote engine_id nope not found" in d_reply.json()["message"]
    assert took < 2.0


def test_deadline_ms_aborts_a_load_that_p_never_serves(cluster: Cluster) -> None:
    """P never sees the request: D's session gives up at deadline_ms (5.2-R4), withdraws its pull
    and fails. P, told the same deadline in the pull, answers DEADLINE_EXCEEDED when it passes:
    D takes whichever comes first, its own timer or that answer, when both are due at once."""
    prompt = probe(stop=False)
    params = {**cluster.decode_params("p1", f"xfer-{uuid.uuid4()}"), "deadline_ms": 300}
    d_reply, took = _timed(lambda: cluster.complete("d1", prompt, kv_transfer_params=params))
    assert d_reply.status_code == 500, d_reply.text
    reasons = {"deadline", error_strings.DEADLINE_EXCEEDED}
    assert d_reply.json()["message"] in {f"KV load failed: DEADLINE_EXCEEDED: {r}" for r in reasons}
    assert 0.3 <= took < 2.0
