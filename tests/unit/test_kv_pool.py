"""A node worker's pool with rows smaller than its blocks (10.6.6) holds and hashes a request
exactly as a pool of whole blocks does."""

from __future__ import annotations

import dataclasses

import pytest

from reference_connector.kv_content import KVShape
from reference_connector.kv_pool import KVPool

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=8, vocab=64)
IDS = [5, 9, 1, 33, 7, 2]  # two blocks, the second one partial
BLOCKS = [6, 2]


def _pool(kernel: int | None) -> KVPool:
    return KVPool(dataclasses.replace(SHAPE, kernel_block_size=kernel), 1, 0, 1, 0)


def _digests(pool: KVPool, appended: int) -> bytes:
    pool.write_prompt(IDS, BLOCKS)
    pool.append(appended, len(IDS), BLOCKS)
    digest = pool.new_digest()
    pool.digest(digest, BLOCKS, 0, len(IDS) + 1)
    return digest.digests()


@pytest.mark.parametrize("kernel", [1, 2])
def test_rows_hold_and_hash_a_request_like_whole_blocks(kernel: int) -> None:
    pool = _pool(kernel)
    q = SHAPE.block_size // kernel
    assert pool.kv.shape[2:5] == (SHAPE.num_blocks * q, SHAPE.num_kv_heads, kernel)
    assert pool.rows(BLOCKS) == [b * q + j for b in BLOCKS for j in range(q)]
    pool.write_prompt(IDS, BLOCKS)
    assert pool.verify(IDS, BLOCKS)[0]
    assert not pool.verify(IDS, [2, 6])[0]
    assert _digests(pool, 11) == _digests(_pool(None), 11)
    assert _digests(pool, 11) != _digests(_pool(None), 12)
    pool.zero(BLOCKS)
    assert not pool.kv.any()


def test_kernel_block_size_must_divide_the_block_size() -> None:
    with pytest.raises(ValueError, match="kernel_block_size must divide block_size 4"):
        dataclasses.replace(SHAPE, kernel_block_size=3)
