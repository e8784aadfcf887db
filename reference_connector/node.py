"""The model-free engine node: vLLM's OpenAI HTTP surface and MooncakeConnector's handling of
``kv_transfer_params`` (spec §5), over worker processes that hold real KV pools and agents.

The front process (this module; its HTTP routes are ``node_api``) tokenizes, allocates block
ids, drives the workers and decodes with the tokens the workers' KV digests give
(``kv_content``):

- prefill node, ``{do_remote_decode: true, transfer_id}``: each worker announces the transfer,
  computes its KV slice into the blocks, then finishes it (or, when the one token generated is
  the stop token or one of the request's ``stop_token_ids``, says it will not send). The answer
  is that token with ``kv_transfer_params: null``; the blocks are freed when every worker's
  agent frees them.
- decode node, ``{do_remote_prefill: true, remote_bootstrap_addr, remote_engine_id,
  transfer_id}``: each worker loads its slice from P, then checks it byte for byte against the
  prompt's KV; then it decodes. A failed load follows the load-failure policy.
- no ``kv_transfer_params``: local prefill and decode, the reference text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, Literal

from pdwire.http_models import DEFAULT_BOOTSTRAP_PORT, url_of
from pdwire.roles import Role
from pdwire.versions import ALL_CAPS, PDWIRE_2, WIRE_VERSION, Profile

from .block_allocator import BlockAllocator, OutOfBlocks
from .bootstrap import BootstrapServer
from .dp_placement import DataParallel
from .kv_content import (
    EOS,
    BlockTable,
    KVShape,
    assemble,
    next_token,
    place,
)
from .node_worker import WorkerError, WorkerHandle
from .worker_spec import WorkerSpec, WorkerStart

logger = logging.getLogger(__name__)

Policy = Literal["fail", "recompute"]
_ALLOC_POLL_S: Final = 0.005
_SETTLE_S: Final = 10.0  # how long a failed load's blocks may take to be released
_DEADLINE_GRACE_S: Final = 1.0  # past a D leg's deadline_ms, before the front aborts itself


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    role: Role
    shape: KVShape = dataclasses.field(default_factory=KVShape)
    tp_size: int = 1
    pp_size: int = 1
    host: str = "127.0.0.1"
    bootstrap_url: str | None = None  # prefill: where workers register (None: serve one here)
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT  # ... on this port (0: any free one)
    bootstrap_host: str = "0.0.0.0"  # ... at this address (every address, 4.4-R14)
    register_timeout: float = 30.0  # each HTTP phase of a registration attempt (4.4-R1)
    engine_id: str = ""  # "" = a random one
    profile: Profile = PDWIRE_2
    load_failure_policy: Policy = "fail"
    model: str = "pdwire-synthetic"
    load_timeout: float = 120.0  # decode: the longest wait for P's KV
    call_timeout: float = 120.0  # any one command to a worker
    alloc_timeout: float = 30.0  # the longest wait for free blocks
    start_timeout: float = 120.0
    agent: str = ""  # the workers' agent factory, MODULE:CALLABLE; "" = pdwire's own
    worker_start: WorkerStart = "spawn"  # how the workers start (``node_worker``)
    abort_timeout: float = 480.0  # VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (§6)
    receive_timeout: float | None = None  # decode: per pull; None = abort_timeout + 60 (3.1-R8)
    kv_lease_duration: float | None = None  # vLLM 0.34's lease (§6.4); None = no lease
    verify_kv: bool = True  # decode: fail a load whose bytes are not the prompt's KV
    #: False: chat completions are refused, as vLLM refuses them for a model whose tokenizer has
    #: no chat template
    chat_template: bool = True
    auth_key: bytes | None = None  # §8.6: sign and check side-channel messages and registrations
    accepted_keys: tuple[bytes, ...] = ()  # older keys still accepted (8.6-R16)
    prefill_delay: float = 0.0  # prefill: seconds a remote prefill pretends to compute
    #: prefill: the engine's place in a data-parallel deployment, which decides, without
    #: bootstrap_url, whether it serves the bootstrap server and where its workers register
    dp: DataParallel = dataclasses.field(default_factory=DataParallel)


class NodeError(Exception):
    """A request the node answers with an HTTP error."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclasses.dataclass
class Job:
    req: str  # unique inside the node
    ids: list[int]
    max_tokens: int
    params: dict[str, Any] | None
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids: a generated one ends the request
    #: set when the client has gone away; the node stops waiting for blocks then (an abort
    #: after the blocks are allocated lets the request run to its end)
    aborted: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@dataclasses.dataclass
class Generation:
    """A request's outcome; ``tokens`` yields the decoded tokens (once)."""

    prompt_tokens: int
    tokens: AsyncIterator[int]
    finish: str = "length"
    stop_token: int | None = None  # the token that ended the request with "stop" (not yielded)
    stop_reason: int | None = None  # that token, when it was one of stop_token_ids
    kv_transfer_params: dict[str, Any] | None = None
    pdwire: dict[str, Any] = dataclasses.field(default_factory=dict)
    cleanup: Callable[[], None] = lambda: None


@dataclasses.dataclass
class _Send:
    """A P request whose blocks wait for every worker's agent to free them."""

    blocks: BlockTable
    pending: set[int]
    rejected: tuple[str, str] | None = None
    since: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _Load:
    """A D request's per-worker outcomes: ("loaded"[, first pull, loaded]) or ("failed", code,
    reason, free)."""

    outcome: list[asyncio.Future[tuple[Any, ...]]]
    released: list[asyncio.Future[None]]
    loop: asyncio.AbstractEventLoop
    parked: bool = False  # failed with writes maybe in flight: blocks freed on release


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 3)


def _set(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


class NodeEngine:
    """The front of a node: its workers, block allocator and request flow."""

    def __init__(self, config: NodeConfig) -> None:
        config.shape.check_split(config.tp_size, config.pp_size)
        self.config = config
        self.engine_id = config.engine_id or uuid.uuid4().hex
        reserved = 1 if config.shape.mamba else 0  # the null block (10.6.3)
        self.allocator = BlockAllocator(config.shape.num_blocks, reserved)
        self.bootstrap_url = config.bootstrap_url or ""
        self.workers: list[WorkerHandle] = []
        self._bootstrap: BootstrapServer | None = None
        self._lock = threading.Lock()
        self._sends: dict[str, _Send] = {}
        self._loads: dict[str, _Load] = {}
        self._ids = 0
        self.sleeping = False
        self.counts: dict[str, int] = dict.fromkeys(
            ("total", "active", "ok", "errors", "remote", "verified", "recomputed", "failed"), 0
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        c = self.config
        if c.role == "prefill" and not self.bootstrap_url:
            port = c.bootstrap_port
            if c.dp.serves_bootstrap:
                keys = (c.auth_key, *c.accepted_keys) if c.auth_key is not None else None
                server = BootstrapServer(auth_key=keys)
                self._bootstrap = server.start(c.bootstrap_host, port)
                port = self._bootstrap.port
            elif not port:
                raise ValueError("an engine that serves no bootstrap server needs its port")
            self.bootstrap_url = url_of(c.dp.register_host(c.bootstrap_host), port)
        level = logging.getLogger().getEffectiveLevel()
        for pp in range(c.pp_size):
            for tp in range(c.tp_size):
                spec = WorkerSpec(
                    role=c.role,
                    shape=c.shape,
                    tp_size=c.tp_size,
                    tp_rank=tp,
                    pp_size=c.pp_size,
                    pp_rank=pp,
                    engine_id=self.engine_id,
                    bootstrap_url=self.bootstrap_url,
                    dp_rank=c.dp.rank,
                    register_timeout=c.register_timeout,
                    host=c.host,
                    profile=c.profile,
                    model=c.model,
                    start_timeout=c.start_timeout,
                    log_level=level,
                    agent=c.agent,
                    start=c.worker_start,
                    abort_timeout=c.abort_timeout,
                    receive_timeout=c.receive_timeout,
                    lease=c.kv_lease_duration,
                    auth_key=c.auth_key,
                    accepted_keys=c.accepted_keys,
                )
                self.workers.append(WorkerHandle(spec, len(self.workers), self._on_event))
        try:
            for worker in self.workers:
                worker.start()
            deadline = time.monotonic() + c.start_timeout
            for worker in self.workers:
                worker.wait_ready(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        logger.info(
            "%s node %s: %d workers up (TP %d, PP %d)",
            c.role,
            self.engine_id,
            len(self.workers),
            c.tp_size,
            c.pp_size,
        )

    def stop(self) -> None:
        # A worker takes a second or two to exit (most of it the transfer engine's teardown):
        # the workers stop side by side.
        stopping = [
            threading.Thread(target=w.stop, name=f"pdwire-stop-{w.spec.name}", daemon=True)
            for w in self.workers
        ]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        if self._bootstrap is not None:
            self._bootstrap.stop()

    async def sleep(self, asleep: bool) -> None:
        """vLLM's sleep mode: every worker unregisters its KV memory (``asleep``), or registers
        it again. Only an idle node sleeps (``NodeError`` 409); an agent without sleep mode
        gives ``NodeError`` 501."""
        if asleep == self.sleeping:
            return
        if asleep and self.allocator.in_use:
            raise NodeError(
                409, "requests in flight: a node sleeps only when idle", "ConflictError"
            )
        if not all(await self._all("sleep", not asleep)):
            raise NodeError(
                501, "this node's worker agent has no sleep mode", "NotImplementedError"
            )
        self.sleeping = asleep

    def healthy(self) -> bool:
        up = bool(self.workers) and all(w.alive for w in self.workers)
        return up and (self._bootstrap is None or self._bootstrap.alive)

    async def stats(self) -> dict[str, Any]:
        c = self.config

        async def one(w: WorkerHandle) -> dict[str, Any]:
            try:
                result: dict[str, Any] = await w.acall("stats", timeout=5.0)
                return {**result, "alive": w.alive}
            except WorkerError as exc:
                return {"name": w.spec.name, "alive": False, "error": str(exc)}

        with self._lock:
            held = len(self._sends)
            oldest = min((s.since for s in self._sends.values()), default=None)
        fingerprint = self.workers[0].spec.fingerprint() if self.workers else None
        return {
            "role": c.role,
            "engine_id": self.engine_id,
            "profile": c.profile,
            "pdwire_version": WIRE_VERSION[c.profile],
            "pdwire_caps": sorted(ALL_CAPS) if c.profile == PDWIRE_2 else [],
            "fingerprint": dataclasses.asdict(fingerprint) if fingerprint else None,
            "kv_layout": c.shape.geometry().kv_layout,
            "bootstrap_url": self.bootstrap_url,
            "tp_size": c.tp_size,
            "pp_size": c.pp_size,
            "blocks_total": self.allocator.num_blocks,
            "blocks_in_use": self.allocator.in_use,
            "transfers_held": held,
            "oldest_held_s": 0.0 if oldest is None else round(time.monotonic() - oldest, 3),
            "requests": dict(self.counts),
            "workers": list(await asyncio.gather(*(one(w) for w in self.workers))),
        }

    # -- events from the workers (reader threads) --------------------------------------------

    def _on_event(self, index: int, name: str, args: tuple[Any, ...]) -> None:
        req = args[0]
        if name in ("free", "reject"):
            self._on_send_event(index, name, req, args)
            return
        with self._lock:
            load = self._loads.get(req)
        if load is None:
            logger.warning("event %s for unknown request %s", name, req)
            return
        if name == "loaded":  # args[1:3], if the agent gives them: its pulls' start and end
            load.loop.call_soon_threadsafe(_set, load.outcome[index], ("loaded", *args[1:3]))
        elif name == "failed":
            load.loop.call_soon_threadsafe(_set, load.outcome[index], ("failed", *args[1:]))
        elif name == "released":
            load.loop.call_soon_threadsafe(_set, load.released[index], None)

    def _on_send_event(self, index: int, name: str, req: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            send = self._sends.get(req)
            if send is None:
                logger.warning("event %s for unknown P request %s", name, req)
                return
            if name == "reject":
                send.rejected = (args[1], args[2])
                return
            send.pending.discard(index)
            if send.pending:
                return
            del self._sends[req]
        logger.debug("P request %s freed (%s)", req, args[1])
        self.allocator.free(send.blocks.all())

    # -- helpers -----------------------------------------------------------------------------

    def new_request_id(self, base: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{base}-{self._ids}"

    async def _all(self, op: str, *args: Any) -> list[Any]:
        timeout = self.config.call_timeout
        return list(
            await asyncio.gather(*(w.acall(op, *args, timeout=timeout) for w in self.workers))
        )

    def _table(self, parts: list[bytes]) -> Any:
        table = assemble(self.config.shape)
        for worker, part in zip(self.workers, parts, strict=True):
            s = worker.spec
            place(
                table,
                part,
                s.shape.layers(s.pp_size, s.pp_rank),
                s.shape.heads(s.tp_size, s.tp_rank),
            )
        return table

    async def _allocate(self, job: Job, tokens: int) -> BlockTable:
        """The blocks of ``job`` for ``tokens`` tokens, per KV-cache group."""
        sizes, firsts = self.config.shape.table_sizes(len(job.ids), tokens)
        n = sum(sizes)
        deadline = time.monotonic() + self.config.alloc_timeout
        while True:
            try:
                blocks = self.allocator.allocate(n)
            except OutOfBlocks as exc:
                raise NodeError(400, f"the request is too long for this node: {exc}") from None
            if blocks is not None:
                return BlockTable.split(blocks, sizes, firsts)
            if job.aborted.is_set():
                raise NodeError(499, "the client went away while the request waited for blocks")
            if time.monotonic() >= deadline:
                raise NodeError(
                    503,
                    f"no {n} free blocks within {self.config.alloc_timeout}s",
                    "ServiceUnavailableError",
                )
            await asyncio.sleep(_ALLOC_POLL_S)

    def _release(self, req: str, blocks: BlockTable, done: list[bool]) -> None:
        if done[0]:
            return
        done[0] = True
        self.allocator.free(blocks.all())
        for worker in self.workers:
            worker.call("free", req)

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, job: Job) -> Generation:
        """Run ``job`` as its kv_transfer_params say; the tokens come from ``tokens``."""
        if not job.ids:
            raise NodeError(400, "the prompt is empty")
        if job.max_tokens < 1:
            raise NodeError(400, f"max_tokens must be at least 1, got {job.max_tokens}")
        if self.sleeping:
            raise NodeError(
                503, "the node is sleeping: POST /wake_up first", "ServiceUnavailableError"
            )
        self.counts["total"] += 1
        p, role = job.params or {}, self.config.role
        if role == "prefill" and p.get("do_remote_decode"):
            if p.get("transfer_id"):
                return await self._prefill_remote(job, str(p["transfer_id"]))
            logger.warning("Missing transfer_id in kv_transfer_params from router!")
        elif role == "decode" and p.get("do_remote_prefill"):
            keys = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")
            if all(p.get(k) for k in keys):
                return await self._decode_remote(job, p)
            logger.warning(
                "Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", p
            )
        return await self._local(job)

    async def _local(self, job: Job) -> Generation:
        t0 = time.perf_counter()
        blocks = await self._allocate(job, len(job.ids) + job.max_tokens)
        timings = {"queue": _ms(t0)}
        done = [False]
        try:
            t1 = time.perf_counter()
            table = self._table(await self._all("prefill", job.req, job.ids, blocks, None, True))
            timings["prefill"] = _ms(t1)
        except BaseException:
            self._release(job.req, blocks, done)
            raise
        return self._decoding(job, blocks, table, timings, done, None, {})

    def _decoding(
        self,
        job: Job,
        blocks: BlockTable,
        table: Any,
        timings: dict[str, float],
        done: list[bool],
        params: dict[str, Any] | None,
        extra: dict[str, Any],
    ) -> Generation:
        gen = Generation(len(job.ids), _empty(), kv_transfer_params=params)
        gen.pdwire = {**extra, "timings_ms": timings}
        gen.cleanup = lambda: self._release(job.req, blocks, done)
        gen.tokens = self._tokens(job, blocks, table, gen, timings)
        return gen

    async def _tokens(
        self, job: Job, blocks: BlockTable, table: Any, gen: Generation, timings: dict[str, float]
    ) -> AsyncIterator[int]:
        t0 = time.perf_counter()
        length, vocab = len(job.ids), self.config.shape.vocab
        self.counts["active"] += 1
        try:
            for i in range(job.max_tokens):
                token = next_token(table, length, vocab)
                if i == 0:
                    timings["first_step"] = _ms(t0)
                if token == EOS or token in job.stop_ids:
                    _stopped(gen, job, token)
                    return
                yield token
                if i + 1 < job.max_tokens:
                    table = self._table(await self._all("append", job.req, token, length, blocks))
                    length += 1
            gen.finish = "length"
        finally:
            timings["decode"] = _ms(t0)
            self.counts["active"] -= 1
            gen.cleanup()

    # -- prefill node: send ------------------------------------------------------------------

    async def _prefill_remote(self, job: Job, transfer_id: str) -> Generation:
        t0 = time.perf_counter()
        blocks = await self._allocate(job, len(job.ids))
        timings = {"queue": _ms(t0)}
        send = _Send(blocks, set(range(len(self.workers))))
        with self._lock:
            self._sends[job.req] = send
        t1 = time.perf_counter()
        try:
            table = self._table(
                await self._all("prefill", job.req, job.ids, blocks, transfer_id, False)
            )
            if self.config.prefill_delay:
                await asyncio.sleep(self.config.prefill_delay)  # a slow P (fault injection)
        except BaseException:
            # Every agent that saw transfer_started frees the blocks on will-not-send.
            await asyncio.gather(
                *(
                    w.acall("finish", job.req, transfer_id, blocks, False, timeout=5.0)
                    for w in self.workers
                ),
                return_exceptions=True,
            )
            raise
        timings["prefill"] = _ms(t1)
        token = next_token(table, len(job.ids), self.config.shape.vocab)
        with self._lock:
            rejected = send.rejected
            if rejected is not None:
                self._sends.pop(job.req, None)
        if rejected is not None:
            self.allocator.free(blocks.all())
            raise NodeError(400, f"{rejected[0]}: {rejected[1]}")
        # A stop token as the only token: P will not send (§10.11.1).
        stop = token == EOS or token in job.stop_ids
        await self._all("finish", job.req, transfer_id, blocks, not stop)
        self.counts["remote"] += 1
        gen = Generation(len(job.ids), _iterate([] if stop else [token]))
        if stop:
            _stopped(gen, job, token)
        gen.pdwire = {"sent": not stop, "timings_ms": timings}
        return gen

    # -- decode node: load -------------------------------------------------------------------

    async def _decode_remote(self, job: Job, p: dict[str, Any]) -> Generation:
        t0 = time.perf_counter()
        shape = self.config.shape
        if self.config.kv_lease_duration is not None:
            # Renewed from now on, while the request waits for blocks too (6.4-R6).
            args = (p["transfer_id"], p["remote_engine_id"], p["remote_bootstrap_addr"])
            await self._all("queue", job.req, *map(str, args))
        try:
            blocks = await self._allocate(job, len(job.ids) + job.max_tokens)
        except NodeError:
            await self._release_only(job, p)
            raise
        timings = {"queue": _ms(t0)}
        prompt_blocks = blocks.upto(shape.blocks_for(len(job.ids)))
        loop = asyncio.get_running_loop()
        n = len(self.workers)
        load = _Load(
            [loop.create_future() for _ in range(n)], [loop.create_future() for _ in range(n)], loop
        )
        with self._lock:
            self._loads[job.req] = load
        done = [False]
        self.counts["remote"] += 1
        try:
            failure, verified, nbytes, table = await self._load(
                job, p, prompt_blocks, load, timings
            )
            recomputed = False
            if failure is not None:
                self.counts["failed"] += 1
                if not await self._settled(job.req, load, blocks):
                    done[0] = True  # a write may still land: the blocks are parked
                if self.config.load_failure_policy == "fail" or done[0]:
                    raise NodeError(500, f"KV load failed: {failure}", "InternalServerError")
                t1 = time.perf_counter()
                table = self._table(
                    await self._all("prefill", job.req, job.ids, blocks, None, True)
                )
                timings["recompute"] = _ms(t1)
                recomputed = True
                self.counts["recomputed"] += 1
            elif verified:
                self.counts["verified"] += 1
        except BaseException:
            self._release(job.req, blocks, done)
            raise
        finally:
            if not load.parked:
                with self._lock:
                    self._loads.pop(job.req, None)
        params = {"remote_prefill_cached_tokens": 0 if recomputed else len(job.ids)}
        extra: dict[str, Any] = {
            "d_req_id": job.req,
            "verified": verified,
            "bytes_verified": nbytes,
            "recomputed": recomputed,
        }
        if failure is not None:
            extra["failure"] = failure
        return self._decoding(job, blocks, table, timings, done, params, extra)

    async def _release_only(self, job: Job, p: dict[str, Any]) -> None:
        """D will not load this request (§10.10.8): pull it with no blocks, so that P frees its
        own without waiting for its expiry. The workers' sessions never report it."""
        args = (str(p["transfer_id"]), str(p["remote_engine_id"]), str(p["remote_bootstrap_addr"]))
        empty = BlockTable.empty(self.config.shape.geometry().num_groups)
        results = await asyncio.gather(
            *(w.acall("load", job.req, *args, empty, 0, timeout=5.0) for w in self.workers),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                logger.warning("request %s: release-only pull not sent: %s", job.req, r)

    async def _load(
        self,
        job: Job,
        p: dict[str, Any],
        blocks: BlockTable,
        load: _Load,
        timings: dict[str, float],
    ) -> tuple[str | None, bool, int, Any]:
        """Load and verify; return (failure, verified, bytes verified, digest table)."""
        t0 = time.perf_counter()
        engine_id, addr = str(p["remote_engine_id"]), str(p["remote_bootstrap_addr"])
        timeout = self.config.load_timeout
        budget_ms = 0  # 5.2-R4: the D leg's deadline, counted from the request's arrival
        if isinstance(p.get("deadline_ms"), int) and p["deadline_ms"] > 0:
            budget_ms = max(1, int(p["deadline_ms"] - timings["queue"]))
            # The workers' sessions end the load at the deadline; this wait is the backstop.
            timeout = min(timeout, budget_ms / 1000 + _DEADLINE_GRACE_S)
        tid = str(p["transfer_id"])
        await self._all("load", job.req, tid, engine_id, addr, blocks, budget_ms)
        outcomes = await self._outcomes(job.req, load, timeout)
        timings["load"] = _ms(t0)
        failures = [o for o in outcomes if o[0] != "loaded"]
        spans = [o[1:3] for o in outcomes if o[0] == "loaded" and len(o) == 3]
        if spans and len(spans) == len(outcomes):  # the first pull sent to the last load
            timings["pull"] = round((max(e for _, e in spans) - min(s for s, _ in spans)) * 1000, 3)
        if failures:
            return "; ".join(sorted({f"{o[1]}: {o[2]}" for o in failures})), False, 0, None
        t1 = time.perf_counter()
        results = await self._all("verify", job.req, job.ids, blocks)
        timings["verify"] = _ms(t1)
        verified = all(ok for ok, _, _ in results)
        nbytes = sum(b for _, b, _ in results)
        if not verified and self.config.verify_kv:
            bad = [w.spec.name for w, r in zip(self.workers, results, strict=True) if not r[0]]
            return f"KV bytes differ from the prompt's on {bad}", False, nbytes, None
        return None, True, nbytes, self._table([d for _, _, d in results])

    async def _outcomes(self, req: str, load: _Load, timeout: float) -> list[tuple[Any, ...]]:
        waits = asyncio.gather(*(asyncio.shield(f) for f in load.outcome))
        try:
            return list(await asyncio.wait_for(waits, timeout))
        except TimeoutError:
            logger.warning("request %s: no KV within %.1fs: aborting the load", req, timeout)
        await asyncio.gather(
            *(w.acall("abort", req, timeout=5.0) for w in self.workers), return_exceptions=True
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(asyncio.shield(f) for f in load.outcome)), _SETTLE_S
            )
        return [
            f.result() if f.done() else ("failed", "TIMEOUT", f"no KV within {timeout}s", False)
            for f in load.outcome
        ]

    async def _settled(self, req: str, load: _Load, blocks: BlockTable) -> bool:
        """Wait until no write can land in the blocks of a failed load. When that takes too
        long, park the blocks (False): they are freed once every worker has released them."""
        waits = [
            load.released[i]
            for i, f in enumerate(load.outcome)
            if not f.done() or (f.result()[0] == "failed" and not f.result()[3])
        ]
        if not waits:
            return True
        together = asyncio.gather(*waits)
        try:
            await asyncio.wait_for(asyncio.shield(together), _SETTLE_S)
            return True
        except TimeoutError:
            logger.error("request %s: blocks not released within %ss: parked", req, _SETTLE_S)
        load.parked = True
        together.add_done_callback(lambda _: self._unpark(req, blocks))
        return False

    def _unpark(self, req: str, blocks: BlockTable) -> None:
        with self._lock:
            self._loads.pop(req, None)
        self.allocator.free(blocks.all())
        logger.info("request %s: parked blocks released", req)


def _stopped(gen: Generation, job: Job, token: int) -> None:
    gen.finish, gen.stop_token = "stop", token
    gen.stop_reason = token if token in job.stop_ids else None


async def _empty() -> AsyncIterator[int]:
    return
    yield  # pragma: no cover


async def _iterate(tokens: list[int]) -> AsyncIterator[int]:
    for token in tokens:
        yield token


# -- HTTP ------------------------------------------------------------------------------------
