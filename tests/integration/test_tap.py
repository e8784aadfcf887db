"""``pdwire tap`` between real nodes, and between a real D-side DEALER and a raw P-side ROUTER
that shows what arrives byte for byte."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from conformance import ports, testees
from pdwire.codec import encode_pull, encode_response
from pdwire.messages import XferResponse, XferResponseStatus
from pdwire.vectors import seed_pull
from reference_connector.bootstrap import BootstrapServer
from reference_connector.proxy import Prefill, ProxyServer
from reference_connector.tap import TapServer

pytest.importorskip("mooncake.engine")

TIMEOUT = 30.0


class Records:
    """The tap's sink: every record, and a way to wait for one."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def __call__(self, record: dict[str, Any]) -> None:
        with self._cond:
            self.items.append(record)
            self._cond.notify_all()

    def wait(self, n: int, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.items) >= n, timeout), self.items
            return list(self.items)


@pytest.fixture(scope="module")
def prefill() -> Iterator[testees.Testee]:
    p = testees.start_node("prefill")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def nodes(prefill: testees.Testee) -> Iterator[tuple[testees.Testee, testees.Testee]]:
    """P, and a D of its own: a D keeps the worker addresses of an engine it queried once, so
    it would keep pulling through an earlier test's tap."""
    d = testees.start_node("decode")
    try:
        yield prefill, d
    finally:
        d.stop()


def _engine_id(bootstrap: str) -> str:
    entries = httpx.get(f"{bootstrap}/query", timeout=10).json()
    return str(next(iter(entries.values()))["engine_id"])


def _prompt() -> list[int]:
    return [1 + (i * 7919) % 500 for i in range(40)]


def _d_leg(d: testees.Testee, tap_url: str, engine: str, tid: str, timeout: float) -> Any:
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": tap_url,
        "remote_engine_id": engine,
        "transfer_id": tid,
    }
    body = {"model": "m", "prompt": _prompt(), "max_tokens": 2, "kv_transfer_params": params}
    return httpx.post(f"{d.url}/v1/completions", json=body, timeout=timeout)


def _p_leg(p: testees.Testee, tid: str) -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    body = {"model": "m", "prompt": _prompt(), "max_tokens": 1, "kv_transfer_params": params}
    httpx.post(f"{p.url}/v1/completions", json=body, timeout=TIMEOUT).raise_for_status()


def test_requests_through_a_proxy_are_seen_and_loaded(
    nodes: tuple[testees.Testee, testees.Testee],
) -> None:
    """The proxy gives D the tap as P's bootstrap server: every pull and reply of two
    completions is seen, named, and tied together; both transfers are loaded, with the bytes
    D verified."""
    p, d = nodes
    records = Records()
    with TapServer(p.bootstrap, records).start() as tap:
        proxy = ProxyServer([Prefill(p.url, tap.url)], [d.url], client_timeout=TIMEOUT)
        with proxy.start("127.0.0.1", 0, TIMEOUT):
            proxy.wait_ready(TIMEOUT)
            answers = [
                httpx.post(
                    f"{proxy.url}/v1/completions",
                    json={"model": "m", "prompt": _prompt(), "max_tokens": 2},
                    timeout=TIMEOUT,
                )
                for _ in range(2)
            ]
        summary = tap.summary()
    for a in answers:
        assert a.status_code == 200, a.text
    verified = [a.json()["pdwire"]["bytes_verified"] for a in answers]
    assert [row["verdict"] for row in summary] == ["loaded", "loaded"], summary
    assert [row["bytes"] for row in summary] == verified
    assert all(row["pulls"] == row["replies"] == 1 for row in summary)
    pulls = [r for r in records.items if r["kind"] == "pull"]
    replies = [r for r in records.items if r["kind"] == "response"]
    assert [r["dir"] for r in pulls] == ["D->P"] * 2 and [r["dir"] for r in replies] == ["P->D"] * 2
    for pull, reply in zip(pulls, replies, strict=True):
        assert reply["conn"] == pull["conn"] and reply["transfer_ids"] == pull["transfer_ids"]
        assert reply["status"] == "FINISH" and reply["answers"]["kind"] == "pull"
        assert reply["answers"]["ms"] >= 0 and pull["p_worker"] == "tp0/pp0"
        assert pull["d_worker"] == reply["d_worker"] and pull["message"]["req_blocks"]


def test_a_d_that_waits_for_a_transfer_p_never_had_is_pending(
    nodes: tuple[testees.Testee, testees.Testee],
) -> None:
    """The legacy stall: D pulls a transfer P never prefilled and P holds the pull. The tap
    shows the pull unanswered and the transfer pending; once P's leg arrives it is loaded."""
    p, d = nodes
    records = Records()
    tid = f"xfer-{uuid.uuid4()}"
    with TapServer(p.bootstrap, records).start() as tap:
        engine = _engine_id(p.bootstrap)
        result: list[Any] = []
        leg = threading.Thread(target=lambda: result.append(_d_leg(d, tap.url, engine, tid, 60)))
        leg.start()
        try:
            pull = records.wait(1)[0]
            assert pull["kind"] == "pull" and pull["transfer_ids"] == [tid]
            (row,) = tap.summary()
            assert row["verdict"] == "pending" and row["waiting_pulls"] == 1, row
            _p_leg(p, tid)
        finally:
            leg.join(TIMEOUT)
        (row,) = tap.summary()
    assert result and result[0].status_code == 200, result
    assert row["verdict"] == "loaded" and row["transfer_id"] == tid


def test_pdwire_tap_follows_one_transfer_and_prints_its_summary(
    nodes: tuple[testees.Testee, testees.Testee],
) -> None:
    """The command: JSON lines of the followed transfer only, then its summary line, and the
    table on stderr; the other transfer is summarised too."""
    p, d = nodes
    engine = _engine_id(p.bootstrap)
    port = ports.free_port()
    url = f"http://127.0.0.1:{port}"
    followed, other = f"xfer-{uuid.uuid4()}", f"xfer-{uuid.uuid4()}"
    command = [
        sys.executable, "-m", "pdwire", "tap", "--bootstrap", p.bootstrap, "--port", str(port),
        "--follow", followed, "--duration", "20",
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as tap:
        try:
            assert tap.stderr is not None
            banner = tap.stderr.readline().decode()
            assert f"bootstrap front at {url}" in banner, banner
            for tid in (followed, other):
                _p_leg(p, tid)
                assert _d_leg(d, url, engine, tid, TIMEOUT).status_code == 200
        finally:
            tap.send_signal(2)
            out, err = tap.communicate(timeout=TIMEOUT)
    assert tap.returncode == 0, err
    lines = [json.loads(line) for line in out.decode().splitlines()]
    shown = [r for r in lines if "summary" not in r]
    summaries = {r["summary"]["transfer_id"]: r["summary"] for r in lines if "summary" in r}
    assert {r["kind"] for r in shown} == {"pull", "response"}
    assert all(r["transfer_ids"] == [followed] for r in shown)
    assert summaries[followed]["verdict"] == summaries[other]["verdict"] == "loaded"
    assert followed in err.decode() and "verdict" in err.decode()


# -- bytes unchanged: a raw ROUTER as P ---------------------------------------------------


@pytest.mark.asyncio
async def test_every_frame_goes_through_unchanged_and_garbage_is_shown_raw() -> None:
    """Through the tap, D's messages reach a raw P ROUTER frame for frame, and P's replies
    reach D the same way: a pull, a message of two frames and bytes that are no message; the
    tap names the first and shows the others raw with why."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    records = Records()
    with BootstrapServer().start("127.0.0.1", 0) as boot:
        registration = {
            "engine_id": "e1", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
            "addr": f"tcp://127.0.0.1:{port}",
        }  # fmt: skip
        httpx.post(f"{boot.url}/register", json=registration, timeout=10).raise_for_status()
        with TapServer(boot.url, records).start() as tap:
            got = httpx.get(f"{tap.url}/query", timeout=10).json()
            relay = got["0"]["worker_addr"]["0"]["0"]
            assert relay != registration["addr"] and got["0"]["engine_id"] == "e1"
            pull = encode_pull(seed_pull(), "legacy")
            finish = encode_response(XferResponse(XferResponseStatus.FINISH, ["r0"]), "legacy")
            exchanges = [
                ([pull], [finish]),
                ([b"\x81\xa1a", b"second frame"], [b"", finish, b"\xff"]),
                ([b"\xc1 not msgpack"], [b"trans_done"]),
            ]
            for sent, answered in exchanges:
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(relay)
                await dealer.send_multipart(sent)
                identity, *arrived = await asyncio.wait_for(router.recv_multipart(), TIMEOUT)
                assert arrived == sent
                await router.send_multipart([identity, *answered])
                assert await asyncio.wait_for(dealer.recv_multipart(), TIMEOUT) == answered
                dealer.close(linger=0)
            seen = records.wait(6)
    router.close(linger=0)
    ctx.destroy(linger=0)
    kinds = [(r["dir"], r["kind"]) for r in seen]
    assert kinds == [
        ("D->P", "pull"), ("P->D", "response"),
        ("D->P", "raw"), ("P->D", "raw"),
        ("D->P", "raw"), ("P->D", "vllm-0.14-reply"),
    ], kinds  # fmt: skip
    assert seen[2]["frames"] == ["81a161", b"second frame".hex()]
    assert "2 frames" in seen[2]["error"] and "3 frames" in seen[3]["error"]
    assert seen[4]["frames"] == [b"\xc1 not msgpack".hex()] and seen[4]["error"]
    assert seen[1]["answers"]["kind"] == "pull" and seen[1]["status"] == "FINISH"
