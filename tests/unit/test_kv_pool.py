"""A node worker's pool with rows smaller than its blocks (10.6.6) holds and hashes a request
exactly as a pool of whole blocks does; with a sliding window (10.4.7) each KV-cache group holds
its own blocks in its own layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference_connector.kv_content import BlockTable, KVShape
from reference_connector.kv_pool import KVPool

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_blocks=8, vocab=64)
IDS = [5, 9, 1, 33, 7, 2]  # two blocks, the second one partial
BLOCKS = [6, 2]
TABLE = BlockTable(((6, 2),), (0,))


def _pool(kernel: int | None) -> KVPool:
    return KVPool(dataclasses.replace(SHAPE, kernel_block_size=kernel), 1, 0, 1, 0)


def _digests(pool: KVPool, appended: int) -> bytes:
    pool.write_prompt(IDS, TABLE)
    pool.append(appended, len(IDS), TABLE)
    digest = pool.new_digest()
    pool.digest(digest, TABLE, 0, len(IDS) + 1)
    return digest.digests()


@pytest.mark.parametrize("kernel", [1, 2])
def test_rows_hold_and_hash_a_request_like_whole_blocks(kernel: int) -> None:
    pool = _pool(kernel)
    q = SHAPE.block_size // kernel
    assert pool.kv.shape[2:5] == (SHAPE.num_blocks * q, SHAPE.num_kv_heads, kernel)
    assert pool.rows(BLOCKS) == [b * q + j for b in BLOCKS for j in range(q)]
    pool.write_prompt(IDS, TABLE)
    assert pool.verify(IDS, TABLE)[0]
    assert not pool.verify(IDS, BlockTable(((2, 6),), (0,)))[0]
    assert _digests(pool, 11) == _digests(_pool(None), 11)
    assert _digests(pool, 11) != _digests(_pool(None), 12)
    pool.zero(TABLE)
    assert not pool.kv.any()


def test_kernel_block_size_must_divide_the_block_size() -> None:
    with pytest.raises(ValueError, match="kernel_block_size must divide block_size 4"):
        dataclasses.replace(SHAPE, kernel_block_size=3)


# -- a sliding window over the odd layers: two KV-cache groups -------------------------------

WINDOW = dataclasses.replace(SHAPE, num_layers=4, sliding_window=4, num_blocks=16)
LONG = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # 4 blocks of 4 tokens, the last partial


def _window_table(ids: list[int], tokens: int, base: int) -> BlockTable:
    sizes, firsts = WINDOW.table_sizes(len(ids), tokens)
    return BlockTable.split(list(range(base, base + sum(sizes))), sizes, firsts)


def test_a_window_group_keeps_the_last_blocks_its_window_needs() -> None:
    """ceil(4 / 4) + 1 = 2: of a prompt of 4 blocks group 1 keeps blocks 2 and 3, and every
    block decoding adds; group 0 keeps them all."""
    assert WINDOW.table_sizes(len(LONG), len(LONG)) == ([4, 2], [0, 2])
    assert WINDOW.table_sizes(len(LONG), len(LONG) + 3) == ([5, 3], [0, 2])
    assert WINDOW.table_sizes(5, 5) == ([2, 2], [0, 0])
    table = _window_table(LONG, len(LONG) + 3, 1)
    assert table.ids == ((1, 2, 3, 4, 5), (6, 7, 8))
    assert table.upto(4) == BlockTable(((1, 2, 3, 4), (6, 7)), (0, 2))


def test_each_group_holds_its_blocks_in_its_own_layers() -> None:
    pool = KVPool(WINDOW, 1, 0, 1, 0)
    table = _window_table(LONG, len(LONG), 1)
    pool.write_prompt(LONG, table)
    assert pool.verify(LONG, table)[0]
    held = pool.kv.flatten(3).ne(0).any(-1)  # [layers, K/V, rows]: any byte written
    for layer in range(4):
        rows = {r for r in range(16) if held[layer, 0, r]}
        assert rows == ({1, 2, 3, 4} if layer % 2 == 0 else {5, 6}), layer
    assert not pool.verify(LONG, BlockTable(((1, 2, 3, 4), (6, 5)), (0, 2)))[0]


def test_a_window_request_hashes_alike_wherever_its_blocks_are() -> None:
    """The digest reads each group's blocks through its table: two placements of the same
    request, decoded one token further, hash alike; another token does not."""

    def digests(base: int, appended: int) -> bytes:
        pool = KVPool(WINDOW, 1, 0, 1, 0)
        table = _window_table(LONG, len(LONG) + 1, base)
        pool.write_prompt(LONG, table)
        pool.append(appended, len(LONG), table)
        digest = pool.new_digest()
        pool.digest(digest, table, 0, len(LONG) + 1)
        return digest.digests()

    assert digests(0, 11) == digests(7, 11)
    assert digests(0, 11) != digests(0, 12)


def test_a_state_space_group_lists_null_blocks_before_its_state() -> None:
    """10.6.3: the odd layers keep a prompt's last block only, and a transfer's list of their
    group puts a null block (id 0) for each block before it."""
    mamba = dataclasses.replace(SHAPE, num_layers=4, mamba=True, num_blocks=16)
    sizes, firsts = mamba.table_sizes(len(LONG), len(LONG) + 3)
    assert (sizes, firsts) == ([5, 2], [0, 3])
    table = BlockTable.split(list(range(1, 8)), sizes, firsts)
    assert table.upto(4).lists(frozenset({1})) == [[1, 2, 3, 4], [0, 0, 0, 6]]
    assert table.upto(4).lists() == [[1, 2, 3, 4], [6]]
    pool = KVPool(mamba, 1, 0, 1, 0)
    assert pool.side(0).mamba_groups == frozenset({1})
    pool.write_prompt(LONG, table)
    assert pool.verify(LONG, table)[0]


def test_group_one_is_of_one_kind() -> None:
    with pytest.raises(ValueError, match="mamba needs 2 layers or more, and neither"):
        dataclasses.replace(SHAPE, mamba=True, sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window needs at least 1 token and 2 layers"):
        dataclasses.replace(SHAPE, num_layers=1, sliding_window=4)


def test_packed_rows_hold_a_request_like_separate_regions() -> None:
    """A pool of packed rows holds, verifies and hashes a request as a pool of one region per
    layer does; each region of its side is a slice of the row at its row offset."""
    packed = KVPool(dataclasses.replace(SHAPE, packed_rows=True), 1, 0, 1, 0)
    assert packed.storage.is_contiguous() and packed.kv.shape == _pool(None).kv.shape
    side = packed.side(0x1000)
    row = side.regions[0].block_len
    assert [r.row_offset for r in side.regions] == [i * row // 4 for i in range(4)]
    assert [r.base_addr - 0x1000 for r in side.regions] == [r.row_offset for r in side.regions]
    packed.write_prompt(IDS, TABLE)
    assert packed.verify(IDS, TABLE)[0]
    layer1_v = packed.storage[6, 1, 1].flatten().view(torch.int16)
    assert torch.equal(layer1_v, packed.expected(IDS)[1, 1, 0].flatten())

    def digests(pool: KVPool) -> bytes:
        pool.write_prompt(IDS, TABLE)
        digest = pool.new_digest()
        pool.digest(digest, TABLE, 0, len(IDS))
        return digest.digests()

    assert digests(packed) == digests(_pool(None))
