"""The KV cache of the model-free engine node: a fixed function of the tokens (``kv_content``
describes it), as torch tensors in the node's dtype, and what a node decodes after a prompt
computed from scratch (``reference_completion``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

import torch

from .kv_content import EOS, KVShape, assemble, next_token, place

_M: Final = 2**31 - 1  # products of two residues stay below 2**62
_KEEP: Final = ~(1 << 14)  # clears bit 14: the top exponent bit of bf16 and fp16
_K = (0x5BD1E995, 0x1B873593, 0x6C8E9CF5, 0x2545F491, 0x3C6EF372, 0x68E31DA4, 0x4B4F5D7B)


def _mix(x: torch.Tensor, k: int) -> torch.Tensor:
    """A residue-mod-M hash step of an int64 tensor with values in ``[0, 2**32)``."""
    x = (x % _M) * k % _M
    return x ^ (x >> 13)


def _i16(x: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of an int64 tensor of non-negative values, as int16."""
    x = x & 0xFFFF
    return (x - ((x >> 15) << 16)).to(torch.int16)


@functools.lru_cache(maxsize=64)
def _rows(layers: range, heads: range) -> torch.Tensor:
    """A hash of (layer, K/V, head) for the slice, [L, 2, H], int64 in [0, M)."""
    layer = torch.tensor(list(layers), dtype=torch.int64).view(-1, 1, 1)
    kv = torch.arange(2, dtype=torch.int64).view(1, -1, 1)
    head = torch.tensor(list(heads), dtype=torch.int64).view(1, 1, -1)
    return _mix(_mix(_mix(layer + 1, _K[0]) + kv, _K[1]) + head, _K[2])


def _columns(ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """A hash of (token, position), [P], int64 in [0, M)."""
    token = torch.tensor(list(ids), dtype=torch.int64)
    position = torch.tensor(list(positions), dtype=torch.int64)
    return _mix(_mix(token + 1, _K[3]) + position, _K[4])


@functools.lru_cache(maxsize=64)
def _channels(head_dim: int) -> torch.Tensor:
    return _i16(_mix(torch.arange(head_dim, dtype=torch.int64) + 1, _K[5]))


def kv_values(
    shape: KVShape, ids: Sequence[int], positions: Sequence[int], layers: range, heads: range
) -> torch.Tensor:
    """The 16-bit patterns of the slice, int16 [layers, 2, heads, positions, channels]."""
    comb = _i16(_mix(_rows(layers, heads).unsqueeze(-1) ^ _columns(ids, positions), _K[6]))
    return (comb.unsqueeze(-1) + _channels(shape.channels)) & _KEEP


def kv_blocks(
    shape: KVShape, ids: Sequence[int], layers: range, heads: range, start: int = 0
) -> torch.Tensor:
    """The patterns of tokens ``ids`` at positions ``start...`` laid out in blocks, int16
    [layers, 2, blocks, heads, block_size, channels]; ``start`` must begin a block. Slots past
    the last token hold zeros."""
    if start % shape.block_size:
        raise ValueError(f"start {start} is not at a block boundary")
    n, bs = len(ids), shape.block_size
    nb = shape.blocks_for(n)
    padded = list(ids) + [0] * (nb * bs - n)
    comb = _i16(
        _mix(
            _rows(layers, heads).unsqueeze(-1) ^ _columns(padded, range(start, start + nb * bs)),
            _K[6],
        )
    )
    # the small comb made contiguous first, so that the large sum is written in its final order
    comb = comb.view(len(layers), 2, len(heads), nb, bs).permute(0, 1, 3, 2, 4).contiguous()
    out = comb.unsqueeze(-1) + _channels(shape.channels)
    out &= _KEEP
    if nb * bs > n:
        out[:, :, -1, :, n - (nb - 1) * bs :, :] = 0
    return out


#: Which of a pool's layers one KV-cache group holds: all of them (a view), or an index.
LayerIndex = slice | torch.Tensor


def layer_indexes(groups: Sequence[Sequence[int]]) -> list[LayerIndex]:
    """Per KV-cache group, its layers (positions on a pool's layer axis) as an index; with one
    group, every layer, which slicing takes without a copy."""
    return [slice(None) if len(groups) == 1 else torch.tensor(chosen) for chosen in groups]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_SPLITMIX: Final = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))
_LOW: Final = tuple((1 << (64 - n)) - 1 for n in range(64))  # masks of logical right shifts


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of an int64 tensor (two's complement, wrapping)."""
    x = x ^ ((x >> 30) & _LOW[30])
    x = x * _SPLITMIX[0]
    x = x ^ ((x >> 27) & _LOW[27])
    x = x * _SPLITMIX[1]
    return x ^ ((x >> 31) & _LOW[31])


def _words(part: torch.Tensor) -> torch.Tensor:
    """``part``'s int16 channels as int64 words: four channels a word when their count allows,
    else one channel a word (the choice depends on the shape only, as the digest must)."""
    if part.shape[-1] % 4:
        return part.to(torch.int64)
    try:
        return part.view(torch.int64)
    except RuntimeError:  # a slice whose strides do not allow the view
        return part.contiguous().view(torch.int64)


class ContextDigest:
    """A digest of each (layer, K/V, head) row of one worker's slice, streamed: the sum, modulo
    2**64, over the row's positions p and 64-bit words j of ``word * W(p, j)``, where W is
    splitmix64 of (p, j). A sum, so the positions can come in any pieces; a weight per position
    and word, so every byte counts where it lies."""

    def __init__(self, layers: int, heads: int) -> None:
        self._sums = torch.zeros((layers, 2, heads), dtype=torch.int64)

    def update(
        self,
        pool: torch.Tensor,
        rows: Sequence[int],
        start: int,
        end: int,
        layers: LayerIndex = slice(None),
        first_row: int = 0,
    ) -> None:
        """Add positions ``[start, end)`` of the request, read from ``pool`` (int16
        [layers, 2, pool rows, heads, row tokens, channels]) through the ``rows`` that hold
        the request, in order (a row is a block, or a kernel block: ``KVPool.rows``).
        ``layers``: the pool's layers to hash (``layer_indexes``; default all); ``first_row``:
        which of the request's rows ``rows[0]`` is (a sliding-window group's, 10.4.7)."""
        tokens = pool.shape[4]
        pos = max(start, first_row * tokens)
        while pos < end:  # a row at a time: its words stay in the cache while they are summed
            row, slot = rows[pos // tokens - first_row], pos % tokens
            stop = min(end - pos, tokens - slot) + slot
            part = pool[:, :, row, :, slot:stop, :]
            words = _words(part[layers])
            weights = _mix64(
                torch.arange(pos * words.shape[-1], (pos + stop - slot) * words.shape[-1])
            ).view(stop - slot, words.shape[-1])
            self._sums[layers] += (words * weights).sum(dim=(3, 4))
            pos += stop - slot

    def digests(self) -> bytes:
        """Every row's digest so far, [layers, 2, heads] x 8 bytes."""
        return _mix64(self._sums).numpy().tobytes()


def reference_completion(shape: KVShape, ids: Sequence[int], max_tokens: int) -> list[int]:
    """What any node decodes after prompt ``ids`` (computed here, in one slice)."""
    layers, heads = range(shape.num_layers), range(shape.num_kv_heads)
    nb = shape.blocks_for(len(ids) + max_tokens)
    pool = torch.zeros(
        (len(layers), 2, nb, len(heads), shape.block_size, shape.channels), dtype=torch.int16
    )
    prompt = kv_blocks(shape, ids, layers, heads)
    pool[:, :, : prompt.shape[2]] = prompt
    blocks = list(range(nb))
    digest = ContextDigest(len(layers), len(heads))
    geometry = shape.geometry()
    # each KV-cache group hashes the blocks it holds (a sliding window's: from its first, 10.4.7)
    groups = list(
        zip(
            layer_indexes(geometry.group_layers(layers)),
            geometry.firsts(shape.blocks_for(len(ids))),
            strict=True,
        )
    )

    def update(start: int, end: int) -> None:
        for chosen, first in groups:
            digest.update(pool, blocks[first:], start, end, chosen, first)

    update(0, len(ids))
    out: list[int] = []
    length = len(ids)
    while len(out) < max_tokens:
        table = assemble(shape)
        place(table, digest.digests(), layers, heads)
        token = next_token(table, length, shape.vocab)
        if token == EOS:
            break
        out.append(token)
        values = kv_values(shape, [token], [length], layers, heads)
        pool[:, :, length // shape.block_size, :, length % shape.block_size, :] = values[
            :, :, :, 0, :
        ]
        update(length, length + 1)
        length += 1
    return out
