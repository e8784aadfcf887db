"""A node's worker processes, one per (tp_rank, pp_rank), and the front's handles on them.

Each worker (started with multiprocessing spawn) holds its ``KVPool`` and its agent
(``worker_agents``: by default a ``ProducerAgent`` on a prefill node, a ``ConsumerAgent`` on a
decode node, over the worker's transfer engine). The front
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
import dataclasses
import hashlib
import itertools
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from pdwire.events import LoadRequest
from pdwire.messages import Fingerprint
from pdwire.versions import PDWIRE_2, Profile

from .kv_content import ContextDigest, KVShape
from .kv_pool import KVPool
from .worker_agents import Agent, WorkerContext, load_factory

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
#: ``on_event(worker_index, name, args)``, on the handle's reader thread.
OnEvent = Callable[[int, str, tuple[Any, ...]], None]
_POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs (picklable)."""

    role: Role
    shape: KVShape
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    engine_id: str
    bootstrap_url: str
    host: str = "127.0.0.1"
    register_timeout: float = 30.0  # each HTTP phase of a registration attempt (4.4-R1)
    profile: Profile = PDWIRE_2
    model: str = "pdwire-synthetic"
    start_timeout: float = 120.0
    log_level: int = logging.INFO
    agent: str = ""  # MODULE:CALLABLE of the agent factory; "" = pdwire's own (worker_agents)
    abort_timeout: float = 480.0  # VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (§6)
    receive_timeout: float | None = None  # D, per pull; None = abort_timeout + 60 (3.1-R8)
    mutant: str = ""  # a deliberate defect, for testing the conformance harness (mutants)
    auth_key: bytes | None = None  # the shared key of §8.6

    @property
    def name(self) -> str:
        return f"{self.role}-tp{self.tp_rank}-pp{self.pp_rank}"

    def fingerprint(self) -> Fingerprint | None:
        if self.profile != PDWIRE_2:
            return None
        s = self.shape
        return Fingerprint(
            model=self.model,
            dtype=s.dtype,
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_dim,
            block_size=s.block_size,
            kv_layout="LBHNC",
        )

    def layout_id(self) -> int:
        """A nonzero id of this D worker's layout, stable for its life (§3.7)."""
        key = hashlib.blake2b(f"{self.engine_id}/{self.tp_rank}/{self.pp_rank}".encode())
        return int.from_bytes(key.digest()[:7], "little") | 1


# -- the worker process ----------------------------------------------------------------------


class _Worker:
    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        self.spec = spec
        self._conn = conn
        self._send_lock = threading.Lock()
        self._digests: dict[str, ContextDigest] = {}
        self.pool: KVPool | None = None
        self.agent: Agent | None = None

    def emit(self, *message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)

    def start(self) -> dict[str, Any]:
        s = self.spec
        factory = load_factory(s.agent)
        self.pool = KVPool(s.shape, s.tp_size, s.tp_rank, s.pp_size, s.pp_rank)
        self.agent = factory(WorkerContext(s, self.pool, self.emit))
        return self.op_stats()

    def serve(self) -> None:
        parent = multiprocessing.parent_process()
        watched: list[Any] = [self._conn] + ([parent.sentinel] if parent is not None else [])
        while True:
            ready = wait(watched, timeout=_POLL_S)
            if parent is not None and parent.sentinel in ready:
                logger.warning("worker %s: the front process exited", self.spec.name)
                return
            if not ready:
                continue
            try:
                call_id, op, args = self._conn.recv()
            except (EOFError, OSError):
                logger.warning("worker %s: the front closed the pipe", self.spec.name)
                return
            if op == "stop":
                self.emit("reply", call_id, True, None)
                return
            try:
                result = getattr(self, f"op_{op}")(*args)
            except Exception as exc:
                logger.exception("worker %s: %s failed", self.spec.name, op)
                self.emit("reply", call_id, False, f"{type(exc).__name__}: {exc}")
            else:
                self.emit("reply", call_id, True, result)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.stop()

    # -- ops ---------------------------------------------------------------------------------

    def _pool(self) -> KVPool:
        assert self.pool is not None
        return self.pool

    def _agent(self) -> Agent:
        assert self.agent is not None
        return self.agent

    def op_prefill(
        self, req: str, ids: list[int], blocks: list[int], transfer_id: str | None, keep: bool
    ) -> bytes:
        """Compute the prompt's KV slice into ``blocks`` (announcing the transfer first when
        ``transfer_id``); return the slice's row digests, kept for decoding when ``keep``."""
        pool = self._pool()
        if transfer_id is not None:
            self._agent().transfer_started(transfer_id, req)
        pool.write_prompt(ids, blocks)
        digest = pool.new_digest()
        digest.update(pool.words, blocks, 0, len(ids))
        if keep:
            self._digests[req] = digest
        return digest.digests()

    def op_finish(self, req: str, transfer_id: str, blocks: list[int], send: bool) -> None:
        if send:
            self._agent().transfer_finished(transfer_id, req, [blocks])
        else:
            self._agent().transfer_will_not_send(transfer_id, req, "stop token")

    def op_load(
        self,
        req: str,
        transfer_id: str,
        engine_id: str,
        bootstrap_addr: str,
        blocks: list[int],
        deadline_ms: int = 0,
    ) -> None:
        self._pool().zero(blocks)  # stale bytes must not pass verification
        load = LoadRequest(req, transfer_id, engine_id, bootstrap_addr, [blocks], deadline_ms)
        self._agent().load([load])

    def op_abort(self, req: str) -> None:
        if self.agent is not None:
            self.agent.abort(req)

    def op_verify(self, req: str, ids: list[int], blocks: list[int]) -> tuple[bool, int, bytes]:
        """Compare the loaded blocks with the prompt's KV slice; digest what they hold."""
        pool = self._pool()
        ok, nbytes = pool.verify(ids, blocks)
        digest = pool.new_digest()
        digest.update(pool.words, blocks, 0, len(ids))
        self._digests[req] = digest
        return ok, nbytes, digest.digests()

    def op_append(self, req: str, token: int, position: int, blocks: list[int]) -> bytes:
        """Add a decoded token's KV at ``position``; return the updated row digests."""
        pool = self._pool()
        pool.append(token, position, blocks)
        digest = self._digests[req]
        digest.update(pool.words, blocks, position, position + 1)
        return digest.digests()

    def op_free(self, req: str) -> None:
        self._digests.pop(req, None)

    def op_mutant(self, name: str) -> None:
        from . import mutants

        mutants.apply(name)

    def op_stats(self) -> dict[str, Any]:
        s = self.spec
        stats: dict[str, Any] = {
            "name": s.name,
            "pid": os.getpid(),
            "tp_rank": s.tp_rank,
            "pp_rank": s.pp_rank,
            "session": "",
            "pool_bytes": self.pool.nbytes if self.pool is not None else 0,
            "requests": len(self._digests),
            "descriptors": 0,
            "bytes_written": 0,
        }
        if self.agent is not None:
            stats.update(self.agent.stats())
        return stats


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process: start, announce, serve the front's commands, close."""
    # A terminal's Ctrl-C reaches the whole process group; the front stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s [{spec.name}] %(name)s: %(message)s",
    )
    if spec.mutant:
        from . import mutants

        mutants.apply(spec.mutant)
    worker = _Worker(spec, conn)
    try:
        try:
            info = worker.start()
        except Exception as exc:
            logger.exception("worker %s failed to start", spec.name)
            worker.emit("failed", f"{type(exc).__name__}: {exc}")
            return
        worker.emit("ready", info)
        worker.serve()
    except (BrokenPipeError, EOFError, OSError) as exc:
        logger.warning("worker %s: pipe to the front lost: %s", spec.name, exc)
    finally:
        worker.close()
        conn.close()


# -- the front's handle ----------------------------------------------------------------------


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
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=worker_main, args=(self.spec, child), name=f"pdwire-{self.spec.name}"
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
                if not self._conn.poll(_POLL_S):
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
