"""How ``pdwire conformance self`` lays its testbeds out in time (``conformance.selftest``):
which layouts run at once, which wait, and that every testbed started is stopped. The testbeds
here start no process: these tests are about the order alone, which a real run shows only as
its length."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from conformance import selftest
from conformance.case import Case, all_cases
from conformance.runner import Result, RunOptions
from conformance.selftest import DEFAULT, KEYED, LEASED, SLOW_PREFILL, Layout

BOUND_S = 5.0  # no wait of these tests comes near it unless a layout waits for another forever


def _one_case_of(layout: Layout, suite: str = "") -> Case:
    """A case that runs in ``layout`` (of ``suite``, when given)."""
    return next(
        c for c in all_cases() if selftest.layout_of(c) == layout and suite in ("", c.suite.value)
    )


@dataclasses.dataclass
class Beds:
    """Stands in for the testees: records each testbed started and stopped."""

    started: list[Layout] = dataclasses.field(default_factory=list)
    stopped: list[Layout] = dataclasses.field(default_factory=list)

    async def start(self, layout: Layout, roles: set[Any]) -> selftest.Testbed:
        self.started.append(layout)
        beds = self

        class Bed(selftest.Testbed):
            async def stop(self) -> None:
                beds.stopped.append(self.layout)

        return Bed(layout)


def _plan(monkeypatch: pytest.MonkeyPatch, run: Any) -> Beds:
    beds = Beds()
    monkeypatch.setattr(selftest, "_started", beds.start)
    monkeypatch.setattr(selftest, "run_suites", run)
    return beds


@pytest.mark.asyncio
async def test_default_runs_beside_the_other_layouts_and_last_only_once_beside_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DEFAULT's cases run while another layout's do; those of LAST wait for the suites beside
    (``quiet``) and then run together, while DEFAULT's may still be running."""
    began = {layout: asyncio.Event() for layout in (KEYED, LEASED, SLOW_PREFILL)}
    quiet: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen_quiet: dict[Layout, bool] = {}

    async def run(bed: selftest.Testbed, cases: Sequence[Case], *_: Any) -> list[Result]:
        layout = bed.layout
        if layout in began:
            began[layout].set()
        if layout == DEFAULT:
            await asyncio.wait_for(began[KEYED].wait(), BOUND_S)
            quiet.set_result(None)
            await asyncio.wait_for(began[LEASED].wait(), BOUND_S)
        elif layout in selftest.LAST:
            seen_quiet[layout] = quiet.done()
            other = SLOW_PREFILL if layout == LEASED else LEASED
            await asyncio.wait_for(began[other].wait(), BOUND_S)
        return []

    beds = _plan(monkeypatch, run)
    cases = [_one_case_of(layout) for layout in (DEFAULT, KEYED, LEASED, SLOW_PREFILL)]
    await asyncio.wait_for(
        selftest._run_layouts(cases, RunOptions(), None, 1.0, quiet), 2 * BOUND_S
    )
    assert seen_quiet == {LEASED: True, SLOW_PREFILL: True}
    assert sorted(beds.started) == sorted(beds.stopped) == sorted(set(beds.started))
    assert len(beds.started) == 4


@pytest.mark.asyncio
async def test_a_lane_that_fails_stops_every_testbed_and_raises_its_own_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When a layout's run fails, the other lane is cancelled, every testbed started (also
    those started ahead and never run) is stopped, and the error is the run's own, not a group
    of them: the CLI reports a testee that cannot start by its type."""

    async def run(bed: selftest.Testbed, cases: Sequence[Case], *_: Any) -> list[Result]:
        if bed.layout == KEYED:
            raise RuntimeError("the keyed testees broke")
        await asyncio.sleep(BOUND_S)  # cancelled when the other lane fails
        return []

    beds = _plan(monkeypatch, run)
    cases = [_one_case_of(layout) for layout in (DEFAULT, KEYED, LEASED, SLOW_PREFILL)]
    with pytest.raises(RuntimeError, match="keyed testees broke"):
        await asyncio.wait_for(selftest._run_layouts(cases, RunOptions(), None, 1.0), BOUND_S)
    assert DEFAULT in beds.started and KEYED in beds.started
    assert sorted(beds.stopped) == sorted(beds.started)
