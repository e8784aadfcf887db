"""A node's worker processes, one per (tp_rank, pp_rank): the front's handles on them (what each
is started with is ``worker_spec``; the process itself is ``worker_process``, which loads torch;
the front does not, unless it was forked from a process that had: ``--worker-start fork``).

Each worker (spawned, or, on a node of several workers, forked from the front's multiprocessing
forkserver, which loads the workers' modules once, torch above all; or forked from the front
itself with ``--worker-start fork``) holds its ``KVPool`` and its
agent (``worker_agents``: by default a ``ProducerAgent`` on a prefill node, a ``ConsumerAgent``
on a decode node, over the worker's transfer engine). The front
talks to it over one duplex Pipe:

- front -> worker: ``(call_id, op, args)``; the worker runs ``op_<op>(*args)`` in order and
  answers ``("reply", call_id, ok, result or error text)``;
- worker -> front, unasked: ``("ready", info)`` or ``("failed", why)`` once at start, then the
  agent's callbacks as ``("event", name, *args)``: free, reject (P); loaded, failed, released (D).

A worker exits when told to stop, when its pipe closes or when the front process dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .worker_spec import POLL_S, WorkerSpec

logger = logging.getLogger(__name__)

#: ``on_event(worker_index, name, args)``, on the handle's reader thread.
OnEvent = Callable[[int, str, tuple[Any, ...]], None]


# -- the front's handle ----------------------------------------------------------------------


#: What the forkserver loads before it forks the first worker: the worker process's modules
#: (torch, the KV pool, the agents). A forked worker has the environment the forkserver started
#: with: the front's when it started its first worker of several.
PRELOAD = ("reference_connector.worker_process", "reference_connector.worker_agents")


def _context(
    spec: WorkerSpec,
) -> (
    multiprocessing.context.SpawnContext
    | multiprocessing.context.ForkServerContext
    | multiprocessing.context.ForkContext
):
    """``spec.start``: fork from the front; or spawn for a node of one worker (a forkserver
    would load the same modules, then fork), the forkserver, loading PRELOAD once, for a node
    of several."""
    if spec.start == "fork":
        return multiprocessing.get_context("fork")
    if spec.tp_size * spec.pp_size == 1:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _run_worker(spec: WorkerSpec, conn: Connection) -> None:
    from .worker_process import worker_main

    worker_main(spec, conn)


class WorkerError(RuntimeError):
    """A worker failed to start, failed a command, or exited."""


def _settle(future: concurrent.futures.Future[Any], ok: bool, value: Any) -> None:
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value if isinstance(value, BaseException) else WorkerError(value))
    except concurrent.futures.InvalidStateError:
        pass  # the caller gave up on it (timeout)


class WorkerHandle:
    """The front's end of one worker process."""

    def __init__(self, spec: WorkerSpec, index: int, on_event: OnEvent) -> None:
        self.spec = spec
        self.index = index
        self._on_event = on_event
        self._ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._dead = False
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        ctx = _context(self.spec)
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_run_worker, args=(self.spec, child), name=f"pdwire-{self.spec.name}"
        )
        self._proc.daemon = True
        self._proc.start()
        child.close()
        self._reader = threading.Thread(
            target=self._read, name=f"pdwire-front-{self.spec.name}", daemon=True
        )
        self._reader.start()

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        try:
            return self._ready.result(timeout)
        except concurrent.futures.TimeoutError:
            raise WorkerError(f"worker {self.spec.name} did not start within {timeout}s") from None

    @property
    def alive(self) -> bool:
        ready = self._ready.done() and self._ready.exception() is None
        return ready and not self._dead and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def call(self, op: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._dead or self._conn is None:
                future.set_exception(WorkerError(f"worker {self.spec.name} is not running"))
                return future
            call_id = next(self._ids)
            self._pending[call_id] = future
            try:
                self._conn.send((call_id, op, args))
            except (OSError, ValueError) as exc:
                del self._pending[call_id]
                future.set_exception(WorkerError(f"worker {self.spec.name}: {exc}"))
        return future

    async def acall(self, op: str, *args: Any, timeout: float) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.call(op, *args)), timeout)
        except TimeoutError:
            raise WorkerError(f"worker {self.spec.name}: {op} took over {timeout}s") from None

    def _read(self) -> None:
        assert self._conn is not None and self._proc is not None
        try:
            while True:
                if not self._conn.poll(POLL_S):
                    if not self._proc.is_alive() and not self._conn.poll(0):
                        break
                    continue
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            pass
        finally:
            self._died()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "reply":
            _, call_id, ok, value = message
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is not None:
                _settle(future, ok, value)
        elif kind == "event":
            try:
                self._on_event(self.index, message[1], message[2:])
            except Exception:
                logger.exception("worker %s: event %s not handled", self.spec.name, message[1])
        elif kind == "ready":
            _settle(self._ready, True, message[1])
        elif kind == "failed":
            _settle(self._ready, False, f"worker {self.spec.name} failed to start: {message[1]}")

    def _died(self) -> None:
        with self._lock:
            self._dead = True
            pending, self._pending = self._pending, {}
        code = self._proc.exitcode if self._proc is not None else None
        error = WorkerError(f"worker {self.spec.name} exited (exit code {code})")
        for future in [self._ready, *pending.values()]:
            _settle(future, False, error)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to stop, then wait; terminate it if it does not exit in time."""
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive() and not self._dead:
            try:
                self.call("stop").result(timeout)
            except Exception as exc:
                logger.warning("worker %s did not confirm stop: %s", self.spec.name, exc)
        proc.join(timeout)
        if proc.is_alive():
            logger.warning(
                "worker %s still running after %ss: terminating", self.spec.name, timeout
            )
            proc.terminate()
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if self._reader is not None:
            self._reader.join(timeout)
        if self._conn is not None:
            self._conn.close()
