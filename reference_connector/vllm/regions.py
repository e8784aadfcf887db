"""A worker's KV regions (spec §10.6), computed from the cache tensors vLLM's model runner hands
to ``register_kv_caches``, the way vLLM's MooncakeConnector describes the same tensors:

- a layer cache whose blocks are dense, such as the CPU backend's
  ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (each head's K rows, then its V rows, so
  a TP shard of heads is one byte range of a block: the LBHNC layout), is one region: block
  ``i`` is ``stride(0)`` bytes at ``base + i * stride(0)``, of which the layer's page is
  payload;
- a cache whose blocks are made of parts that lie apart, such as ``[num_blocks, 2, ...]`` with K
  and V in separate allocations, is one region per part, in order.

Regions are named by layer and aligned with the peer's by (name, occurrence), so P and D need not
register their layers in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from pdwire.planning import Region

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: vLLM's row offset of a region that is not a view into a packed row (never promoted).
NOT_PACKED = -1


class UnsupportedLayout(RuntimeError):
    """A cache tensor laid out in a way the connector does not transfer; names the layer."""


@dataclasses.dataclass(frozen=True)
class Registration:
    """What to register with the transfer engine, and the regions inside it."""

    storages: tuple[torch.Tensor, ...]  # one flat byte view per distinct allocation
    regions: tuple[Region, ...]

    def kv_layout(self, use_mla: bool) -> str:
        """How a layer's blocks lie (``--kv-layout``, §3.6.1): an MLA model's latent region,
        one region per layer holding K and V (a dense block), or a region per part."""
        if use_mla:
            return "mla"
        names = [r.layer_name for r in self.regions]
        return "together" if len(names) == len(set(names)) else "apart"


def _layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(layer_name))


def _dense(t: torch.Tensor) -> bool:
    from vllm.utils.torch_utils import is_non_overlapping_and_dense

    return bool(is_non_overlapping_and_dense(t))


def _region(name: str, index: int, group: int, part: torch.Tensor, payload: int) -> Region:
    stride = part.stride(0) * part.element_size()
    if payload > stride:
        raise UnsupportedLayout(f"layer {name}: page of {payload} bytes exceeds the block stride")
    return Region(
        layer_name=name,
        layer_index=index,
        base_addr=part.data_ptr(),
        block_len=stride,
        kv_block_len=payload,
        group_index=group,
        shared_group_ids=(group,),
        row_offset=NOT_PACKED,
    )


def _page_bytes(kv_cache_config: KVCacheConfig, group: int, cache: torch.Tensor) -> int:
    spec = kv_cache_config.transfer_groups[group].kv_cache_spec
    page = getattr(spec, "page_size_bytes", 0)
    return int(page) if page else int(cache[0].numel() * cache.element_size())


def _layer_regions(
    name: str, cache: torch.Tensor, group: int, page: int, num_blocks: int
) -> list[Region]:
    if cache.ndim < 2 or cache.shape[0] != num_blocks:
        raise UnsupportedLayout(
            f"layer {name}: a cache of shape {tuple(cache.shape)} for {num_blocks} KV blocks; "
            "the connector needs one row per block, with the attention kernel's block size "
            "equal to --block-size"
        )
    index = _layer_index(name)
    if _dense(cache[0]):
        return [_region(name, index, group, cache, page)]
    # A block's parts lie apart (K and V, say): one region per index of the second dimension.
    parts = [cache[:, i] for i in range(cache.shape[1])]
    if not all(_dense(part[0]) for part in parts):
        raise UnsupportedLayout(
            f"layer {name}: a block of shape {tuple(cache.shape[1:])} is "
            "neither dense nor made of dense parts"
        )
    return [
        _region(name, index, group, part, part[0].numel() * part.element_size()) for part in parts
    ]


def compute(kv_caches: Mapping[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> Registration:
    """The regions of ``kv_caches`` (layer name -> cache tensor) and the storages that hold them.

    Layers of no transfer group are skipped. Raises ``UnsupportedLayout`` for a tensor that is
    neither of the two layouts above."""
    group_of = kv_cache_config.transfer_group_index_by_layer
    storages: dict[int, torch.Tensor] = {}
    regions: list[Region] = []
    for name, cache in kv_caches.items():
        group = group_of.get(name)
        if group is None:
            continue
        storage = cache.untyped_storage()
        if storage.data_ptr() not in storages:
            flat = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
            storages[storage.data_ptr()] = flat
        page = _page_bytes(kv_cache_config, group, cache)
        regions += _layer_regions(name, cache, group, page, kv_cache_config.num_blocks)
    if not regions:
        raise UnsupportedLayout("no KV cache tensor of a transfer group was registered")
    return Registration(tuple(storages.values()), tuple(regions))
