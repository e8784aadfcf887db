"""P's engine as its bootstrap server names it on ``GET /query`` (§4.3): the one entry the
harness tests, and the sizes and version that entry says."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Final

import httpx

from ..case import WireLog
from .http import request

#: Seconds between the asks of a run that waits for P's workers to register.
REGISTRATION_POLL_S: Final = 0.2


@dataclasses.dataclass(frozen=True)
class PEngine:
    """One DP rank's entry of a ``/query`` answer."""

    query: dict[str, Any]
    dp_rank: int
    entry: dict[str, Any]


class OfPEngine:
    """What a suite's world that tests one engine of P (``p``) says of it: the sizes and
    version its entry says, or derives from its workers' addresses."""

    p: PEngine

    @property
    def query(self) -> dict[str, Any]:
        return self.p.query

    @property
    def dp_rank(self) -> int:
        return self.p.dp_rank

    @property
    def entry(self) -> dict[str, Any]:
        return self.p.entry

    @property
    def engine_id(self) -> str:
        return str(self.entry.get("engine_id") or "")

    @property
    def p_tp(self) -> int:
        return int(self.entry.get("tp_size") or len(self.entry.get("worker_addr") or {}) or 1)

    @property
    def p_pp(self) -> int:
        addrs: dict[str, dict[str, str]] = self.entry.get("worker_addr") or {}
        first: dict[str, str] = next(iter(addrs.values()), {})
        return int(self.entry.get("pp_size") or len(first) or 1)

    @property
    def p_version(self) -> int:
        return int(self.entry.get("pdwire_version") or 0)


async def query_engine(
    http: httpx.AsyncClient, bootstrap: str, engine_id: str | None, log: WireLog
) -> PEngine | str:
    """The entry of ``engine_id`` (any engine when None) at ``bootstrap``, or why there is none."""
    got = await request(http, "GET", f"{bootstrap}/query", log)
    if not got.ok or not isinstance(got.body, dict) or not got.body:
        return (
            f"P's bootstrap server at {bootstrap} gave no engine on GET /query "
            f"(HTTP {got.status} {got.error or repr(got.body)[:300]}): is P up and registered?"
        )
    for dp, entry in got.body.items():
        if isinstance(entry, dict) and engine_id in (None, entry.get("engine_id")):
            return PEngine(got.body, int(dp), entry)
    return f"no engine {engine_id!r} at {bootstrap}"


async def registered_engine(
    http: httpx.AsyncClient, bootstrap: str, engine_id: str | None, log: WireLog, timeout: float
) -> PEngine | str:
    """``query_engine``, asked again until the entry lists as many workers as its tp_size and
    pp_size say, or ``timeout`` seconds pass: a P answers ``/health`` before each of its
    workers has registered at its bootstrap server (§4.1), later still on a loaded machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        picked = await query_engine(http, bootstrap, engine_id, log)
        missing = picked if isinstance(picked, str) else _unregistered(picked)
        if not missing:
            return picked
        if loop.time() >= deadline:
            return missing
        await asyncio.sleep(REGISTRATION_POLL_S)  # another process registering: nothing to await


def _unregistered(p: PEngine) -> str:
    """Why the entry lacks workers its sizes name, or "" when it has them all."""
    addrs = p.entry.get("worker_addr")
    count = (
        sum(len(s) for s in addrs.values() if isinstance(s, dict)) if isinstance(addrs, dict) else 0
    )
    want = int(p.entry.get("tp_size") or 1) * int(p.entry.get("pp_size") or 1)
    if count >= max(want, 1):
        return ""
    return (
        f"P's engine {p.entry.get('engine_id')!r} lists {count} of the {want} workers its "
        "tp_size and pp_size name: are they all up and registered?"
    )
