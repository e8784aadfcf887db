"""The connector's worker half: one per vLLM worker process (TP rank x PP stage).

It registers the worker's KV cache with a Mooncake transfer engine and drives pdwire's agents
with what the scheduler decided: a ``ProducerAgent`` serves D's pulls (P, kv_both), a
``ConsumerAgent`` pulls (D, kv_both). The agents report back on their own threads; this half
collects their verdicts for vLLM's next ``get_transfer_results``: requests whose blocks P may free,
requests whose load ended, and, of those, the ones whose load failed (with their blocks), which
the scheduler fails or recomputes as ``kv_load_failure_policy`` says. A failed load is reported
only once no write can land in its blocks any more.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from pdwire.consumer import mint_layout_id
from pdwire.events import FreeReason, LoadRequest
from pdwire.messages import ErrorCode
from pdwire.planning import Side
from pdwire.producer import ProducerConfig
from pdwire.versions import PDWIRE_2

from ..bootstrap import BootstrapServer
from ..consumer_agent import ConsumerAgent
from ..metrics import add_up, difference
from ..producer_agent import ProducerAgent
from ..transport import MooncakeTransport
from . import regions
from .config import Settings
from .metadata import Load, PdwireConnectorMetadata
from .position import Position, bootstrap_url, fingerprint, owns_bootstrap

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


class PdwireWorker:
    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: Settings
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._settings = settings
        self.position = Position.of(vllm_config)
        self.produces = transfer.is_kv_producer
        self.consumes = transfer.is_kv_consumer
        self.transport = MooncakeTransport(
            self.position.host, settings.protocol, settings.device_name
        )
        self.bootstrap: BootstrapServer | None = None
        self.producer: ProducerAgent | None = None
        self.consumer: ConsumerAgent | None = None
        self._lock = threading.Lock()
        self._held: set[str] = set()  # P: requests whose blocks wait for their pulls
        self._sent: set[str] = set()  # P: ... that may be freed now
        self._loading: dict[str, list[list[int]]] = {}  # D: loads not reported yet
        self._aborted: set[str] = set()  # D: aborted by the scheduler: not a failure
        self._deadlines: dict[str, float] = {}  # D: time.time() when a load is given up
        self._received: set[str] = set()  # D: loads that ended (failed ones too)
        self._failed: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._reported_blocks: set[int] = set()  # taken by the last get_transfer_results
        self._stats_before: dict[str, Any] = {}
        if self.produces and owns_bootstrap(vllm_config, settings, self.position):
            key = settings.auth_key if settings.profile == PDWIRE_2 else None
            keys = (key, *settings.accepted_keys) if key is not None else None
            self.bootstrap = BootstrapServer(auth_key=keys).start(
                settings.bootstrap_host, settings.bootstrap_port
            )
            logger.info(
                "bootstrap server for engine %s at %s", self.position.engine_id, self.bootstrap.url
            )

    # -- start ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        found = regions.compute(kv_caches, self._kv_cache_config)
        for storage in found.storages:
            self.transport.register(storage)
        model = self._vllm_config.model_config
        pos, s = self.position, self._settings
        heads = model.get_total_num_kv_heads()
        side = Side(
            tp_size=pos.tp_size,
            tp_rank=pos.tp_rank,
            pp_size=pos.pp_size,
            regions=found.regions,
            replicated=model.use_mla or pos.tp_size > heads,
            total_kv_heads=heads,
        )
        fp = (
            fingerprint(self._vllm_config, self._kv_cache_config, found.kv_layout(model.use_mla))
            if s.profile == PDWIRE_2
            else None
        )
        if self.consumes:
            config = ConsumerAgent.config_for(
                self.transport,
                side,
                pp_rank=pos.pp_rank,
                profile=s.profile,
                fingerprint=fp,
                layout_id=mint_layout_id(),
                receive_timeout=s.receive_timeout,
                deadline=s.deadline,
                lease=s.lease,
                auth_key=s.auth_key,
                accepted_keys=s.accepted_keys,
            )
            self.consumer = ConsumerAgent(
                config,
                self.transport,
                on_loaded=self._on_loaded,
                on_failed=self._on_failed,
                on_released=self._on_released,
                query_timeout=s.bootstrap_timeout,
            )
            self.consumer.start()
        if self.produces:
            self.producer = ProducerAgent(
                ProducerConfig(
                    side=side,
                    profile=s.profile,
                    fingerprint=fp,
                    abort_timeout=s.abort_timeout,
                    lease=s.lease,
                    auth_key=s.auth_key,
                    accepted_keys=s.accepted_keys,
                ),
                self.transport,
                bootstrap_url=bootstrap_url(self._vllm_config, s),
                engine_id=pos.engine_id,
                on_free=self._on_free,
                on_reject=self._on_reject,
                dp_rank=pos.dp_rank,
                tp_rank=pos.tp_rank,
                pp_rank=pos.pp_rank,
                host=pos.host,
                sender_threads=s.num_workers,
                register_timeout=s.bootstrap_timeout,
            )
            # vLLM's bound on the registration: every attempt's four HTTP phases, the backoffs
            # between them, and 30 s more.
            self.producer.start(timeout=3 * 4 * s.bootstrap_timeout + 3 + 30)
        logger.info(
            "pdwire worker %s tp=%d/%d pp=%d/%d: %d regions, engine at %s (%s)",
            pos.engine_id,
            pos.tp_rank,
            pos.tp_size,
            pos.pp_rank,
            pos.pp_size,
            len(found.regions),
            self.transport.session,
            s.profile,
        )

    # -- the scheduler's decisions --------------------------------------------------------

    def apply(self, meta: PdwireConnectorMetadata) -> None:
        """Hand one step's decisions to the agents; returns at once."""
        if meta.sends or meta.no_sends:
            self._apply_sends(meta)
        if meta.queued:
            consumer = self.consumer
            assert consumer is not None, "a D request reached a worker that does not consume"
            for queued in meta.queued:
                consumer.queue(queued)
        if meta.loads:
            self._apply_loads(meta.loads)
        for d_req in meta.aborts:
            self._abort(d_req)

    def _apply_sends(self, meta: PdwireConnectorMetadata) -> None:
        producer = self.producer
        assert producer is not None, "a P request reached a worker that does not produce"
        for send in meta.sends:
            if send.blocks is None:
                producer.transfer_started(send.transfer_id, send.p_req_id)
                continue
            with self._lock:
                self._held.add(send.p_req_id)
            producer.transfer_finished(send.transfer_id, send.p_req_id, send.blocks)
        for no_send in meta.no_sends:
            producer.transfer_will_not_send(no_send.transfer_id, no_send.p_req_id, no_send.reason)

    def _apply_loads(self, loads: list[Load]) -> None:
        consumer = self.consumer
        assert consumer is not None, "a D request reached a worker that does not consume"
        with self._lock:
            for load in loads:
                if any(load.blocks):
                    self._loading[load.d_req_id] = load.blocks
                    if load.deadline is not None:
                        self._deadlines[load.d_req_id] = load.deadline
        consumer.load(
            [
                LoadRequest(
                    d_req_id=load.d_req_id,
                    transfer_id=load.transfer_id,
                    engine_id=load.engine_id,
                    bootstrap_addr=load.bootstrap_addr,
                    blocks=load.blocks,
                )
                for load in loads
            ]
        )

    def _abort(self, d_req: str) -> None:
        with self._lock:
            if d_req not in self._loading:
                return  # reported already
            self._aborted.add(d_req)
        assert self.consumer is not None
        self.consumer.abort(d_req, on_unsent=self._on_released)

    def _expire(self, now: float) -> None:
        """Give up the loads whose ``deadline_ms`` passed: each is reported failed once no
        write can land in its blocks any more."""
        with self._lock:
            due = [d for d, at in self._deadlines.items() if at <= now]
            for d_req in due:
                del self._deadlines[d_req]
            due = [d for d in due if d in self._loading and d not in self._aborted]
        for d_req in due:
            logger.warning("request %s: no KV within its deadline_ms: giving up the load", d_req)
            assert self.consumer is not None
            self.consumer.abort(d_req, on_unsent=self._on_released)

    # -- the agents' verdicts (their loop threads) ----------------------------------------

    def _on_free(self, p_req: str, transfer_id: str, reason: FreeReason) -> None:
        if reason is not FreeReason.SERVED:
            logger.info("request %s (%s): blocks freed: %s", p_req, transfer_id, reason)
        with self._lock:
            # Only what the scheduler holds for us: it freed a will-not-send request's already.
            if p_req in self._held:
                self._held.discard(p_req)
                self._sent.add(p_req)

    def _on_reject(self, p_req: str, transfer_id: str, code: ErrorCode, message: str) -> None:
        logger.error("request %s (%s) rejected: %s %s", p_req, transfer_id, code, message)

    def _on_loaded(self, d_req: str, pull_s: float) -> None:
        logger.debug("request %s: KV loaded, %.1f ms after its first pull", d_req, pull_s * 1000)
        with self._lock:
            if self._loading.pop(d_req, None) is not None:
                self._aborted.discard(d_req)
                self._deadlines.pop(d_req, None)
                self._received.add(d_req)

    def _on_failed(self, d_req: str, code: ErrorCode, reason: str, blocks_free: bool) -> None:
        with self._lock:
            aborted = d_req in self._aborted
        level = logging.INFO if aborted else logging.WARNING
        logger.log(level, "request %s: KV load failed: %s %s", d_req, code, reason)
        if blocks_free:
            self._on_released(d_req)

    def _on_released(self, d_req: str) -> None:
        with self._lock:
            blocks = self._loading.pop(d_req, None)
            if blocks is None:
                return
            self._deadlines.pop(d_req, None)
            self._received.add(d_req)
            if d_req in self._aborted:
                self._aborted.discard(d_req)
                return
            self._failed.add(d_req)
            self._failed_blocks.update(b for group in blocks for b in group)

    # -- reports to vLLM ------------------------------------------------------------------

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call; the
        failed loads' blocks are kept for the next ``take_load_errors``."""
        if self._deadlines:
            self._expire(time.time())
        with self._lock:
            sent, self._sent = self._sent, set()
            received, self._received = self._received, set()
            failed, self._failed = self._failed, set()
            self._reported_blocks |= self._failed_blocks
            self._failed_blocks = set()
        return sent, received, failed

    def take_stats(self) -> dict[str, Any] | None:
        """What the agents counted since the last call (``metrics.difference``), None when
        nothing: vLLM asks at every engine step, so only the counts are read, not the
        sessions' gauges (which their loop threads own)."""
        agents = (self.producer, self.consumer)
        current = add_up(a.counts.snapshot() for a in agents if a is not None)
        gained = difference(current, self._stats_before)
        self._stats_before = current
        return gained if gained["values"] or gained["histograms"] else None

    def take_load_errors(self) -> set[int]:
        blocks, self._reported_blocks = self._reported_blocks, set()
        return blocks

    def shutdown(self) -> None:
        for agent in (self.producer, self.consumer):
            if agent is not None:
                agent.stop()
        self.producer = self.consumer = None
        self.transport.close()
        if self.bootstrap is not None:
            self.bootstrap.stop()
            self.bootstrap = None
