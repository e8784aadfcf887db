"""The regions the worker registers, from the cache tensors vLLM hands it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference_connector.vllm import regions
from reference_connector.vllm.connector import PdwireConnector

from . import offline as h

pytestmark = pytest.mark.vllm

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS = 2


def _cpu_cache() -> torch.Tensor:
    return torch.zeros(h.NUM_BLOCKS, HEADS, h.BLOCK_SIZE, 2 * h.HEAD_DIM)


def test_cpu_backend_layout_is_one_region_per_layer() -> None:
    caches = {name: _cpu_cache() for name in LAYERS}
    found = regions.compute(caches, h.kv_cache_config(LAYERS, HEADS))
    page = HEADS * h.BLOCK_SIZE * 2 * h.HEAD_DIM * 4
    assert [r.layer_name for r in found.regions] == LAYERS
    assert [r.layer_index for r in found.regions] == [0, 1]
    for region, cache in zip(found.regions, caches.values(), strict=True):
        assert region.base_addr == cache.data_ptr()
        assert region.block_len == region.kv_block_len == page
        assert (region.group_index, region.shared_group_ids, region.row_offset) == (0, (0,), -1)
    assert [s.data_ptr() for s in found.storages] == [c.data_ptr() for c in caches.values()]
    assert all(
        s.numel() == c.numel() * 4 for s, c in zip(found.storages, caches.values(), strict=True)
    )


def test_k_and_v_apart_are_two_regions_per_layer() -> None:
    apart = torch.zeros(2, h.NUM_BLOCKS, HEADS, h.BLOCK_SIZE, h.HEAD_DIM)
    cache = apart.transpose(0, 1)  # [num_blocks, 2, ...]: a block's K and V lie apart
    found = regions.compute({LAYERS[0]: cache}, h.kv_cache_config(LAYERS[:1], HEADS))
    k, v = found.regions
    assert (k.layer_name, v.layer_name) == (LAYERS[0], LAYERS[0])
    assert (k.base_addr, v.base_addr) == (apart[0].data_ptr(), apart[1].data_ptr())
    assert k.block_len == k.kv_block_len == HEADS * h.BLOCK_SIZE * h.HEAD_DIM * 4
    assert len(found.storages) == 1


def test_views_of_one_allocation_register_it_once() -> None:
    shared = torch.zeros(2, h.NUM_BLOCKS, HEADS, h.BLOCK_SIZE, 2 * h.HEAD_DIM)
    caches = {LAYERS[0]: shared[0], LAYERS[1]: shared[1]}
    found = regions.compute(caches, h.kv_cache_config(LAYERS, HEADS))
    assert len(found.regions) == 2 and len(found.storages) == 1
    assert found.storages[0].numel() == shared.numel() * 4


def test_layers_outside_the_transfer_groups_are_skipped() -> None:
    caches = {name: _cpu_cache() for name in [*LAYERS, "model.layers.9.mlp"]}
    found = regions.compute(caches, h.kv_cache_config(LAYERS, HEADS))
    assert [r.layer_name for r in found.regions] == LAYERS


def test_kernel_blocks_smaller_than_kv_blocks_are_refused() -> None:
    cache = torch.zeros(2 * h.NUM_BLOCKS, HEADS, h.BLOCK_SIZE // 2, 2 * h.HEAD_DIM)
    with pytest.raises(regions.UnsupportedLayout, match="--block-size"):
        regions.compute({LAYERS[0]: cache}, h.kv_cache_config(LAYERS[:1], HEADS))


def test_the_connector_asks_for_the_lbhnc_layout(tmp_path: Path) -> None:
    config = h.vllm_config(h.model_dir(tmp_path), "kv_producer")
    assert PdwireConnector.get_required_kvcache_layout(config) == "LBHNC"
