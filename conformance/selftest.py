"""``pdwire conformance self``: the reference testees, started here, against every suite.

The reference P runs TP 2 (with its bootstrap server), the reference D TP 1 and decodes from
whatever KV its P writes (``--no-verify-kv``), as an engine with a real model does: the consumer
suite's fake P writes bytes of its own. Both run with short timers. A mutant goes to the testee
of its role only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pdwire.sim.geometry import Geometry

from . import testees
from .case import Case, Suite
from .runner import Result, RunOptions

PREFILL_TP = 2
RECEIVE_TIMEOUT = 3.0  # the reference D's receive timeout per pull
GEOMETRY = Geometry(testees.LAYERS, testees.KV_HEADS, testees.HEAD_DIM, testees.BLOCK_SIZE)
DECODE_FLAGS = ("--no-verify-kv", "--receive-timeout", str(RECEIVE_TIMEOUT))


def roles_for(cases: Sequence[Case]) -> set[testees.Role]:
    """The testees the suites of ``cases`` need."""
    suites = {c.suite for c in cases}
    roles: set[testees.Role] = set()
    if suites & {Suite.PRODUCER, Suite.PAIR}:
        roles.add("prefill")
    if suites & {Suite.CONSUMER, Suite.PAIR}:
        roles.add("decode")
    return roles


def start(role: testees.Role, mutant: str = "", mutant_control: bool = False) -> testees.Testee:
    """A reference testee as a self run has it."""
    if role == "prefill":
        return testees.start_node(role, tp=PREFILL_TP, mutant=mutant, mutant_control=mutant_control)
    return testees.start_node(
        role, mutant=mutant, mutant_control=mutant_control, extra=DECODE_FLAGS
    )


@dataclasses.dataclass
class Testbed:
    """The reference testees of a run, by role."""

    nodes: dict[testees.Role, testees.Testee] = dataclasses.field(default_factory=dict)

    async def start(
        self,
        roles: set[testees.Role],
        mutant: str = "",
        role: str = "",
        mutant_control: bool = False,
    ) -> None:
        """Start the nodes of ``roles`` at once (starting one is mostly waiting for its worker
        processes); ``mutant`` goes to the node of ``role``."""
        todo = sorted(roles)
        got = await asyncio.gather(
            *(
                asyncio.to_thread(start, r, mutant if r == role else "", mutant_control)
                for r in todo
            ),
            return_exceptions=True,
        )
        for r, node in zip(todo, got, strict=True):
            if isinstance(node, testees.Testee):
                self.nodes[r] = node
        errors = [e for e in got if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    async def restart(self, role: testees.Role) -> None:
        node = self.nodes.pop(role, None)
        if node is not None:
            await asyncio.to_thread(node.stop)
        self.nodes[role] = await asyncio.to_thread(start, role, "", True)

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in self.nodes.values()))
        self.nodes.clear()


async def run_suites(
    bed: Testbed,
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None,
    timeout: float,
) -> list[Result]:
    """Every suite of ``cases`` whose testees ``bed`` holds, against them."""
    wanted = {c.suite for c in cases}
    p, d = bed.nodes.get("prefill"), bed.nodes.get("decode")
    results: list[Result] = []
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


@contextlib.asynccontextmanager
async def testbed(roles: set[testees.Role], **kw: Any) -> AsyncIterator[Testbed]:
    bed = Testbed()
    try:
        await bed.start(roles, **kw)
        yield bed
    finally:
        await bed.stop()


async def run_self(
    mutant: str,
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None,
    timeout: float,
) -> list[Result]:
    role = testees.mutants()[mutant].role if mutant else ""
    async with testbed(roles_for(cases), mutant=mutant, role=role) as bed:
        return await run_suites(bed, cases, options, on_result, timeout)
