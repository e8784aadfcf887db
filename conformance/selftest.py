"""``pdwire conformance self``: the reference testees, started here, against every suite."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from pdwire.sim.geometry import Geometry

from . import testees
from .case import Case, Suite
from .runner import Result, RunOptions
from .suites.producer_env import ProducerOptions
from .suites.run import run_producer

#: The reference P of a self run: TP 2, so that TP pairing has something to check.
PREFILL_TP = 2


def _mutant_role(mutant: str, cases: Sequence[Case]) -> str:
    return (
        "prefill"
        if any(mutant in c.caught_by and c.suite is Suite.PRODUCER for c in cases)
        else "decode"
    )


async def run_self(
    mutant: str,
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None,
    timeout: float,
) -> list[Result]:
    wanted = {c.suite for c in cases}
    results: list[Result] = []
    if Suite.PRODUCER in wanted:
        p = await asyncio.to_thread(
            testees.start_node,
            "prefill",
            tp=PREFILL_TP,
            mutant=mutant if mutant and _mutant_role(mutant, cases) == "prefill" else "",
        )
        try:
            geometry = Geometry(
                testees.LAYERS, testees.KV_HEADS, testees.HEAD_DIM, testees.BLOCK_SIZE
            )
            popts = ProducerOptions(
                api=p.url,
                bootstrap=p.bootstrap,
                geometry=geometry,
                abort_timeout=testees.ABORT_TIMEOUT,
                request_timeout=timeout,
            )
            results += await run_producer(popts, cases, options, on_result)
        finally:
            await asyncio.to_thread(p.stop)
    return results
