"""``PdwireConnector``: pdwire as a vLLM V1 KV connector, wire-compatible with vLLM's own
MooncakeConnector (profile ``legacy``) and speaking pdwire/2 with peers that announce it.

Name it, as P, D or both (pdwire's vLLM plugin, ``plugin.register``, adds the name to vLLM's
connector factory; ``"kv_connector_module_path": "reference_connector.vllm.connector"`` loads it
without the plugin)::

    --kv-transfer-config '{"kv_connector": "PdwireConnector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}'

The scheduler half (``scheduler.PdwireScheduler``) decides which requests load or send; the
worker half (``worker.PdwireWorker``) runs pdwire's agents over the Mooncake transfer engine.
The keys of ``kv_connector_extra_config`` are listed in ``reference_connector.vllm.config``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import Settings
from .metadata import PdwireConnectorMetadata
from .scheduler import PdwireScheduler
from .stats import PdwirePromMetrics, PdwireStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .worker import PdwireWorker


def _log_with_vllm() -> None:
    """In a process whose logging nobody configured (a vLLM server's: vLLM sets up only its own
    logger), the reference connector's logs go where vLLM's go, at vLLM's level."""
    ours, vllm_logger = logging.getLogger("reference_connector"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.getEffectiveLevel())


#: The KV-cache layout the connector asks vLLM for, as MooncakeConnector does: vLLM's name of
#: a head-major block (both "apart" and "together" of §3.6.1 are this layout to vLLM).
REQUIRED_LAYOUT: Final = "LBHNC"


class PdwireConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_with_vllm()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.settings = Settings.from_extra_config(transfer.kv_connector_extra_config)
        self.scheduler: PdwireScheduler | None = None
        self.worker: PdwireWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PdwireScheduler(vllm_config, kv_cache_config, self.settings.lease)
        else:
            from .worker import PdwireWorker  # the transfer engine loads only in workers

            self.worker = PdwireWorker(vllm_config, kv_cache_config, self.settings)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        model = vllm_config.model_config
        return None if model is None or model.use_mla else REQUIRED_LAYOUT

    # -- scheduler ------------------------------------------------------------------------

    def _scheduler(self) -> PdwireScheduler:
        assert self.scheduler is not None, "a scheduler hook called on a worker"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load restores the request's own blocks in every transfer group.
        return tuple(self._kv_cache_config.transfer_group_ids)

    # -- worker ---------------------------------------------------------------------------

    def _worker(self) -> PdwireWorker:
        assert self.worker is not None, "a worker hook called on the scheduler"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdwireConnectorMetadata)
        self._worker().apply(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests, between engine steps."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """D pulls: P writes nothing per layer."""

    def wait_for_save(self) -> None:
        """D pulls: nothing to wait for."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received, _ = self._worker().take_results()
        return sent or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._worker().take_results()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # -- stats (worker and scheduler) -----------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The workers' figures of the last interval; the scheduler's half counts nothing."""
        data = None if self.worker is None else self.worker.take_stats()
        return None if data is None else PdwireStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return PdwireStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return PdwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
