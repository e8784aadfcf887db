"""An asyncio event loop on its own daemon thread, and the one re-armed timer each agent keeps
for its session's ``next_deadline()``.

The agents feed their sans-IO sessions only from this loop's thread, so a session is never
touched by two threads; other threads reach the loop through ``call`` and ``submit``. The
sessions' clock is ``loop.time()`` (monotonic).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """``start()`` runs a new event loop on a daemon thread until ``stop()``."""

    def __init__(self, name: str = "pdwire-loop") -> None:
        self._name = name
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._running = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def time(self) -> float:
        """The loop's monotonic clock: the sessions' ``now``."""
        return self._loop.time()

    def start(self, timeout: float = 10.0) -> None:
        """Start the thread and wait until its loop runs."""
        if self._thread is not None:
            raise RuntimeError(f"loop thread {self._name} already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        if not self._running.wait(timeout):
            raise TimeoutError(f"loop thread {self._name} did not start within {timeout}s")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._running.set)
        try:
            self._loop.run_forever()
        finally:
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread soon; callable from any thread. Calls made from
        one thread run in the order they were made. Exceptions are logged by the loop. Once the
        loop is closed the call is dropped, with a warning."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the agent was stopped
            logger.warning("loop thread %s is closed: dropped a call to %r", self._name, fn)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; callable from any thread except the loop's own."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every task, stop the loop and join the thread (at most ``timeout`` for each
        step). Idempotent; must not be called from the loop thread."""
        if self._thread is None:
            if not self._loop.is_closed():
                self._loop.close()
            return
        if not self._thread.is_alive():
            return
        if self.in_loop_thread():
            raise RuntimeError("LoopThread.stop() called from its own loop thread")
        try:
            self.submit(_cancel_all_tasks()).result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            logger.warning("loop thread %s: tasks did not finish cancelling in time", self._name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("loop thread %s still running after %ss", self._name, timeout)


async def _cancel_all_tasks() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for task, result in zip(tasks, results, strict=True):
        if isinstance(result, Exception):
            logger.warning("task %s ended with %r while stopping", task.get_name(), result)


def on_loop(thread: LoopThread, coro: Coroutine[Any, Any, T], otherwise: Callable[[], T]) -> T:
    """``coro``'s result, run on ``thread``'s loop (so it reads what only that thread touches),
    or ``otherwise()`` when the loop no longer runs or does not answer within 5 s."""
    if not thread.alive:
        coro.close()
        return otherwise()
    try:
        return thread.submit(coro).result(timeout=5.0)
    except (RuntimeError, concurrent.futures.TimeoutError):
        return otherwise()


class DeadlineTimer:
    """One loop timer for a session's ``next_deadline()``: ``arm`` after every ``handle`` moves
    it, keeps it, or cancels it; when it fires, ``fire()`` runs on the loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[], None]) -> None:
        self._loop = loop
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, deadline: float | None) -> None:
        if self._handle is not None:
            if deadline is not None and self._handle.when() == deadline:
                return
            self._handle.cancel()
            self._handle = None
        if deadline is not None:
            self._handle = self._loop.call_at(deadline, self._on_due)

    def cancel(self) -> None:
        self.arm(None)

    def _on_due(self) -> None:
        self._handle = None
        self._fire()


def run_callback(name: str, fn: Callable[..., object], *args: Any) -> None:
    """Call an engine callback on the loop thread; an exception is logged, never propagated,
    so that a faulty callback cannot stop the agent."""
    try:
        fn(*args)
    except Exception:
        logger.exception("%s callback raised", name)
