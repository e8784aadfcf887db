"""The KV cache of the model-free engine node: a fixed function of the tokens (``kv_content``
describes it), as torch tensors in the node's dtype, and what a node decodes after a prompt
computed from scratch (``reference_completion``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from .kv_content import EOS, ContextDigest, KVShape, Words, assemble, next_token, place

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
    comb = comb.view(len(layers), 2, len(heads), nb, bs).permute(0, 1, 3, 2, 4).unsqueeze(-1)
    out = (comb + _channels(shape.channels)) & _KEEP
    if nb * bs > n:
        out[:, :, -1, :, n - (nb - 1) * bs :, :] = 0
    return out


def reference_completion(shape: KVShape, ids: Sequence[int], max_tokens: int) -> list[int]:
    """What any node decodes after prompt ``ids`` (computed here, in one slice)."""
    layers, heads = range(shape.num_layers), range(shape.num_kv_heads)
    nb = shape.blocks_for(len(ids) + max_tokens)
    pool = torch.zeros(
        (len(layers), 2, nb, len(heads), shape.block_size, shape.channels), dtype=torch.int16
    )
    prompt = kv_blocks(shape, ids, layers, heads)
    pool[:, :, : prompt.shape[2]] = prompt
    words: Words = pool.numpy()
    blocks = list(range(nb))
    digest = ContextDigest(len(layers), len(heads))
    geometry = shape.geometry()
    # each KV-cache group hashes the blocks it holds (a sliding window's: from its first, 10.4.7)
    groups = list(
        zip(
            geometry.group_layers(layers),
            geometry.firsts(shape.blocks_for(len(ids))),
            strict=True,
        )
    )

    def update(start: int, end: int) -> None:
        for chosen, first in groups:
            digest.update(words, blocks[first:], start, end, chosen, first)

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
