"""A node worker's process: its ``KVPool`` and agent, serving the front's commands over the
pipe ``node_worker`` describes."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, Final

import torch

from pdwire.events import LoadRequest, RequestQueued

from .cli_common import print_stacks_on_signal
from .kv_content import BlockTable
from .kv_pool import KVPool
from .kv_values import ContextDigest
from .worker_agents import Agent, WorkerContext, load_factory
from .worker_spec import POLL_S, WorkerSpec

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h), and what the worker sets them to.
M_TRIM_THRESHOLD: Final = -1
M_MMAP_THRESHOLD: Final = -3
MMAP_THRESHOLD: Final = 32 << 20  # glibc's largest on 64-bit hosts
TRIM_THRESHOLD: Final = 1 << 30


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
            ready = wait(watched, timeout=POLL_S)
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

    def _lists(self, table: BlockTable) -> list[list[int]]:
        return table.lists(self._pool().mamba_groups)

    def _agent(self) -> Agent:
        assert self.agent is not None
        return self.agent

    def op_prefill(
        self, req: str, ids: list[int], table: BlockTable, transfer_id: str | None, keep: bool
    ) -> bytes:
        """Compute the prompt's KV slice into the table's blocks (announcing the transfer first
        when ``transfer_id``); return the slice's row digests, kept for decoding when ``keep``."""
        pool = self._pool()
        if transfer_id is not None:
            self._agent().transfer_started(transfer_id, req)
        pool.write_prompt(ids, table)
        digest = pool.new_digest()
        pool.digest(digest, table, 0, len(ids))
        if keep:
            self._digests[req] = digest
        return digest.digests()

    def op_finish(self, req: str, transfer_id: str, table: BlockTable, send: bool) -> None:
        if send:
            self._agent().transfer_finished(transfer_id, req, self._lists(table))
        else:
            self._agent().transfer_will_not_send(transfer_id, req, "stop token")

    def op_load(
        self,
        req: str,
        transfer_id: str,
        engine_id: str,
        bootstrap_addr: str,
        table: BlockTable,
        deadline_ms: int = 0,
    ) -> None:
        self._pool().zero(table)  # stale bytes must not pass verification
        lists = self._lists(table)
        load = LoadRequest(req, transfer_id, engine_id, bootstrap_addr, lists, deadline_ms)
        self._agent().load([load])

    def op_queue(self, req: str, transfer_id: str, engine_id: str, bootstrap_addr: str) -> None:
        queue = getattr(self._agent(), "queue", None)
        if queue is not None:  # an agent without a lease renews nothing
            queue(RequestQueued(req, transfer_id, engine_id, bootstrap_addr))

    def op_abort(self, req: str) -> None:
        if self.agent is not None:
            self.agent.abort(req)

    def op_verify(self, req: str, ids: list[int], table: BlockTable) -> tuple[bool, int, bytes]:
        """Compare the loaded blocks with the prompt's KV slice; digest what they hold."""
        pool = self._pool()
        ok, nbytes = pool.verify(ids, table)
        digest = pool.new_digest()
        pool.digest(digest, table, 0, len(ids))
        self._digests[req] = digest
        return ok, nbytes, digest.digests()

    def op_append(self, req: str, token: int, position: int, table: BlockTable) -> bytes:
        """Add a decoded token's KV at ``position``; return the updated row digests."""
        pool = self._pool()
        with one_torch_thread():
            pool.append(token, position, table)
            digest = self._digests[req]
            pool.digest(digest, table, position, position + 1)
            return digest.digests()

    def op_free(self, req: str) -> None:
        self._digests.pop(req, None)

    def op_sleep(self, awake: bool) -> bool:
        """Unregister the agent's KV memory, or (``awake``) register it again; False when the
        agent has no sleep mode."""
        step = getattr(self._agent(), "wake_up" if awake else "sleep", None)
        if step is None:
            return False
        step()
        return True

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


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch's ops on this thread alone meanwhile. A token's KV and its digest are tens of
    thousands of elements, which torch splits over its threads, and the hand-offs cost more
    than the work: a token of the seeds' geometry took 719 us of CPU this way against 1 665 us
    on two threads, and 719 against 848 us of time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def keep_freed_memory() -> bool:
    """Have the C library keep freed blocks below 32 MB for reuse, not hand them back to the
    kernel. Computing and checking KV allocates and frees tensors of a few MB per block; handed
    back, the next one faults its pages in afresh: some 15 000 faults for each 1000-token prompt
    of the seeds' geometry filled and checked, and a third more time than with the memory kept.
    False where the C library has no ``mallopt`` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process: start, announce, serve the front's commands, close."""
    # A terminal's Ctrl-C reaches the whole process group; the front stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker's front had its own
    print_stacks_on_signal()  # a spawned worker has not inherited it
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s [{spec.name}] %(name)s: %(message)s",
    )
    keep_freed_memory()
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
    # What is left is the transfer engine's teardown and the interpreter's, about a second, and
    # they free only what exiting frees: the worker leaves at once, its logs written out.
    logging.shutdown()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)
