"""Running a suite against a testee: open the suite's world, run its cases, close it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..case import Case, Suite
from ..runner import Result, RunOptions, run_suite
from .producer_env import ProducerCtx, ProducerEnv, ProducerOptions


async def run_producer(
    options: ProducerOptions,
    cases: Sequence[Case],
    run_options: RunOptions,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    env = ProducerEnv(options)
    return await run_suite(
        env, Suite.PRODUCER, lambda log: ProducerCtx(env, log), cases, run_options, on_result
    )
