"""A node worker's KV cache.

``KVPool`` is one contiguous tensor per worker, [its layers, K/V, rows, its heads, row tokens,
head_dim]: for each layer, K then V, each an LBHNC region of ``num_blocks`` blocks, as
``Geometry.side`` lays them out (with ``packed_rows`` the tensor is [rows, layers, K/V, ...], each
row holding every layer; with ``kv_layout`` "together" [layers, rows, heads, row tokens, K/V,
head_dim], a token's K then its V, as vLLM's CPU attention backend lays them out, and with "mla"
the same of one head, whose K and V halves are the token's latent; ``kv`` is each order seen
as the first). A row is a block, or with a
kernel block size smaller than the block size one of the block's ``q`` kernel blocks: block ``b``
is rows ``b*q ... b*q+q-1`` (10.6.6). ``register`` hands the tensor to the transfer engine and
returns the worker's ``Side`` with the regions' real base addresses. Block ids are the node's:
every worker of a node holds the same block ids for a request (vLLM's scheduler allocates them
once), so the allocator (``block_allocator``) lives in the node's front process. With a sliding
window (``KVShape.sliding_window``) the odd layers form KV-cache group 1, with block ids of their
own (a ``BlockTable``): every id has its rows in every layer, and each group uses them in its own
layers only, keeping of the prompt only the blocks its window needs (10.4.7).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pdwire.planning import Side

from .kv_content import BlockTable, KVShape, block_runs
from .kv_values import ContextDigest, kv_blocks, kv_values, layer_indexes
from .transport import MooncakeTransport


class KVPool:
    """The KV blocks of worker (tp_rank, pp_rank)."""

    def __init__(self, shape: KVShape, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int):
        shape.check_split(tp_size, pp_size)
        self.shape = shape
        self.tp_size, self.tp_rank, self.pp_size, self.pp_rank = tp_size, tp_rank, pp_size, pp_rank
        self.layers = shape.layers(pp_size, pp_rank)
        self.heads = shape.heads(tp_size, tp_rank)
        geometry = shape.geometry()
        self.q = geometry.kernel_blocks
        rows, heads = shape.num_blocks * self.q, len(self.heads)
        row_tokens = shape.block_size // self.q
        cell = (heads, row_tokens, shape.channels)
        if geometry.packs_rows:  # a block is one row of every layer: [rows, layers, ...]
            self.storage = torch.zeros((rows, len(self.layers), 2, *cell), dtype=shape.torch_dtype)
            self.kv = self.storage.permute(1, 2, 0, 3, 4, 5)
        elif geometry.kv_layout != "apart":  # [layers, rows, heads, tokens, K/V, channels]
            self.storage = torch.zeros(
                (len(self.layers), rows, heads, row_tokens, 2, shape.channels),
                dtype=shape.torch_dtype,
            )
            self.kv = self.storage.permute(0, 4, 1, 2, 3, 5)
        else:
            self.storage = torch.zeros((len(self.layers), 2, rows, *cell), dtype=shape.torch_dtype)
            self.kv = self.storage
        self._words = self.kv.view(torch.int16)
        self.num_groups = geometry.num_groups
        self.mamba_groups = geometry.mamba_groups  # whose lists hold null blocks (10.6.3)
        #: per KV-cache group, its layers: an index of the pool's layer axis
        self._layers = layer_indexes(geometry.group_layers(self.layers))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def side(self, base: int) -> Side:
        """This worker's ``Side`` with its regions inside the tensor registered at ``base``."""
        s = self.shape.geometry().side(self.tp_size, self.tp_rank, self.pp_size, self.pp_rank, 0)
        origin = s.regions[0].base_addr
        regions = tuple(
            dataclasses.replace(r, base_addr=base + r.base_addr - origin) for r in s.regions
        )
        return dataclasses.replace(s, regions=regions)

    def register(self, transport: MooncakeTransport) -> Side:
        return self.side(transport.register(self.storage))

    # -- content -----------------------------------------------------------------------------

    def rows(self, blocks: Sequence[int]) -> list[int]:
        """The pool rows that hold ``blocks``, in order."""
        q = self.q
        return [b * q + j for b in blocks for j in range(q)]

    def _groups(self, table: BlockTable) -> Iterator[tuple[Any, list[int], int]]:
        """Per KV-cache group: its layers (an index of the pool's layer axis), the rows of its
        blocks, and which of the request's rows the first of them is."""
        for layers, ids, first in zip(self._layers, table.ids, table.firsts, strict=True):
            yield layers, self.rows(ids), first * self.q

    def expected(self, ids: Sequence[int], first: int = 0, end: int | None = None) -> torch.Tensor:
        """The int16 patterns of this worker's rows of prompt ``ids``' blocks ``[first, end)``
        (default: all of them)."""
        bs = self.shape.block_size
        end = self.shape.blocks_for(len(ids)) if end is None else end
        values = kv_blocks(
            self.shape, ids[first * bs : end * bs], self.layers, self.heads, first * bs
        )
        if self.q == 1:
            return values
        layers, kv, blocks, heads, tokens, channels = values.shape
        split = values.view(layers, kv, blocks, heads, self.q, tokens // self.q, channels)
        rows = split.permute(0, 1, 2, 4, 3, 5, 6)
        return rows.reshape(layers, kv, blocks * self.q, heads, tokens // self.q, channels)

    def _chunks(self, ids: Sequence[int], table: BlockTable) -> Iterator[tuple[Any, int, Any]]:
        """(layers, pool row, its expected values) of each of the prompt's rows, a block's
        values computed at a time, so that they are still in the cache when they are used."""
        total = self.shape.blocks_for(len(ids)) * self.q
        for layers, rows, first in self._groups(table):
            for i, row in enumerate(rows[: max(0, total - first)]):
                source = first + i
                if i == 0 or source % self.q == 0:
                    block = source // self.q
                    values = self.expected(ids, block, block + 1)[layers]
                yield layers, row, values[:, :, source % self.q]

    def write_prompt(self, ids: Sequence[int], table: BlockTable) -> int:
        """Compute the prompt's KV slice into the table's blocks; return the bytes written."""
        written = 0
        for layers, row, part in self._chunks(ids, table):
            self._words[layers, :, row] = part
            written += part.numel() * 2
        return written

    def zero(self, table: BlockTable) -> None:
        for _, first, count in block_runs(self.rows(table.all())):
            self._words[:, :, first : first + count].zero_()

    def verify(self, ids: Sequence[int], table: BlockTable) -> tuple[bool, int]:
        """Whether the table's blocks hold exactly the prompt's KV slice, and the bytes
        compared."""
        ok, compared = True, 0
        for layers, row, part in self._chunks(ids, table):
            ok = ok and torch.equal(self._words[layers, :, row], part)
            compared += part.numel() * 2
        return ok, compared

    def append(self, token: int, position: int, table: BlockTable) -> None:
        """Write the KV slice of ``token`` at ``position`` (decoded here)."""
        tokens = self._words.shape[4]
        values = kv_values(self.shape, [token], [position], self.layers, self.heads)
        for layers, rows, first in self._groups(table):
            row = rows[position // tokens - first]
            self._words[layers, :, row, :, position % tokens, :] = values[layers, :, :, 0, :]

    def digest(self, digest: ContextDigest, table: BlockTable, start: int, end: int) -> None:
        """Hash positions ``[start, end)`` of the request held in ``table`` into ``digest``."""
        for layers, rows, first in self._groups(table):
            digest.update(self._words, rows, start, end, layers, first)

    def new_digest(self) -> ContextDigest:
        return ContextDigest(len(self.layers), len(self.heads))
