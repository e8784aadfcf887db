"""How late the harness's own event loop ran, so that a case timing a peer can tell the peer's
lateness from its own. A time the harness reads when it handles an event is late by as long as
the loop could not run before it: busy with another case's work, or the process not scheduled on
a loaded machine. A ticker that asks to wake every ``TICK_S`` sees each such stall as an
overshoot, ending when the loop runs again, which is when the delayed event is handled too."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Final

TICK_S: Final = 0.01
#: An overshoot below this is the loop's ordinary jitter, not a stall worth keeping.
NOISE_S: Final = 0.005
#: How long after a stall the events it delayed may still be being handled.
AFTER_S: Final = 0.1


class LoopLag:
    """Records the stalls of the running loop between ``start`` and ``stop``."""

    def __init__(self, tick: float = TICK_S) -> None:
        self.tick = tick  # how often the ticker asks to wake
        self._stalls: list[tuple[float, float]] = []  # (when the loop ran again, how long not)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _tick(self) -> None:
        while True:
            asked = time.monotonic() + self.tick
            await asyncio.sleep(self.tick)
            woke = time.monotonic()
            if woke - asked > NOISE_S:
                self._stalls.append((woke, woke - asked))

    def late_by(self, when: float) -> float:
        """The most a time read at ``when`` (``time.monotonic()``) can be late: the longest stall
        that ended shortly before it, and a tick; 0.0 when the loop ran on time."""
        stalls = [s for end, s in self._stalls if end - self.tick <= when <= end + AFTER_S]
        return max(stalls) + self.tick if stalls else 0.0

    def longest(self) -> float:
        """The longest stall seen, in seconds; 0.0 when the loop ran on time."""
        return max((s for _, s in self._stalls), default=0.0)
