"""``pdwire conformance self``: the reference testees, started here, against every suite.

The reference P runs TP 2 (with its bootstrap server), the reference D TP 1 and decodes from
whatever KV its P writes (``--no-verify-kv``), as an engine with a real model does: the consumer
suite's fake P writes bytes of its own. Both run with short timers. A mutant goes to the testee
of its role only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence

from pdwire.sim.geometry import Geometry

from . import testees
from .case import Case, Suite
from .runner import Result, RunOptions

PREFILL_TP = 2
RECEIVE_TIMEOUT = 3.0  # the reference D's receive timeout per pull
GEOMETRY = Geometry(testees.LAYERS, testees.KV_HEADS, testees.HEAD_DIM, testees.BLOCK_SIZE)


@contextlib.contextmanager
def _started(role: str, mutant: str, **kw: object) -> Iterator[testees.Testee]:
    testee = testees.start_node(role, mutant=mutant, **kw)  # type: ignore[arg-type]
    try:
        yield testee
    finally:
        testee.stop()


async def run_self(
    mutant: str,
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None,
    timeout: float,
) -> list[Result]:
    wanted = {c.suite for c in cases}
    role = testees.mutant_roles()[mutant] if mutant else ""
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        p = d = None
        if wanted & {Suite.PRODUCER, Suite.PAIR}:
            p = await asyncio.to_thread(
                stack.enter_context,
                _started("prefill", mutant if role == "prefill" else "", tp=PREFILL_TP),
            )
        if wanted & {Suite.CONSUMER, Suite.PAIR}:
            extra = ("--no-verify-kv", "--receive-timeout", str(RECEIVE_TIMEOUT))
            d = await asyncio.to_thread(
                stack.enter_context,
                _started("decode", mutant if role == "decode" else "", extra=extra),
            )
        if Suite.PRODUCER in wanted and p is not None:
            from .suites.producer_env import ProducerOptions
            from .suites.run import run_producer

            popts = ProducerOptions(
                api=p.url,
                bootstrap=p.bootstrap,
                geometry=GEOMETRY,
                abort_timeout=testees.ABORT_TIMEOUT,
                request_timeout=timeout,
            )
            results += await run_producer(popts, cases, options, on_result)
        if Suite.CONSUMER in wanted and d is not None:
            from .suites.consumer_env import ConsumerOptions, run_consumer

            copts = ConsumerOptions(
                api=d.url,
                abort_timeout=testees.ABORT_TIMEOUT,
                receive_timeout=RECEIVE_TIMEOUT,
                request_timeout=timeout,
            )
            results += await run_consumer(copts, cases, options, on_result)
        if Suite.PAIR in wanted and p is not None and d is not None:
            from .suites.pair_env import PairOptions, run_pair

            pairopts = PairOptions(
                prefill=p.url, prefill_bootstrap=p.bootstrap, decode=d.url, request_timeout=timeout
            )
            results += await run_pair(pairopts, cases, options, on_result)
    return results
