"""Real KV memory for in-memory P/D tests: one uint8 array per worker behind its regions.

Every element of the model's KV cache gets a distinct 16-bit value that encodes (layer, K/V,
global KV head, token position, channel), so a byte copied from the wrong layer, head, block,
token or channel, or from a wrong byte offset, reads differently from the byte expected there.
Regions come from ``pdwire.sim.geometry.Geometry`` (LBHNC: inside a block, heads, then tokens,
then channels); a region's ``base_addr`` maps to ``base_addr - lowest base`` in its worker's array.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from pdwire.planning import Region, Side
from pdwire.sim.geometry import Geometry

Bytes = npt.NDArray[np.uint8]
Words = npt.NDArray[np.uint16]
ELEMENT = np.dtype("<u2")  # dtype_bytes = 2, little-endian
POISON = 0xEE  # what a freed P block holds once it is reused


def heads_of(geometry: Geometry, tp_size: int, tp_rank: int) -> slice:
    """The global KV heads TP rank ``tp_rank`` of ``tp_size`` holds (replicated past the heads)."""
    heads = geometry.num_kv_heads
    if tp_size <= heads:
        per = heads // tp_size
        return slice(tp_rank * per, (tp_rank + 1) * per)
    shard = tp_rank // (tp_size // heads)
    return slice(shard, shard + 1)


def model_kv(geometry: Geometry) -> Words:
    """The whole model's KV, indexed [layer, K/V, block, head, token, channel], every value
    distinct: a mixed-radix number over (layer, K/V, head, token position, channel), where the
    token position is ``block * block_size + token``."""
    g = geometry
    assert g.dtype_bytes == ELEMENT.itemsize
    shape = (g.num_layers, 2, g.num_kv_heads, g.num_blocks, g.block_size, g.head_dim)
    count = int(np.prod(shape))
    assert count <= 1 << 16, "the geometry is too big for a 16-bit code per element"
    codes = np.arange(count, dtype=np.uint32).astype(np.uint16).reshape(shape)
    return codes.transpose(0, 1, 3, 2, 4, 5)


@dataclasses.dataclass
class WorkerMemory:
    """One worker's registered regions and the array behind them."""

    geometry: Geometry
    side: Side
    pp_rank: int
    base: int  # the lowest base address: offset 0 of ``mem``
    mem: Bytes

    @classmethod
    def allocate(cls, geometry: Geometry, side: Side, pp_rank: int, fill: Bytes) -> WorkerMemory:
        """``fill``: the initial bytes, at least as many as the regions span."""
        base = min(r.base_addr for r in side.regions)
        end = max(r.base_addr + r.block_len * geometry.num_blocks for r in side.regions)
        return cls(geometry, side, pp_rank, base, fill[: end - base].copy())

    def layer_regions(self) -> Iterator[tuple[int, int, Region]]:
        """(layer, K/V, region) in registration order."""
        layers = self.geometry.stage_layers(self.side.pp_size, self.pp_rank)
        pairs = itertools.product(layers, range(2))
        for (layer, kv), region in zip(pairs, self.side.regions, strict=True):
            assert region.layer_index == layer
            yield layer, kv, region

    def view(self, region: Region, mem: Bytes | None = None) -> Words:
        """``region`` of ``mem`` (default this worker's) as [block, head, token, channel]."""
        g = self.geometry
        heads = region.kv_block_len // (g.block_size * g.head_dim * g.dtype_bytes)
        start = region.base_addr - self.base
        whole = self.mem if mem is None else mem
        span = whole[start : start + region.block_len * g.num_blocks]
        return span.view(ELEMENT).reshape(g.num_blocks, heads, g.block_size, g.head_dim)

    def offset(self, addr: int, length: int) -> int:
        """Where ``length`` bytes at ``addr`` lie in ``mem``; asserts they are all inside it."""
        off = addr - self.base
        assert off >= 0 and off + length <= self.mem.size, (hex(addr), length)
        return off

    def fill_from(self, kv: Words) -> None:
        """Hold this worker's share of the model's KV in every block (a P worker)."""
        heads = heads_of(self.geometry, self.side.tp_size, self.side.tp_rank)
        for layer, kv_index, region in self.layer_regions():
            self.view(region)[:] = kv[layer, kv_index][:, heads]

    def expected(self, kv: Words, loads: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Bytes:
        """This worker's memory once each (P's block ids, D's block ids) load has landed: D's
        blocks hold P's last ``len(D ids)`` blocks, for this worker's layers and heads."""
        out = self.mem.copy()
        heads = heads_of(self.geometry, self.side.tp_size, self.side.tp_rank)
        for layer, kv_index, region in self.layer_regions():
            view = self.view(region, out)
            for src, dst in loads:
                chosen = list(src)[len(src) - len(dst) :]
                view[list(dst)] = kv[layer, kv_index][chosen][:, heads]
        return out

    def poison(self, blocks: Sequence[int]) -> None:
        """Overwrite ``blocks`` in every region, as a reuse of freed blocks would."""
        for _, _, region in self.layer_regions():
            self.view(region)[list(blocks)] = POISON * 0x0101
