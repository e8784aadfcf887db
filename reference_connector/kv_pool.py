"""A node worker's KV cache.

``KVPool`` is one contiguous tensor per worker, [its layers, K/V, rows, its heads, row tokens,
head_dim]: for each layer, K then V, each an LBHNC region of ``num_blocks`` blocks, as
``Geometry.side`` lays them out. A row is a block, or with a kernel block size smaller than the
block size one of the block's ``q`` kernel blocks: block ``b`` is rows ``b*q ... b*q+q-1``
(10.6.6). ``register`` hands the tensor to the transfer engine and returns
the worker's ``Side`` with the regions' real base addresses. Block ids are the node's: every
worker of a node holds the same block ids for a request (vLLM's scheduler allocates them once),
so the allocator (``block_allocator``) lives in the node's front process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pdwire.planning import Side

from .kv_content import ContextDigest, KVShape, Words, block_runs
from .kv_values import kv_blocks, kv_values
from .transport import MooncakeTransport


class KVPool:
    """The KV blocks of worker (tp_rank, pp_rank)."""

    def __init__(self, shape: KVShape, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int):
        shape.check_split(tp_size, pp_size)
        self.shape = shape
        self.tp_size, self.tp_rank, self.pp_size, self.pp_rank = tp_size, tp_rank, pp_size, pp_rank
        self.layers = shape.layers(pp_size, pp_rank)
        self.heads = shape.heads(tp_size, tp_rank)
        self.q = shape.geometry().kernel_blocks
        dims = (len(self.layers), 2, shape.num_blocks * self.q, len(self.heads))
        row_tokens = shape.block_size // self.q
        self.kv = torch.zeros((*dims, row_tokens, shape.head_dim), dtype=shape.torch_dtype)
        self._words = self.kv.view(torch.int16)
        self.words: Words = self._words.numpy()

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
        return self.side(transport.register(self.kv))

    # -- content -----------------------------------------------------------------------------

    def rows(self, blocks: Sequence[int]) -> list[int]:
        """The pool rows that hold ``blocks``, in order."""
        q = self.q
        return [b * q + j for b in blocks for j in range(q)]

    def expected(self, ids: Sequence[int]) -> torch.Tensor:
        """The int16 patterns of this worker's rows of prompt ``ids``' blocks."""
        values = kv_blocks(self.shape, ids, self.layers, self.heads)
        if self.q == 1:
            return values
        layers, kv, blocks, heads, tokens, channels = values.shape
        split = values.view(layers, kv, blocks, heads, self.q, tokens // self.q, channels)
        rows = split.permute(0, 1, 2, 4, 3, 5, 6)
        return rows.reshape(layers, kv, blocks * self.q, heads, tokens // self.q, channels)

    def write_prompt(self, ids: Sequence[int], blocks: Sequence[int]) -> int:
        """Compute the prompt's KV slice into ``blocks``; return the bytes written."""
        values = self.expected(ids)
        for i, first, count in block_runs(self.rows(blocks)[: values.shape[2]]):
            self._words[:, :, first : first + count].copy_(values[:, :, i : i + count])
        return values.numel() * 2

    def zero(self, blocks: Sequence[int]) -> None:
        for _, first, count in block_runs(self.rows(blocks)):
            self._words[:, :, first : first + count].zero_()

    def verify(self, ids: Sequence[int], blocks: Sequence[int]) -> tuple[bool, int]:
        """Whether ``blocks`` hold exactly the prompt's KV slice, and the bytes compared."""
        values = self.expected(ids)
        ok = all(
            torch.equal(self._words[:, :, first : first + count], values[:, :, i : i + count])
            for i, first, count in block_runs(self.rows(blocks)[: values.shape[2]])
        )
        return ok, values.numel() * 2

    def append(self, token: int, position: int, blocks: Sequence[int]) -> None:
        """Write the KV slice of ``token`` at ``position`` (decoded here)."""
        tokens = self.words.shape[4]
        row = self.rows(blocks)[position // tokens]
        values = kv_values(self.shape, [token], [position], self.layers, self.heads)
        self._words[:, :, row, :, position % tokens, :] = values[:, :, :, 0, :]

    def digest(self, digest: ContextDigest, blocks: Sequence[int], start: int, end: int) -> None:
        """Hash positions ``[start, end)`` of the request held in ``blocks`` into ``digest``."""
        digest.update(self.words, self.rows(blocks), start, end)

    def new_digest(self) -> ContextDigest:
        return ContextDigest(len(self.layers), len(self.heads))
