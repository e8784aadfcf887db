"""Registration case: where the engines of data-parallel deployments without an external
bootstrap address serve and find their bootstrap server, and the ``dp_rank`` they register
(§4.4, R13, R15, R16). Each engine is started from the DP template with its place in an
imagined deployment; scripted servers listen on its bootstrap port at each address it might
wrongly register at, so that a wrong one is named."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Final

import httpx

from ..case import CaseFailed, case, expect
from ..command import TemplateProcess
from ..peers.http import listens
from ..peers.registrar import Registrar
from .registration import SLACK_S
from .registration_env import DpDeployment, DpPlace, RegistrationCtx

MASTER_IP: Final = "127.0.0.2"  # vLLM's data_parallel_master_ip in every deployment
MASTER_ADDR: Final = "127.0.0.3"  # vLLM's master_addr
LISTEN: Final = ("127.0.0.1", MASTER_IP, MASTER_ADDR)
#: From an engine's start to its workers' registrations, or to its own server's full entry.
START_S: Final = 60.0


async def first_registration(
    registrars: dict[str, Registrar], process: TemplateProcess, what: str
) -> None:
    """Wait until one of ``registrars`` got a registration; fail when ``process`` exits or
    none comes in time."""

    def done(r: Registrar) -> bool:
        return bool(r.registrations()) or process.returncode is not None

    waits = [
        asyncio.create_task(r.wait(functools.partial(done, r), START_S + SLACK_S))
        for r in registrars.values()
    ]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    got = any(r.registrations() for r in registrars.values())
    expect(
        got,
        f"{what}: no registration at {', '.join(registrars)} on its bootstrap port "
        + (f"and it exited: {process.tail()}" if process.returncode is not None else "in time"),
    )


async def expect_registered(p: DpDeployment, what: str, host: str, dp_rank: int) -> None:
    """Every registration ``p``'s workers made went to ``host`` with ``dp_rank``."""
    assert p.process is not None
    await first_registration(p.registrars, p.process, what)
    for where, registrar in p.registrars.items():
        for a in registrar.registrations():
            rank = a.worker[0] if a.worker is not None else None
            expect(
                where == host,
                f"{what}: a worker registered at {where}:{p.port}, expected {host}:{p.port}",
            )
            expect(
                rank == dp_rank,
                f"{what}: a worker registered with dp_rank {rank}, expected {dp_rank}",
            )


def has_engine(r: httpx.Response) -> bool:
    try:
        return r.status_code == 200 and bool(r.json())
    except ValueError:
        return False


async def expect_serving(t: RegistrationCtx, p: DpDeployment, what: str, dp_rank: int) -> None:
    """``p`` serves the bootstrap server on its port, where its workers registered under
    ``dp_rank`` and nothing else."""
    assert p.process is not None
    url = f"http://127.0.0.1:{p.port}/query"
    until = time.monotonic() + START_S + SLACK_S
    try:
        answer = await p.process.wait_answer(url, until, has_engine)
    except CaseFailed as exc:
        raise CaseFailed(f"{what}: no bootstrap server with an engine at {url}; {exc}") from None
    expect(answer is not None, f"{what}: no bootstrap server with an engine at {url}")
    assert answer is not None
    t.log.received(f"http 127.0.0.1:{p.port}", "GET /query: HTTP 200", answer.json())
    keys = sorted(answer.json())
    expect(
        keys == [str(dp_rank)],
        f"{what}: its bootstrap server holds engines under dp_rank {keys}, expected [{dp_rank}]",
    )
    why = await listens(f"http://{MASTER_IP}:{p.port}/query", time.monotonic() + START_S)
    expect(not why, f"{what}: its bootstrap server does not answer at {MASTER_IP} ({why})")


@case(
    "registration/4.4/6",
    "4.4-R15",
    covers=("4.4-R13", "4.4-R16"),
    timeout=120.0,
)
async def data_parallel_placement(t: RegistrationCtx) -> None:
    """Four engines of data-parallel deployments, one after another (each stopped before the
    next starts, to keep the machine's load that of one P), none with an external bootstrap
    address. Engines local only (hybrid load balancing), DP index 3, local DP rank 1: no server
    of its own; its workers register at 127.0.0.1 with dp_rank 1. Local only, DP index 2, local
    rank 0: it serves the server (on every address), where its workers registered with dp_rank
    0. Internal load balancing, DP index 2, local rank 0: no server; they register at the DP
    master IP with dp_rank 2. Internal, one DP rank over two nodes, DP index 1: they register at
    the master address with dp_rank 1. A server started where none is due fails to bind beside
    the scripted ones, and stops that engine."""
    registering = (
        (
            "local only, local rank 1",
            DpPlace(3, 1, "hybrid", MASTER_IP, MASTER_ADDR),
            "127.0.0.1",
            1,
        ),
        ("internal, DP index 2", DpPlace(2, 0, "internal", MASTER_IP, MASTER_ADDR), MASTER_IP, 2),
        (
            "internal, two nodes a rank",
            DpPlace(1, 1, "internal", MASTER_IP, MASTER_ADDR, nodes=2),
            MASTER_ADDR,
            1,
        ),
    )
    for what, place, host, rank in registering:
        p = await t.deploy_dp(place, LISTEN)
        await expect_registered(p, f"the engine {what}", host, rank)
        await p.close()
    serving = "local only, local rank 0"
    p = await t.deploy_dp(DpPlace(2, 0, "hybrid", MASTER_IP, MASTER_ADDR), ())
    await expect_serving(t, p, f"the engine {serving}", 0)
