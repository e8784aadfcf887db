"""What the model-free engine node computes instead of a model: words as token ids, a KV cache that
is a fixed function of the tokens, and "decoding" that hashes the KV bytes of the context.

- ``tokenize``: whitespace words, each mapped to an id in ``[0, vocab)`` by blake2b.
- ``kv_blocks``: the K and V of every (layer, KV head, position, channel) of a prompt, laid out in
  blocks as a worker's pool holds them (LBHNC). An element is a 16-bit pattern, viewed as the
  node's dtype: ``comb(token, position, layer, K/V, head) + chan(channel)`` modulo 2**16, with bit
  14 cleared (the top exponent bit of bf16 and fp16: no inf or NaN, every value below 2 in
  magnitude). ``comb`` and ``chan`` are hashes, so every element depends on all six indices.
  Slots past the prompt's end in its last block hold zeros.
- ``ContextDigest``: a streaming blake2b per (layer, K/V, head) row over the bytes of positions
  0..n-1. The next token is blake2b of every row's digest (in global row order) and the context
  length, modulo ``vocab``: a function of all the context's KV bytes, whatever the TP/PP split
  of the workers that hold them. A decoded token's KV is computed locally and appended.

So a D that loaded the prompt's KV from a P decodes exactly what a D that computed it decodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from pdwire.sim.geometry import Geometry

#: The stop token: a sequence ends when it is decoded (it is not part of the text).
EOS: Final = 0
DTYPES: Final[dict[str, torch.dtype]] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_M: Final = 2**31 - 1  # products of two residues stay below 2**62
_KEEP: Final = ~(1 << 14)  # clears bit 14: the top exponent bit of bf16 and fp16
_K = (0x5BD1E995, 0x1B873593, 0x6C8E9CF5, 0x2545F491, 0x3C6EF372, 0x68E31DA4, 0x4B4F5D7B)


@dataclasses.dataclass(frozen=True)
class KVShape:
    """The model's KV geometry (the seeds' Qwen3-8B by default) and the node's pool size."""

    num_layers: int = 36
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    vocab: int = 32000
    num_blocks: int = 512

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.vocab < 2:
            raise ValueError(f"vocab must be at least 2, got {self.vocab}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def geometry(self) -> Geometry:
        return Geometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype_bytes=2,
            num_blocks=self.num_blocks,
        )

    def check_split(self, tp_size: int, pp_size: int) -> None:
        """Raise ValueError unless TP divides the KV heads, or is a multiple of them (each head
        then replicated over TP / heads ranks, as vLLM does), and PP is at most the layers."""
        heads = self.num_kv_heads
        if tp_size < 1 or (heads % tp_size if tp_size <= heads else tp_size % heads):
            raise ValueError(
                f"TP {tp_size} must divide the {heads} KV heads, or be a multiple of them"
            )
        if pp_size < 1 or pp_size > self.num_layers:
            raise ValueError(f"PP {pp_size} must be between 1 and {self.num_layers} layers")

    def heads(self, tp_size: int, tp_rank: int) -> range:
        """The KV heads TP rank ``tp_rank`` holds: its share, or the one head it replicates."""
        if tp_size > self.num_kv_heads:
            head = tp_rank // (tp_size // self.num_kv_heads)
            return range(head, head + 1)
        per = self.num_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)

    def layers(self, pp_size: int, pp_rank: int) -> range:
        return self.geometry().stage_layers(pp_size, pp_rank)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


# -- text ------------------------------------------------------------------------------------


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def tokenize(text: str, vocab: int) -> list[int]:
    """Whitespace-separated words, each as a stable id in ``[0, vocab)``."""
    return [_hash64(word.encode()) % vocab for word in text.split()]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("text")
        )
    return "" if content is None else str(content)


def chat_prompt(messages: Iterable[dict[str, Any]]) -> str:
    """Chat messages as the prompt text: one ``role: content`` line each."""
    return "\n".join(
        f"{m.get('role', 'user')}: {_content_text(m.get('content'))}" for m in messages
    )


def render(ids: Sequence[int]) -> str:
    """Token ids as text: ``w123 w45 ...``."""
    return " ".join(f"w{i}" for i in ids)


# -- the KV function -------------------------------------------------------------------------


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
    return (comb.unsqueeze(-1) + _channels(shape.head_dim)) & _KEEP


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
    out = (comb + _channels(shape.head_dim)) & _KEEP
    if nb * bs > n:
        out[:, :, -1, :, n - (nb - 1) * bs :, :] = 0
    return out


def expected_blocks(
    shape: KVShape, ids: Sequence[int], tp_size: int, tp_rank: int, pp_size: int, pp_rank: int
) -> torch.Tensor:
    """The exact content of the blocks of worker (tp_rank, pp_rank) after the prompt ``ids``:
    [its layers, 2, blocks, its heads, block_size, head_dim] in the node's dtype."""
    layers, heads = shape.layers(pp_size, pp_rank), shape.heads(tp_size, tp_rank)
    return kv_blocks(shape, ids, layers, heads).view(shape.torch_dtype)


# -- decoding --------------------------------------------------------------------------------


Words = npt.NDArray[np.int16]


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(index in blocks, first block id, count)`` of each run of consecutive block ids."""
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield i, blocks[i], j - i
        i = j


class ContextDigest:
    """Streaming blake2b digests of the (layer, K/V, head) rows of one worker's slice."""

    def __init__(self, layers: int, heads: int) -> None:
        self._shape = (layers, 2, heads)
        self._rows = [hashlib.blake2b(digest_size=8) for _ in range(layers * 2 * heads)]

    def update(self, pool: Words, blocks: Sequence[int], start: int, end: int) -> None:
        """Hash positions ``[start, end)`` of the request, read from ``pool`` (int16
        [layers, 2, pool blocks, heads, block_size, channels]) through its ``blocks``."""
        bs = pool.shape[4]
        layers, _, heads = self._shape
        pos = start
        while pos < end:
            block, slot = blocks[pos // bs], pos % bs
            stop = min(end - pos, bs - slot) + slot
            rows = pool[:, :, block, :, slot:stop, :]
            for layer in range(layers):
                for kv in range(2):
                    for head in range(heads):
                        self._rows[(layer * 2 + kv) * heads + head].update(rows[layer, kv, head])
            pos += stop - slot

    def digests(self) -> bytes:
        """Every row's digest so far, [layers, 2, heads] x 8 bytes."""
        return b"".join(h.digest() for h in self._rows)


def assemble(shape: KVShape) -> npt.NDArray[np.uint8]:
    """An empty table of every row's digest of the model: [layers, 2, heads, 8]."""
    return np.zeros((shape.num_layers, 2, shape.num_kv_heads, 8), dtype=np.uint8)


def place(table: npt.NDArray[np.uint8], part: bytes, layers: range, heads: range) -> None:
    """Put a worker's ``ContextDigest.digests()`` into the model's table."""
    rows = np.frombuffer(part, dtype=np.uint8).reshape(len(layers), 2, len(heads), 8)
    table[layers.start : layers.stop, :, heads.start : heads.stop] = rows


def next_token(table: npt.NDArray[np.uint8], length: int, vocab: int) -> int:
    """The token after a context of ``length`` tokens whose row digests are ``table``."""
    return _hash64(table.tobytes() + length.to_bytes(8, "little")) % vocab


def reference_completion(shape: KVShape, ids: Sequence[int], max_tokens: int) -> list[int]:
    """What any node decodes after prompt ``ids`` (computed here, in one slice)."""
    layers, heads = range(shape.num_layers), range(shape.num_kv_heads)
    nb = shape.blocks_for(len(ids) + max_tokens)
    pool = torch.zeros(
        (len(layers), 2, nb, len(heads), shape.block_size, shape.head_dim), dtype=torch.int16
    )
    prompt = kv_blocks(shape, ids, layers, heads)
    pool[:, :, : prompt.shape[2]] = prompt
    words: Words = pool.numpy()
    blocks = list(range(nb))
    digest = ContextDigest(len(layers), len(heads))
    digest.update(words, blocks, 0, len(ids))
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
        digest.update(words, blocks, length, length + 1)
        length += 1
    return out
