"""What a worker knows of its place in the engine: its ranks and address, who runs the bootstrap
server and where P workers register (vLLM's MooncakeConnector's rules), and the compatibility
fingerprint it announces under pdwire/2."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pdwire.http_models import url_of
from pdwire.messages import KV_LAYOUT_NAMES, Fingerprint

from ..dp_placement import DataParallel
from .config import Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclasses.dataclass(frozen=True)
class Position:
    """Where this worker sits in its engine."""

    engine_id: str
    dp_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    host: str

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> Position:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.utils.network_utils import get_ip

        transfer = vllm_config.kv_transfer_config
        assert transfer is not None and transfer.engine_id is not None
        pp = get_pp_group()
        return cls(
            engine_id=transfer.engine_id,
            dp_rank=data_parallel(vllm_config).rank,
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            pp_rank=pp.rank_in_group,
            pp_size=pp.world_size,
            host=get_ip(),
        )


def data_parallel(vllm_config: VllmConfig) -> DataParallel:
    """The engine's place in its data-parallel deployment."""
    parallel = vllm_config.parallel_config
    return DataParallel(
        index=parallel.data_parallel_index,
        local_rank=parallel.data_parallel_rank_local or 0,
        load_balancing="hybrid" if parallel.local_engines_only else "internal",
        master_ip=parallel.data_parallel_master_ip,
        master_addr=parallel.master_addr,
        nodes=parallel.nnodes_within_dp,
    )


def owns_bootstrap(vllm_config: VllmConfig, settings: Settings, pos: Position) -> bool:
    """The one worker of the engine that runs the bootstrap server (as vLLM's rule)."""
    if settings.bootstrap_address is not None or pos.tp_rank or pos.pp_rank:
        return False
    return data_parallel(vllm_config).serves_bootstrap


def bootstrap_url(vllm_config: VllmConfig, settings: Settings) -> str:
    """Where this engine's P workers register."""
    if settings.bootstrap_address is not None:
        return url_of(*settings.bootstrap_address)
    host = data_parallel(vllm_config).register_host(settings.bootstrap_host)
    return url_of(host, settings.bootstrap_port)


def fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_layout: str
) -> Fingerprint:
    """The fingerprint of this engine's KV cache, whose blocks lie as ``kv_layout`` says."""
    model = vllm_config.model_config
    spec = kv_cache_config.transfer_groups[0].kv_cache_spec
    return Fingerprint(
        model=model.model,
        dtype=str(getattr(spec, "dtype", model.dtype)).removeprefix("torch."),
        num_layers=model.get_total_num_hidden_layers(),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        kv_layout=KV_LAYOUT_NAMES[kv_layout],
    )
