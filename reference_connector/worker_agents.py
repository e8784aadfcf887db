"""What a node's worker process drives: an agent that speaks the side channel for it.

By default that is pdwire's own (``ReferenceAgent``: a ``ProducerAgent`` or ``ConsumerAgent``
over a ``MooncakeTransport``). A node can host another implementation's worker code instead,
named as ``MODULE:CALLABLE`` (``--agent``): the callable takes the ``WorkerContext`` and returns
an ``Agent``. That is how the engine node serves as a testee for a foreign P or D.

An agent reports what happened through ``WorkerContext.emit``: ``("event", "free", p_req_id,
reason)`` and ``("event", "reject", p_req_id, code, message)`` on P; ``("event", "loaded",
d_req_id[, first_pull_at, loaded_at])`` (``time.monotonic()`` readings), ``("event", "failed",
d_req_id, code, reason, blocks_free)`` and ``("event", "released", d_req_id)`` on D.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from pdwire.consumer import mint_layout_id
from pdwire.events import LoadRequest, RequestQueued
from pdwire.planning import Descriptors
from pdwire.producer import ProducerConfig

from .consumer_agent import ConsumerAgent
from .kv_pool import KVPool
from .producer_agent import ProducerAgent
from .transport import MooncakeTransport

if TYPE_CHECKING:
    from .worker_spec import WorkerSpec

#: The agent a spec with ``agent == ""`` gets.
REFERENCE: Final = "reference_connector.worker_agents:reference_agent"


class Agent(Protocol):
    """One worker's side channel, as the worker process drives it (any thread)."""

    def transfer_started(self, transfer_id: str, p_req_id: str) -> None:
        """P: the request that produces ``transfer_id`` was admitted."""

    def transfer_finished(self, transfer_id: str, p_req_id: str, blocks: list[list[int]]) -> None:
        """P: the request's KV is in ``blocks`` (per KV-cache group)."""

    def transfer_will_not_send(self, transfer_id: str, p_req_id: str, reason: str) -> None:
        """P: the request ended without KV to send."""

    def load(self, requests: Sequence[LoadRequest]) -> None:
        """D: load these requests. An agent may also have ``queue(RequestQueued)``: a request
        arrived whose lease it renews until its load settles (§6.4)."""

    def abort(self, d_req_id: str) -> None:
        """D: the request was aborted."""

    def stats(self) -> dict[str, Any]:
        """Counters for ``/pdwire/stats`` (``descriptors`` and ``bytes_written`` at least)."""

    def stop(self) -> None:
        """Stop serving and release what the agent holds.

        An agent may also have ``sleep()`` and ``wake_up()``, vLLM's sleep mode: unregister its
        KV memory from the transfer engine, and register the same memory again; the node
        answers HTTP 501 to ``POST /sleep`` for an agent without them."""


@dataclasses.dataclass
class WorkerContext:
    """What an agent factory gets: the worker's spec, its KV pool (not yet registered with any
    transfer engine) and the channel to the node's front."""

    spec: WorkerSpec
    pool: KVPool
    emit: Callable[..., None]


AgentFactory = Callable[[WorkerContext], Agent]


class AgentLoadError(RuntimeError):
    """``--agent`` names nothing that can be imported and called."""


def load_factory(name: str) -> AgentFactory:
    """The factory ``MODULE:CALLABLE`` names ("" is the reference agent)."""
    module_name, sep, attr = (name or REFERENCE).partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"agent {name!r} must be MODULE:CALLABLE")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentLoadError(f"agent {name!r}: cannot import {module_name}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AgentLoadError(f"agent {name!r}: {module_name} has no callable {attr!r}")
    result: AgentFactory = factory
    return result


class CountingTransport(MooncakeTransport):
    """The Mooncake transport, counting the descriptors and bytes of successful writes."""

    def __init__(self, hostname: str) -> None:
        super().__init__(hostname)
        self._count_lock = threading.Lock()
        self.descriptors = 0
        self.bytes = 0

    def write(self, peer: str, descriptors: Descriptors) -> int:
        status = super().write(peer, descriptors)
        if status == 0:
            with self._count_lock:
                self.descriptors += len(descriptors)
                self.bytes += descriptors.total_bytes
        return status


class ReferenceAgent:
    """pdwire's own agents: a ``ProducerAgent`` (P) or ``ConsumerAgent`` (D) over a counting
    Mooncake transport that holds the worker's pool."""

    def __init__(
        self,
        ctx: WorkerContext,
        *,
        producer_agent: type[ProducerAgent] = ProducerAgent,
        consumer_agent: type[ConsumerAgent] = ConsumerAgent,
    ) -> None:
        s = ctx.spec
        self._emit = ctx.emit
        self._pool = ctx.pool
        self.transport = CountingTransport(s.host)
        self.producer: ProducerAgent | None = None
        self.consumer: ConsumerAgent | None = None
        try:
            side = ctx.pool.register(self.transport)
            if s.role == "prefill":
                config = ProducerConfig(
                    side=side,
                    profile=s.profile,
                    fingerprint=s.fingerprint(),
                    abort_timeout=s.abort_timeout,
                    lease=s.lease,
                    auth_key=s.auth_key,
                    accepted_keys=s.accepted_keys,
                )
                self.producer = producer_agent(
                    config,
                    self.transport,
                    bootstrap_url=s.bootstrap_url,
                    engine_id=s.engine_id,
                    dp_rank=s.dp_rank,
                    on_free=lambda p_req, tid, reason: ctx.emit(
                        "event", "free", p_req, str(reason)
                    ),
                    on_reject=lambda p_req, tid, code, msg: ctx.emit(
                        "event", "reject", p_req, str(code), msg
                    ),
                    tp_rank=s.tp_rank,
                    pp_rank=s.pp_rank,
                    host=s.host,
                    register_timeout=s.register_timeout,
                )
                self.producer.start(timeout=s.start_timeout)
            else:
                d_config = consumer_agent.config_for(
                    self.transport,
                    side,
                    pp_rank=s.pp_rank,
                    profile=s.profile,
                    fingerprint=s.fingerprint(),
                    layout_id=mint_layout_id(),
                    receive_timeout=s.receive_timeout or s.abort_timeout + 60.0,  # 3.1-R8
                    lease=s.lease,
                    auth_key=s.auth_key,
                    accepted_keys=s.accepted_keys,
                )
                self.consumer = consumer_agent(
                    d_config,
                    self.transport,
                    on_loaded=self._loaded,
                    on_failed=lambda d_req, code, why, free: ctx.emit(
                        "event", "failed", d_req, str(code), why, free
                    ),
                    on_released=lambda d_req: ctx.emit("event", "released", d_req),
                )
                self.consumer.start()
        except BaseException:
            self.stop()
            raise

    def _producer(self) -> ProducerAgent:
        assert self.producer is not None, "only a prefill worker sends KV"
        return self.producer

    def _consumer(self) -> ConsumerAgent:
        assert self.consumer is not None, "only a decode worker loads KV"
        return self.consumer

    def transfer_started(self, transfer_id: str, p_req_id: str) -> None:
        self._producer().transfer_started(transfer_id, p_req_id)

    def transfer_finished(self, transfer_id: str, p_req_id: str, blocks: list[list[int]]) -> None:
        self._producer().transfer_finished(transfer_id, p_req_id, blocks)

    def transfer_will_not_send(self, transfer_id: str, p_req_id: str, reason: str) -> None:
        self._producer().transfer_will_not_send(transfer_id, p_req_id, reason)

    def queue(self, request: RequestQueued) -> None:
        self._consumer().queue(request)

    def load(self, requests: Sequence[LoadRequest]) -> None:
        self._consumer().load(requests)

    def abort(self, d_req_id: str) -> None:
        if self.consumer is not None:
            # Aborted before any pull carried its blocks: they are the node's again at once.
            self.consumer.abort(d_req_id, on_unsent=self._unsent)

    def _loaded(self, d_req_id: str, pull_s: float) -> None:
        now = time.monotonic()  # one clock for every worker of the host
        self._emit("event", "loaded", d_req_id, now - pull_s, now)

    def _unsent(self, d_req_id: str) -> None:
        self._emit("event", "failed", d_req_id, "CANCELLED", "aborted before any pull", True)

    def stats(self) -> dict[str, Any]:
        t = self.transport
        stats: dict[str, Any] = {
            "session": t.session,
            "descriptors": t.descriptors,
            "bytes_written": t.bytes,
        }
        agent = self.producer or self.consumer
        if agent is not None:
            stats["metrics"] = agent.metrics()
        if self.producer is not None:
            p = self.producer
            stats.update(address=p.address, pulls_received=p.pulls_received, writes=p.writes)
            stats["recent_writes"] = [
                {
                    "d_req_ids": list(w.d_req_ids),
                    "started": w.started,
                    "ms": round(w.seconds * 1000, 3),
                    "descriptors": w.descriptors,
                    "bytes": w.nbytes,
                    "status": w.status,
                }
                for w in p.recent_writes
            ]
        if self.consumer is not None:
            c = self.consumer
            stats.update(pulls_sent=c.pulls_sent, open_sockets=c.open_sockets)
        return stats

    def sleep(self) -> None:
        self.transport.unregister(self._pool.kv)

    def wake_up(self) -> None:
        """The same memory at the same addresses: D keeps its layout_id and its echoes, P its
        layout cache (3.7-R3, R16)."""
        self.transport.register(self._pool.kv)

    def stop(self) -> None:
        for agent in (self.producer, self.consumer):
            if agent is not None:
                agent.stop()
        self.transport.close(destroy=False)  # a worker process exits next (worker_process)


def reference_agent(ctx: WorkerContext) -> ReferenceAgent:
    """The default agent factory."""
    return ReferenceAgent(ctx)
