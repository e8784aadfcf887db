"""What the producer and consumer sessions share: one ``handle`` entry that dispatches an input
to its handler, fires due timers and returns the outputs gathered meanwhile; a timer heap whose
stale entries are skipped lazily; and one counter for the ids a session mints."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Generic, TypeVar

from . import error_strings
from .versions import LEGACY, Profile, check_profile

In = TypeVar("In")
Out = TypeVar("Out")

Timer = tuple[float, int, str, Any]  # (when, sequence, kind, what)


def check_lease(duration: float | None) -> float | None:
    """A ``kv_lease_duration`` (§6.4): None (no lease) or positive; ``ValueError`` with vLLM
    0.34's message otherwise."""
    if duration is not None and not duration > 0:
        raise ValueError(error_strings.LEASE_NOT_POSITIVE.format(duration=float(duration)))
    return duration


def check_keyed(profile: Profile, auth_key: bytes | None) -> None:
    """A side with a key speaks pdwire/2 only (8.6-R14): ``ValueError`` for a key with the
    legacy profile, which carries no tag."""
    if auth_key is not None and check_profile(profile) == LEGACY:
        raise ValueError(
            "an auth key needs the pdwire/2 profile: the legacy profile carries no auth_tag "
            "(spec 8.6-R14)"
        )


class Session(Generic[In, Out]):
    """Subclasses implement ``_dispatch`` (each input to its handler), ``_timer_live`` and
    ``_fire``."""

    def __init__(self) -> None:
        self._timers: list[Timer] = []
        self._ids = itertools.count(1)
        self._out: list[Out] = []
        self._now = 0.0

    def handle(self, event: In, now: float) -> list[Out]:
        """Apply ``event`` at time ``now``; return what to do, in order."""
        self._now = now
        self._dispatch(event, now)
        while self._timers and self._timers[0][0] <= now:
            entry = heapq.heappop(self._timers)
            if self._timer_live(entry):
                self._fire(entry, now)
        self._after_timers(now)
        out, self._out = self._out, []
        return out

    def _dispatch(self, event: In, now: float) -> None:
        raise NotImplementedError

    def next_deadline(self) -> float | None:
        """When ``handle(TimePassed(), now)`` next has something to do, if ever."""
        while self._timers and not self._timer_live(self._timers[0]):
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def _push(self, when: float, kind: str, what: Any) -> None:
        heapq.heappush(self._timers, (when, next(self._ids), kind, what))

    def _timer_live(self, entry: Timer) -> bool:
        """False for an entry made stale since it was pushed (the state it timed moved on)."""
        raise NotImplementedError

    def _fire(self, entry: Timer, now: float) -> None:
        raise NotImplementedError

    def _on_time(self, event: Any, now: float) -> None:
        pass  # the timers fire after every input

    def _after_timers(self, now: float) -> None:
        """Called once the due timers have fired: for work they gathered to do together."""
