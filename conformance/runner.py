"""Running cases: selection by glob, one case at a time under its timeout, verdicts, known-failing
and known-flaky lists (Connect conformance's rules), and the run's exit status."""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import functools
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol, TextIO

from .case import Case, CaseFailed, Skip, Suite, Unsupported, Verdict, WireLog
from .peers.loop_lag import LoopLag
from .requirements import Level
from .restart import Probe
from .restart import restart as restart_testee

#: The wait for any one reply or answer of a testee that the cases' own bounds are sized for.
DEFAULT_REQUEST_TIMEOUT = 10.0


def scale_for(request_timeout: float) -> float:
    """The factor on every case's bound when each wait may last ``request_timeout``: a slow
    testee given longer waits gets longer cases too, never shorter ones."""
    return max(1.0, request_timeout / DEFAULT_REQUEST_TIMEOUT)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    strict: bool = False  # a failed SHOULD fails the run
    known_failing: frozenset[str] = frozenset()  # globs; such a case must fail, and may
    known_flaky: frozenset[str] = frozenset()  # globs; such a case may fail
    timeout_scale: float = 1.0  # multiplies every case's timeout
    #: after a failed case, ask the testee whether it still serves, and block the cases left
    #: when it does not; off where every case must run whatever the ones before it did
    probe: bool = True
    #: a shell command that restarts a testee that stopped serving, so that the cases left run
    restart_command: str | None = None
    restart_timeout: float = 600.0  # for the command and the testee's return together


@dataclasses.dataclass
class Result:
    case: Case
    verdict: Verdict
    duration_s: float
    detail: str
    log: WireLog
    known_failing: bool = False
    known_flaky: bool = False

    @property
    def unexpected(self) -> bool:
        """A failure nobody expected, a known-failing case that no longer fails, or a case the
        run could not check because the testee stopped serving."""
        if self.verdict is Verdict.BLOCKED:
            return True
        if self.known_failing:
            return self.verdict is not Verdict.FAIL
        return self.verdict is Verdict.FAIL and not self.known_flaky


def read_list(path: str | Path) -> frozenset[str]:
    """Case ids or globs, one a line; ``#`` starts a comment (the reason)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return frozenset(
        line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()
    )


def matches(case_id: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(case_id, p) for p in patterns)


def select(cases: Sequence[Case], globs: Sequence[str] | None) -> list[Case]:
    """The cases whose id matches one of ``globs`` (every case when there is none)."""
    if not globs:
        return list(cases)
    patterns = [p.strip() for g in globs for p in g.split(",") if p.strip()]
    return [c for c in cases if matches(c.id, patterns)]


def _failed_verdict(level: Level, strict: bool) -> Verdict:
    if level is Level.MUST:
        return Verdict.FAIL
    if level is Level.SHOULD:
        return Verdict.FAIL if strict else Verdict.NON_STRICT
    return Verdict.INFORMATIONAL


#: Verdicts of a failed case: after one, a run asks whether the testee still serves.
_FAILED: Final = frozenset({Verdict.FAIL, Verdict.NON_STRICT, Verdict.INFORMATIONAL})
#: A case that failed while the harness's own loop stalled this long, in seconds, runs once
#: more: every time the case read was late by the stall (a virtual machine whose CPUs were
#: stopped, for tens of seconds at times, or a process not scheduled), its timers expired in it.
STALL_S: Final = 2.0
#: How often the loop is asked to wake to see such a stall.
STALL_TICK_S: Final = 0.1


async def run_case(case: Case, ctx_for: Callable[[WireLog], Any], options: RunOptions) -> Result:
    """``case``'s result; a second run's when it failed while the loop stalled ``STALL_S`` (a
    case that may break its testee excepted), its detail saying so and what the first said."""
    lag = LoopLag(STALL_TICK_S)
    lag.start()
    try:
        first = await _run_once(case, ctx_for, options)
    finally:
        await lag.stop()
    stalled = lag.longest()
    if first.verdict not in _FAILED or stalled < STALL_S or case.breaks_testee:
        return first
    again = await _run_once(case, ctx_for, options)
    again.duration_s = round(first.duration_s + again.duration_s, 3)
    note = f"run a second time: the harness's loop stalled {stalled:.1f}s in the first run, "
    again.detail = "\n".join(filter(None, (f"{note}which failed: {first.detail}", again.detail)))
    return again


async def _run_once(case: Case, ctx_for: Callable[[WireLog], Any], options: RunOptions) -> Result:
    log = WireLog()
    start = time.monotonic()
    timeout = case.timeout * options.timeout_scale
    ctx = ctx_for(log)
    try:
        await asyncio.wait_for(case.func(ctx), timeout)
        verdict, detail = Verdict.PASS, ""
    except CaseFailed as exc:
        verdict, detail = _failed_verdict(case.level, options.strict), exc.detail
    except TimeoutError:
        log.note(f"the case timed out after {timeout:.1f}s")
        verdict = _failed_verdict(case.level, options.strict)
        detail = f"timed out after {timeout:.1f}s (the testee did not answer in time)"
    except Unsupported as exc:
        verdict, detail = Verdict.UNSUPPORTED, str(exc)
    except Skip as exc:
        verdict, detail = Verdict.SKIPPED, str(exc)
    except Exception as exc:  # the testee broke the exchange in a way no check foresaw
        log.note("exception", traceback.format_exc())
        verdict = _failed_verdict(case.level, options.strict)
        detail = f"{type(exc).__name__}: {exc}"
    close = getattr(ctx, "close", None)
    if close is not None:  # what the case started (fake peers, servers) stops with it
        await close()
    return Result(
        case,
        verdict,
        round(time.monotonic() - start, 3),
        detail,
        log,
        known_failing=matches(case.id, options.known_failing),
        known_flaky=matches(case.id, options.known_flaky),
    )


class Progress:
    """One line per case on a stream, like h2spec: counter, verdict, id, title, time."""

    def __init__(self, total: int, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.quiet = quiet

    def __call__(self, result: Result) -> None:
        self.done += 1
        if self.quiet:
            return
        mark = result.verdict.value
        if result.known_failing:
            mark += (
                " (known failing)" if result.verdict is Verdict.FAIL else " (KNOWN FAILING PASSED)"
            )
        width = len(str(self.total))
        line = (
            f"[{self.done:>{width}}/{self.total}] {mark:<14} {result.case.id:<20} "
            f"{result.case.title} ({result.duration_s:.2f}s)"
        )
        if result.detail and result.verdict not in (Verdict.PASS,):
            line += f"\n{'':>{2 * width + 4}}{result.detail}"
        print(line, file=self.stream, flush=True)


def in_run_order(cases: Iterable[Case]) -> list[Case]:
    """``cases`` in their order, but those that may break a testee last."""
    return sorted(cases, key=lambda c: c.breaks_testee)


def blocked(case: Case, why: str) -> Result:
    """``case``, not run: ``why`` (the testee stopped serving after an earlier case, or the run
    could not start)."""
    return Result(case, Verdict.BLOCKED, 0.0, f"not run: {why}", WireLog())


async def stopped_after(result: Result, serving: Probe, restart: Probe | None) -> str | None:
    """Why the cases after ``result``'s cannot run: the testee stopped serving after it. None
    when the case did not fail, or the testee still serves, or ``restart`` (when given) brought
    it back, which the result's detail then says."""
    if result.verdict not in _FAILED:
        return None
    why = await serving()
    if why is not None and restart is not None:
        failed = await restart()
        if failed is None:
            note = f"the testee stopped serving after this case ({why}), and was restarted"
            result.detail += f"\n{note}"
            return None
        why = f"{why}; restarting it failed: {failed}"
    return None if why is None else f"the testee stopped serving after {result.case.id}: {why}"


async def run_cases(
    cases: Sequence[Case],
    ctx_for: Callable[[WireLog], Any],
    options: RunOptions,
    on_result: Callable[[Result], None] | None = None,
    serving: Probe | None = None,
    restart: Probe | None = None,
) -> list[Result]:
    """Run ``cases`` one by one. After a case that failed, ``serving`` asks the testee whether
    it still serves; when it does not, ``restart`` (when given) brings it back, else the cases
    left are ``blocked`` at once instead of each waiting out its timeout."""
    results: list[Result] = []
    for i, case in enumerate(cases):
        result = await run_case(case, ctx_for, options)
        results.append(result)
        why = None
        if serving is not None and i < len(cases) - 1:
            why = await stopped_after(result, serving, restart)
        if on_result is not None:
            on_result(result)
        if why is not None:
            for rest in cases[i + 1 :]:
                results.append(blocked(rest, why))
                if on_result is not None:
                    on_result(results[-1])
            break
    return results


class SuiteEnv(Protocol):
    """What a suite's world does around its cases: open before them, close after them. A world
    that can tell whether its testee still serves has ``serving`` too (a ``Probe``)."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...


def probes(env: SuiteEnv, options: RunOptions) -> tuple[Probe | None, Probe | None]:
    """What asks ``env``'s testee whether it still serves (None when it cannot tell, or the run
    does not probe) and, given a restart command, what restarts it."""
    probe: Probe | None = getattr(env, "serving", None) if options.probe else None
    if probe is None or not options.restart_command:
        return probe, None
    return probe, functools.partial(
        restart_testee,
        options.restart_command,
        options.restart_timeout,
        probe,
        getattr(env, "refresh", None),
    )


async def run_suite(
    env: SuiteEnv,
    suite: Suite,
    ctx_for: Callable[[WireLog], Any],
    cases: Sequence[Case],
    options: RunOptions,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Open ``env``, run the cases of ``suite`` in it, close it."""
    try:
        await env.open()
        chosen = in_run_order(c for c in cases if c.suite is suite)
        probe, restart = probes(env, options)
        return await run_cases(chosen, ctx_for, options, on_result, probe, restart)
    finally:
        await env.close()


def summary(results: Iterable[Result]) -> dict[str, int]:
    counts = {v.value: 0 for v in Verdict}
    for r in results:
        counts[r.verdict.value] += 1
    return counts


def exit_code(results: Iterable[Result]) -> int:
    """0 only when nothing unexpected failed."""
    return 1 if any(r.unexpected for r in results) else 0
