"""Showing that every case can fail: each mutant of the reference testee against the cases that
name it, every one of which must fail (``pdwire conformance mutants --check``).

One testbed serves every mutant that can be switched on in a running node: a mutant is switched
on, its cases run, it is switched off, and the node must then be healthy and hold no block, or it
is restarted. A mutant that needs a node of its own (one that changes the node's configuration),
or that survives in a switched node, is run once more on a fresh node: a patch that takes effect
only at start-up shows there.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence

from . import testees
from .case import Case, Verdict
from .runner import RunOptions
from .selftest import Testbed, roles_for, run_suites, testbed

#: Longer than the testees' timers: what a mutant run left behind must be freed by then.
SETTLE_S = 3 * testees.ABORT_TIMEOUT
#: Runs of one mutant when a testee fails to start or to switch (not when a case fails).
TRIES = 2


@dataclasses.dataclass
class MutantResult:
    name: str
    role: str
    mode: str  # "switched" or "own node"
    verdicts: dict[str, str]  # case id -> verdict

    @property
    def caught(self) -> bool:
        return bool(self.verdicts) and all(v == Verdict.FAIL for v in self.verdicts.values())


async def _on_own_node(
    name: str, role: str, cases: Sequence[Case], timeout: float
) -> dict[str, str]:
    async with testbed(roles_for(cases), mutant=name, role=role) as bed:
        results = await run_suites(bed, cases, RunOptions(strict=True), None, timeout)
    return {r.case.id: r.verdict.value for r in results}


async def _switched(
    bed: Testbed, name: str, role: testees.Role, cases: Sequence[Case], timeout: float
) -> dict[str, str]:
    node = bed.nodes[role]
    await asyncio.to_thread(node.set_mutant, name)
    try:
        results = await run_suites(bed, cases, RunOptions(strict=True), None, timeout)
    finally:
        if node.alive():
            await asyncio.to_thread(node.set_mutant, "")
    for r in sorted(bed.nodes):
        if not await asyncio.to_thread(bed.nodes[r].settled, SETTLE_S):
            await bed.restart(r)
    return {r.case.id: r.verdict.value for r in results}


async def check_mutants(
    names: Sequence[str],
    cases: Sequence[Case],
    timeout: float,
    on_result: Callable[[MutantResult], None] | None = None,
) -> list[MutantResult]:
    """Run each of ``names`` against the cases that name it."""
    info = testees.mutants()
    unknown = [n for n in names if n not in info]
    if unknown:
        raise RuntimeError(f"no such mutants: {', '.join(unknown)}")
    out: list[MutantResult] = []
    async with testbed({"prefill", "decode"}, mutant_control=True) as bed:
        for name in names:
            m = info[name]
            mine = [c for c in cases if name in c.caught_by]
            for attempt in range(TRIES):
                try:
                    result = await _check_one(bed, m, mine, timeout)
                    break
                except testees.TesteeError:
                    # a node that failed to start or to switch says nothing about the mutant:
                    # start the testbed afresh and run the mutant again
                    if attempt == TRIES - 1:
                        raise
                    for role in ("decode", "prefill"):
                        await bed.restart(role)
            out.append(result)
            if on_result is not None:
                on_result(result)
    return out


async def _check_one(
    bed: Testbed, m: testees.MutantInfo, cases: Sequence[Case], timeout: float
) -> MutantResult:
    result = MutantResult(m.name, m.role, "switched", {})
    if m.switchable:
        result.verdicts = await _switched(bed, m.name, m.role, cases, timeout)
    if not m.switchable or not result.caught:
        result.mode = "own node"
        result.verdicts = await _on_own_node(m.name, m.role, cases, timeout)
    return result
