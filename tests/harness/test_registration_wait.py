"""A run that starts while P's workers are still registering waits for them (§4.1): P answers
``/health`` before each worker has registered at its bootstrap server, later still on a loaded
machine, where a run of ``pdwire conformance self`` once found no engine and could not start.
The reference bootstrap server on loopback, real HTTP."""

from __future__ import annotations

import asyncio

import httpx

from conformance.case import WireLog
from conformance.peers.p_engine import PEngine, registered_engine
from reference_connector.bootstrap import BootstrapServer


def _register(url: str, tp_rank: int, port: int) -> None:
    body = {
        "engine_id": "engine-0", "dp_rank": 0, "tp_rank": tp_rank, "pp_rank": 0,
        "addr": f"tcp://127.0.0.1:{port}", "tp_size": 2, "pp_size": 1, "pdwire_version": 2,
    }  # fmt: skip
    httpx.post(f"{url}/register", json=body, timeout=5.0).raise_for_status()


async def _wait(url: str, timeout: float) -> PEngine | str:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return await registered_engine(http, url, None, WireLog(), timeout)


def test_the_run_waits_for_every_worker_of_p() -> None:
    with BootstrapServer().start("127.0.0.1", 0) as boot:

        async def go() -> PEngine | str:
            waiting = asyncio.create_task(_wait(boot.url, 10.0))
            await asyncio.to_thread(_register, boot.url, 0, 5001)
            await asyncio.sleep(0.5)  # the second worker registers later than the first
            assert not waiting.done(), "the run started with one of P's two workers registered"
            await asyncio.to_thread(_register, boot.url, 1, 5002)
            return await waiting

        got = asyncio.run(go())
    assert isinstance(got, PEngine), got
    assert got.entry["worker_addr"] == {
        "0": {"0": "tcp://127.0.0.1:5001"},
        "1": {"0": "tcp://127.0.0.1:5002"},
    }


def test_a_p_that_never_registers_all_its_workers_is_named() -> None:
    with BootstrapServer().start("127.0.0.1", 0) as boot:
        assert "gave no engine" in str(asyncio.run(_wait(boot.url, 0.5)))
        _register(boot.url, 0, 5001)
        why = asyncio.run(_wait(boot.url, 0.5))
    assert why == (
        "P's engine 'engine-0' lists 1 of the 2 workers its tp_size and pp_size name: are they "
        "all up and registered?"
    )
