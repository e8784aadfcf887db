"""Nodes with a shared key (§8.6): a keyed P registers signed at its own keyed bootstrap server
and serves only signed pulls; a D with the same key loads from it, a D without the key or with
another one fails at once with AUTH_FAILED, and P frees the blocks it kept for that D."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdwire import error_strings
from pdwire.auth import key_id
from reference_connector.node import NodeConfig
from reference_connector.node_api import NodeServer

from .test_node import SHAPE, Cluster, probe, started

KEY = b"a key shared out of band"
NEW_KEY = b"the key that replaces it"
ABORT_S = 2.0
NODES: dict[str, tuple[str, bytes | None, tuple[bytes, ...]]] = {
    "p": ("prefill", KEY, ()),
    "d": ("decode", KEY, ()),
    "d_nokey": ("decode", None, ()),
    "d_otherkey": ("decode", b"another key", ()),
    # A rotation half done (8.6-R16): P signs with the new key and still accepts the old one.
    "p_new": ("prefill", NEW_KEY, (KEY,)),
    "d_both": ("decode", KEY, (NEW_KEY,)),
}


def _start(role: str, key: bytes | None, accepted: tuple[bytes, ...]) -> NodeServer:
    config = NodeConfig(
        role="prefill" if role == "prefill" else "decode",
        shape=SHAPE,
        bootstrap_port=0,
        load_timeout=20.0,
        abort_timeout=ABORT_S,
        auth_key=key,
        accepted_keys=accepted,
    )
    return NodeServer(config).start()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from started({name: functools.partial(_start, *spec) for name, spec in NODES.items()})


def _p_drains(cluster: Cluster, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (used := cluster.stats("p")["blocks_in_use"]) and time.monotonic() < deadline:
        time.sleep(0.05)  # another process's counter: nothing to await
    return int(used)


def test_same_key_loads_and_verifies(cluster: Cluster) -> None:
    prompt = probe(stop=False)
    p_reply, d_reply = cluster.disaggregated("p", "d", prompt)
    assert p_reply.status_code == 200 and d_reply.status_code == 200, d_reply.text
    body = d_reply.json()
    assert body["pdwire"]["verified"] is True
    assert body["choices"][0]["text"] == cluster.local_text("d", prompt)
    assert _p_drains(cluster, 5.0) == 0


@pytest.mark.parametrize(
    ("d", "why"),
    [
        ("d_nokey", f"AUTH_FAILED: {error_strings.AUTH_FAILED}"),
        # P's signed ERROR names a key D does not hold (8.6-R8, 8.6-R16)
        (
            "d_otherkey",
            f"BAD_MESSAGE: transfer failed: auth_key_id '{key_id(KEY)}' names no key held "
            "(spec §8.6)",
        ),
    ],
)
def test_unsigned_or_wrongly_signed_pull_fails_at_once(cluster: Cluster, d: str, why: str) -> None:
    """P answers ERROR AUTH_FAILED without acting on the pull (8.6-R7); D fails the load at once
    (no wait for the deadline); P's blocks come back at its abort timeout."""
    prompt = probe(stop=False)
    tid = f"xfer-{uuid.uuid4()}"
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    assert cluster.complete("p", prompt, 1, kv_transfer_params=kv).status_code == 200
    t0 = time.perf_counter()
    d_reply = cluster.complete(d, prompt, kv_transfer_params=cluster.decode_params("p", tid))
    took = time.perf_counter() - t0
    assert d_reply.status_code == 500, d_reply.text
    message = d_reply.json()["message"]
    assert message == f"KV load failed: {why}", message
    assert took < ABORT_S
    assert _p_drains(cluster, ABORT_S + 5.0) == 0


def test_keys_rotate(cluster: Cluster) -> None:
    """8.6-R15/R16: a P that signs with a new key and accepts the old one serves a D that signs
    with the old key and accepts the new one; a D that holds only the old key rejects P's reply,
    which names a key it does not hold."""
    prompt = probe(stop=False)
    _, d_reply = cluster.disaggregated("p_new", "d_both", prompt)
    assert d_reply.status_code == 200 and d_reply.json()["pdwire"]["verified"] is True
    _, d_reply = cluster.disaggregated("p_new", "d", prompt)
    assert d_reply.status_code == 500
    assert "names no key held" in d_reply.json()["message"], d_reply.text


def test_keyed_bootstrap_refuses_an_unsigned_registration(cluster: Cluster) -> None:
    url = cluster.nodes["p"].engine.bootstrap_url
    body = {
        "engine_id": "intruder",
        "dp_rank": 0,
        "tp_rank": 0,
        "pp_rank": 0,
        "addr": "tcp://127.0.0.1:5555",
    }
    reply = httpx.post(f"{url}/register", json=body, timeout=10.0)
    assert reply.status_code == 401, reply.text
    assert "AUTH_FAILED" in reply.text


def _node_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pdwire", "node", "--role", "prefill", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_cli_refuses_a_key_with_the_legacy_profile(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(KEY + b"\n")
    out = _node_cli("--profile", "legacy", "--auth-key-file", str(key))
    assert out.returncode == 2
    assert "legacy profile cannot carry auth_tag" in out.stderr
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    out = _node_cli("--auth-key-file", str(empty))
    assert out.returncode == 2 and "auth key file is empty" in out.stderr
    out = _node_cli("--accept-key-file", str(key))
    assert out.returncode == 2 and "--accept-key-file needs --auth-key-file" in out.stderr
