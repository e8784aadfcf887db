"""Producer cases: P's bootstrap server (§4.1 to §4.3). Every registration uses a fresh engine
id and a random DP rank, so that it never disturbs P's own entry or another run's."""

from __future__ import annotations

import json
import random
import re
import uuid
from typing import Any, Final

from pdwire import error_strings
from pdwire.http_models import MAX_REGISTER_BODY_BYTES

from ..case import Unsupported, case, expect, expect_equal
from ..peers.http import HttpResult, request
from .producer_env import ProducerCtx

ADDR: Final = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}")
DECIMAL: Final = re.compile(r"0|[1-9][0-9]*")


def fresh() -> tuple[str, int]:
    """An engine id and a DP rank no one else registers."""
    return f"conformance-{uuid.uuid4().hex}", random.randrange(1000, 1_000_000)


def worker(engine_id: str, dp: int, tp: int = 0, pp: int = 0, **extra: Any) -> dict[str, Any]:
    port = 20000 + 10 * tp + pp
    return {
        "engine_id": engine_id,
        "dp_rank": dp,
        "tp_rank": tp,
        "pp_rank": pp,
        "addr": f"tcp://127.0.0.1:{port}",
        **extra,
    }


async def register(t: ProducerCtx, body: Any) -> HttpResult:
    return await request(t.env.http, "POST", f"{t.options.bootstrap}/register", t.log, body=body)


async def query(t: ProducerCtx) -> dict[str, Any]:
    got = await request(t.env.http, "GET", f"{t.options.bootstrap}/query", t.log)
    expect(got.status == 200 and isinstance(got.body, dict), f"GET /query: HTTP {got.status}")
    body: dict[str, Any] = got.body
    return body


def expect_ok(got: HttpResult, what: str, *, versioned: bool = False) -> None:
    expect(got.status == 200, f"{what}: expected HTTP 200, got {got.status} {got.body!r}")
    expect(
        isinstance(got.body, dict) and got.body.get("status") == "ok",
        f"{what}: expected {{'status': 'ok'}}, got {got.body!r}",
    )
    has = "pdwire_version" in got.body
    expect(
        has == versioned,
        f"{what}: the reply {'lacks' if versioned else 'has'} pdwire_version: {got.body!r}",
    )


def expect_rejected(got: HttpResult, what: str, detail: str) -> None:
    expect(got.status == 400, f"{what}: expected HTTP 400, got {got.status} {got.body!r}")
    expect_equal(got.body, {"detail": detail}, f"{what}: the body")


def require_pdwire_server(t: ProducerCtx) -> None:
    if t.env.p_version < 2:
        raise Unsupported("P's /query entry has no pdwire/2 fields: a legacy bootstrap server")


@case(
    "producer/4.1/1",
    "4.1-R3",
    covers=("4.1-R2",),
)
async def invalid_registrations(t: ProducerCtx) -> None:
    """A registration that fails validation (a missing field, a wrong type, a negative rank,
    an addr not tcp://host:port with a port of 1 to 65535) gets HTTP 4xx and is not stored."""
    engine_id, dp = fresh()
    good = worker(engine_id, dp)
    bad = {
        "no addr": {k: v for k, v in good.items() if k != "addr"},
        "no engine_id": {k: v for k, v in good.items() if k != "engine_id"},
        "tp_rank a string": {**good, "tp_rank": "zero"},
        "dp_rank a list": {**good, "dp_rank": [dp]},
        "negative pp_rank": {**good, "pp_rank": -1},
        "addr without tcp://": {**good, "addr": "127.0.0.1:20000"},
        "addr with port 0": {**good, "addr": "tcp://127.0.0.1:0"},
        "addr with port 65536": {**good, "addr": "tcp://127.0.0.1:65536"},
        "addr without a port": {**good, "addr": "tcp://127.0.0.1"},
        "unbracketed IPv6 addr": {**good, "addr": "tcp://::1:20000"},
        "a JSON array": [good],
    }
    for what, body in bad.items():
        got = await register(t, body)
        expect(400 <= got.status < 500, f"{what}: expected HTTP 4xx, got {got.status}")
    expect(str(dp) not in await query(t), f"an invalid registration was stored for dp_rank {dp}")


@case(
    "producer/4.1/7",
    "4.1-R17",
)
async def long_registration_body(t: ProducerCtx) -> None:
    """A pdwire bootstrap server answers a registration body of 64 KiB and one byte with HTTP
    413 and stores nothing."""
    require_pdwire_server(t)
    engine_id, dp = fresh()
    body = worker(engine_id, dp, x_padding="")
    base = len(json.dumps(body).encode())
    body["x_padding"] = "x" * (MAX_REGISTER_BODY_BYTES + 1 - base)
    raw = json.dumps(body).encode()
    assert len(raw) == MAX_REGISTER_BODY_BYTES + 1, len(raw)
    got = await request(
        t.env.http,
        "POST",
        f"{t.options.bootstrap}/register",
        t.log,
        content=raw,
        headers={"Content-Type": "application/json"},
    )
    expect(got.status == 413, f"a body of {len(raw)} bytes: expected HTTP 413, got {got.status}")
    expect(str(dp) not in await query(t), f"a long registration was stored for dp_rank {dp}")


@case(
    "producer/4.1/2",
    "4.1-R4",
    covers=("4.2-R1", "4.2-R2", "4.1-R15"),
)
async def registration_is_stored(t: ProducerCtx) -> None:
    """An accepted registration gets HTTP 200 {"status": "ok"} (no pdwire_version, as the body
    had none) and /query lists its addr under its DP, TP and PP ranks, every key decimal."""
    engine_id, dp = fresh()
    bodies = [worker(engine_id, dp, tp, pp) for tp in range(2) for pp in range(2)]
    for body in bodies:
        expect_ok(await register(t, body), f"register tp {body['tp_rank']} pp {body['pp_rank']}")
    entries = await query(t)
    for key, entry in entries.items():
        expect(DECIMAL.fullmatch(key) is not None, f"/query key {key!r} is not a decimal")
        addrs = entry.get("worker_addr") if isinstance(entry, dict) else None
        expect(isinstance(addrs, dict), f"/query[{key}] has no worker_addr object: {entry!r}")
        assert isinstance(addrs, dict)
        for tp, by_pp in addrs.items():
            expect(DECIMAL.fullmatch(tp) is not None, f"worker_addr key {tp!r} is not a decimal")
            expect(isinstance(by_pp, dict), f"worker_addr[{tp}] is not an object: {by_pp!r}")
            for pp, addr in by_pp.items():
                expect(DECIMAL.fullmatch(pp) is not None, f"worker_addr[{tp}] key {pp!r}")
                expect(ADDR.fullmatch(str(addr)) is not None, f"worker_addr[{tp}][{pp}] {addr!r}")
    entry = entries.get(str(dp))
    expect(isinstance(entry, dict), f"/query has no entry {dp}: {sorted(entries)}")
    assert isinstance(entry, dict)
    expect_equal(entry.get("engine_id"), engine_id, "engine_id")
    want: dict[str, dict[str, str]] = {str(b["tp_rank"]): {} for b in bodies}
    for b in bodies:
        want[str(b["tp_rank"])][str(b["pp_rank"])] = b["addr"]
    expect_equal(entry.get("worker_addr"), want, "worker_addr")


@case("producer/4.1/3", "4.1-R7", risk=12)
async def identical_reregistration(t: ProducerCtx) -> None:
    """The same registration sent again (a retry whose reply was lost) gets HTTP 200
    {"status": "ok"} again."""
    engine_id, dp = fresh()
    body = worker(engine_id, dp)
    expect_ok(await register(t, body), "the first registration")
    expect_ok(await register(t, body), "the identical registration")


@case(
    "producer/4.1/4",
    "4.1-R6",
    covers=("4.1-R8",),
)
async def conflicting_addr(t: ProducerCtx) -> None:
    """A worker registered again at another addr gets HTTP 400 with the exact detail, and
    /query keeps the first addr."""
    engine_id, dp = fresh()
    body = worker(engine_id, dp)
    expect_ok(await register(t, body), "the first registration")
    moved = {**body, "addr": "tcp://127.0.0.1:29999"}
    detail = error_strings.WORKER_ALREADY_REGISTERED.format(
        dp_rank=dp, tp_rank=0, pp_rank=0, registered_addr=body["addr"], addr=moved["addr"]
    )
    expect_rejected(await register(t, moved), "a registration at another addr", detail)
    entry = (await query(t)).get(str(dp)) or {}
    expect_equal(entry.get("worker_addr"), {"0": {"0": body["addr"]}}, "worker_addr")


@case(
    "producer/4.1/5",
    "4.1-R5",
    covers=("4.1-R8",),
)
async def conflicting_engine_id(t: ProducerCtx) -> None:
    """A registration for a DP rank that has another engine id gets HTTP 400 with the exact
    detail, and /query keeps the first engine."""
    engine_id, dp = fresh()
    expect_ok(await register(t, worker(engine_id, dp)), "the first registration")
    other = f"{engine_id}-other"
    detail = error_strings.ENGINE_ID_MISMATCH.format(
        dp_rank=dp, registered_engine_id=engine_id, engine_id=other
    )
    got = await register(t, worker(other, dp, tp=1))
    expect_rejected(got, "another engine id for the DP rank", detail)
    entry = (await query(t)).get(str(dp)) or {}
    expect_equal(entry.get("engine_id"), engine_id, "engine_id")


@case(
    "producer/4.1/6",
    "4.1-R13",
    covers=("4.1-R15", "4.2-R2"),
)
async def pdwire_fields_are_kept(t: ProducerCtx) -> None:
    """A pdwire server keeps a registration's pdwire/2 fields and returns them in the engine's
    /query entry, and its reply carries pdwire_version."""
    require_pdwire_server(t)
    engine_id, dp = fresh()
    fields: dict[str, Any] = {
        "pdwire_version": 2,
        "pdwire_caps": ["cancel", "deadline"],
        "tp_size": 1,
        "pp_size": 1,
    }
    if t.env.fingerprint is not None:
        fields["fingerprint"] = t.env.entry["fingerprint"]
    got = await register(t, worker(engine_id, dp, **fields))
    expect_ok(got, "a pdwire/2 registration", versioned=True)
    entry = (await query(t)).get(str(dp)) or {}
    for name, value in fields.items():
        expect_equal(entry.get(name), value, f"/query entry {name}")


@case(
    "producer/4.3/1",
    "4.3-R1",
)
async def health(t: ProducerCtx) -> None:
    """A pdwire bootstrap server answers GET /health with HTTP 200 {"status": "ok"}."""
    require_pdwire_server(t)
    got = await request(t.env.http, "GET", f"{t.options.bootstrap}/health", t.log)
    expect(got.status == 200, f"GET /health: HTTP {got.status} {got.body!r}")
    expect_equal(got.body, {"status": "ok"}, "GET /health body")


@case(
    "producer/3.1/3",
    "3.1-R1",
    covers=("4.1-R1", "4.2-R2", "4.1-R11", "8.1-R4"),
)
async def every_worker_registered(t: ProducerCtx) -> None:
    """P's /query entry lists a tcp://host:port address for every TP and PP rank of P, each of
    them serves pulls, and an entry without pdwire_version carries no pdwire/2 field (nor do
    that P's replies to a pull that announced)."""
    entry = t.env.entry
    tp_size, pp_size = t.p_tp, t.p_pp
    for tp in range(tp_size):
        for pp in range(pp_size):
            addr = t.addr(tp, pp)
            expect(ADDR.fullmatch(addr) is not None, f"worker ({tp}, {pp}) registered {addr!r}")
    listed = {(int(tp), int(pp)) for tp, by_pp in entry["worker_addr"].items() for pp in by_pp}
    expect_equal(listed, {(a, b) for a in range(tp_size) for b in range(pp_size)}, "the ranks")
    legacy = "pdwire_version" not in entry
    if legacy:
        extra = sorted(set(entry) & {"pdwire_caps", "tp_size", "pp_size", "fingerprint"})
        expect(not extra, f"an entry without pdwire_version has {extra}")
    loaded = await t.load(d_pp=pp_size, announce=legacy)
    t.expect_loaded(loaded)
    t.release(loaded)
    served = {addr for _, addr, _ in loaded.pulls}
    expect_equal(served, {t.addr(a, b) for a in range(tp_size) for b in range(pp_size)}, "served")
    if legacy:
        for _, addr, r in loaded.pulls:
            for reply in r.replies:
                expect("pdwire_version" not in reply.keys, f"{addr}: a legacy P announced")
