"""Showing that every case can fail: each mutant of the reference testee against the cases it
names, every one of which must fail (``python -m mutants check``).

One testbed per layout of testees (``selftest.LAYOUTS``) serves every mutant that can be switched
on in a running node: a mutant is switched on (``preload.switch``), its cases run, it is switched
off, and the node must then be healthy and hold no block, or it is restarted. A mutant that needs
a node of its own (``at_start``), or that survives in a switched node, is run once more on a
fresh node: a patch that takes effect only at start-up shows there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

from conformance import testees
from conformance.case import Case, Suite, Verdict
from conformance.runner import RunOptions
from conformance.selftest import DEFAULT, Layout, Testbed, by_layout, roles_for, run_suites, testbed
from pdwire.roles import Role

from . import MUTANTS, Mutant, preload

#: Longer than the testees' timers: what a mutant run left behind must be freed by then.
SETTLE_S = 3 * testees.ABORT_TIMEOUT
#: Runs of one mutant when a testee fails to start or to switch, or when its run on a node of
#: its own was inconclusive (``MutantResult.inconclusive``); never when a case passed.
TRIES = 2
#: How many mutants of the suites that start a testee of their own for each case (registration)
#: are checked side by side: they share nothing, and most of each is waiting for P to start.
SIDE_BY_SIDE = 3
#: Every case that names a mutant must fail on its own, whatever a case before it did to the
#: testee: strict, and no case blocked by an earlier one.
_EVERY_CASE = RunOptions(strict=True, probe=False)


@dataclasses.dataclass
class MutantResult:
    name: str
    role: str
    mode: str  # "switched" or "own node"
    verdicts: dict[str, str]  # case id -> verdict
    seconds: float = 0.0  # how long checking it took

    @property
    def caught(self) -> bool:
        return bool(self.verdicts) and all(v == Verdict.FAIL for v in self.verdicts.values())

    @property
    def inconclusive(self) -> bool:
        """No case passed, but some could not run (unsupported or skipped: a timing case
        whose testee was too slow under load, say), so the mutant is neither caught nor shown
        to survive."""
        return Verdict.PASS.value not in self.verdicts.values() and not self.caught


def cases_of(m: Mutant, cases: Sequence[Case]) -> list[Case]:
    """Those of ``cases`` that ``m`` names."""
    return [c for c in cases if c.id in m.cases]


async def _on_own_node(
    m: Mutant, cases: Sequence[Case], timeout: float, layout: Layout
) -> dict[str, str]:
    async with testbed(roles_for(cases), layout, {m.role: preload.environ(m.name)}) as bed:
        results = await run_suites(bed, cases, _EVERY_CASE, None, timeout)
    return {r.case.id: r.verdict.value for r in results}


def _switch_folder(bed: Testbed, role: Role) -> Path:
    return Path(bed.env_of(role)[preload.SWITCH_ENV])


async def _switched(
    bed: Testbed, name: str, role: Role, cases: Sequence[Case], timeout: float
) -> dict[str, str]:
    node = bed.nodes[role]
    await asyncio.to_thread(preload.switch, _switch_folder(bed, role), name)
    try:
        results = await run_suites(bed, cases, _EVERY_CASE, None, timeout)
    finally:
        if node.alive():
            await asyncio.to_thread(preload.switch, _switch_folder(bed, role), "")
    for r in sorted(bed.nodes):
        if not await asyncio.to_thread(bed.nodes[r].settled, SETTLE_S):
            await bed.restart(r)
    return {r.case.id: r.verdict.value for r in results}


def work_items(chosen: Sequence[Mutant], cases: Sequence[Case]) -> list[list[Mutant]]:
    """``chosen`` as the items the checkers take, each whole: the mutants whose cases run in
    the same layouts other than DEFAULT alone make one item, so that one checker starts those
    testees; every other mutant is an item of its own. Items of several mutants come first,
    the largest first; the others in their order."""
    together: dict[frozenset[Layout], list[Mutant]] = {}
    alone: list[list[Mutant]] = []
    for m in chosen:
        layouts = frozenset(by_layout(cases_of(m, cases)))
        if m.role == "proxy" or layouts <= {DEFAULT}:
            alone.append([m])
        else:
            together.setdefault(layouts, []).append(m)
    return sorted(together.values(), key=len, reverse=True) + alone


async def check_mutants(
    names: Sequence[str],
    cases: Sequence[Case],
    timeout: float,
    on_result: Callable[[MutantResult], None] | None = None,
    jobs: int = 1,
) -> list[MutantResult]:
    """Run each of ``names`` against the cases that name it, in a switching testbed of each
    layout those cases run in (``selftest.layout_of``). ``jobs`` checkers, each in testbeds of
    its own, take the mutants (``work_items``) one item after another as each is free; the
    mutants whose cases start testees of their own are checked beside them."""
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise RuntimeError(f"no such mutants: {', '.join(unknown)}")
    chosen = [MUTANTS[n] for n in names]
    alone = [m for m in chosen if _own_testee_per_case(m, cases)]
    items = iter(work_items([m for m in chosen if m not in alone], cases))
    checkers = min(max(1, jobs), len(chosen) - len(alone))
    found = await asyncio.gather(
        *(_checker(items, cases, timeout, on_result) for _ in range(checkers)),
        _check_side_by_side(alone, cases, timeout, on_result),
    )
    by_name = {r.name: r for group in found for r in group}
    return [by_name[n] for n in names]


def _own_testee_per_case(m: Mutant, cases: Sequence[Case]) -> bool:
    """Whether every case that ``m`` names starts a testee of its own."""
    mine = cases_of(m, cases)
    return bool(mine) and all(c.suite is Suite.REGISTRATION for c in mine)


async def _check_side_by_side(
    chosen: Sequence[Mutant],
    cases: Sequence[Case],
    timeout: float,
    on_result: Callable[[MutantResult], None] | None,
) -> list[MutantResult]:
    """Mutants whose cases each start their own testee, SIDE_BY_SIDE at a time."""
    slots = asyncio.Semaphore(SIDE_BY_SIDE)

    async def one(m: Mutant) -> MutantResult:
        async with slots:
            t0 = time.monotonic()
            verdicts = await _on_own_node(m, cases_of(m, cases), timeout, DEFAULT)
            result = MutantResult(m.name, m.role, "own node", verdicts, time.monotonic() - t0)
        if on_result is not None:
            on_result(result)
        return result

    return list(await asyncio.gather(*(one(m) for m in chosen)))


async def _checker(
    items: Iterator[list[Mutant]],
    cases: Sequence[Case],
    timeout: float,
    on_result: Callable[[MutantResult], None] | None,
) -> list[MutantResult]:
    """One checker: it takes the next of ``items`` once it has checked the one before, in
    switching testbeds of its own, started as a mutant first needs each; stopped at the end."""
    out: list[MutantResult] = []
    beds: dict[Layout, Testbed] = {}
    roles = {layout: roles_for(mine) for layout, mine in by_layout(cases).items()}
    folders = Path(tempfile.mkdtemp(prefix="pdwire-mutants-"))

    async def bed(layout: Layout) -> Testbed:
        if layout not in beds:
            environ: dict[str, dict[str, str]] = {}
            for role in roles[layout]:
                folder = folders / f"{len(beds)}-{role}"
                folder.mkdir()
                environ[role] = preload.environ(switch=folder)
            beds[layout] = Testbed(layout, environ=environ)
            await beds[layout].start(roles[layout])
        return beds[layout]

    async def check(m: Mutant) -> MutantResult:
        mine = cases_of(m, cases)
        if m.role == "proxy":  # on a proxy of its own, which the proxy suite starts
            verdicts = await _on_own_node(m, mine, timeout, DEFAULT)
            return MutantResult(m.name, m.role, "own node", verdicts)
        result = MutantResult(m.name, m.role, "switched", {})
        for layout, theirs in by_layout(mine).items():
            one = await _with_retry(functools.partial(bed, layout), m, theirs, timeout, layout)
            result.verdicts.update(one.verdicts)
            result.mode = one.mode
        return result

    try:
        for m in itertools.chain.from_iterable(items):  # the next item, once this one is done
            t0 = time.monotonic()
            result = await check(m)
            result.seconds = time.monotonic() - t0
            out.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        for b in beds.values():
            await b.stop()
        shutil.rmtree(folders, ignore_errors=True)
    return out


async def _with_retry(
    bed: Callable[[], Awaitable[Testbed]],
    m: Mutant,
    cases: Sequence[Case],
    timeout: float,
    layout: Layout,
) -> MutantResult:
    """``_check_one``, once more on fresh testees when a testee failed; ``bed`` gives the
    switching testbed of ``layout`` (started when first asked for)."""
    for attempt in range(TRIES):
        try:
            return await _check_one(bed, m, cases, timeout, layout)
        except (RuntimeError, OSError) as exc:
            # A node that failed to start, to switch, or to answer a suite's first request
            # (TesteeError is a RuntimeError) says nothing about the mutant: start the testbed
            # afresh and run the mutant again.
            if attempt == TRIES - 1:
                raise
            print(f"{m.name}: {exc}; restarting the testees", file=sys.stderr, flush=True)
            if m.switchable:
                switching = await bed()
                for role in sorted(switching.roles, reverse=True):  # a node that never started too
                    await switching.restart(role)
    raise AssertionError("unreachable")


async def _check_one(
    bed: Callable[[], Awaitable[Testbed]],
    m: Mutant,
    cases: Sequence[Case],
    timeout: float,
    layout: Layout,
) -> MutantResult:
    result = MutantResult(m.name, m.role, "switched", {})
    if m.switchable and m.role != "proxy":
        result.verdicts = await _switched(await bed(), m.name, m.role, cases, timeout)
    if not m.switchable or not result.caught:
        if m.switchable:
            print(
                f"{m.name}: not caught switched on in a running node; on a node of its own now",
                file=sys.stderr,
                flush=True,
            )
        result.mode = "own node"
        for attempt in range(TRIES):
            result.verdicts = await _on_own_node(m, cases, timeout, layout)
            if result.caught or not result.inconclusive or attempt == TRIES - 1:
                break
            print(
                f"{m.name}: inconclusive on a node of its own ({result.verdicts}); once more",
                file=sys.stderr,
                flush=True,
            )
    return result
