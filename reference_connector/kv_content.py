"""What the model-free engine node computes instead of a model: words as token ids, a KV cache that
is a fixed function of the tokens (``kv_values``), and "decoding" that hashes the KV bytes of the
context. This module needs no torch: a node's front process, which decodes, never loads it.

- ``tokenize``: whitespace words, each mapped to an id in ``[0, vocab)`` by blake2b.
- ``kv_values.kv_blocks``: the K and V of every (layer, KV head, position, channel) of a prompt,
  laid out in blocks as a worker's pool holds them (LBHNC). An element is a 16-bit pattern,
  viewed as the node's dtype: ``comb(token, position, layer, K/V, head) + chan(channel)`` modulo
  2**16, with bit 14 cleared (the top exponent bit of bf16 and fp16: no inf or NaN, every value
  below 2 in magnitude). ``comb`` and ``chan`` are hashes, so every element depends on all six
  indices. Slots past the prompt's end in its last block hold zeros.
- ``kv_values.ContextDigest``: a digest per (layer, K/V, head) row of every byte of positions
  0..n-1, updated as positions arrive. The next token is blake2b of every row's digest (in
  global row order) and the context length, modulo ``vocab``: a function of all the context's
  KV bytes, whatever the TP/PP split of the workers that hold them. A decoded token's KV is
  computed locally and appended.

So a D that loaded the prompt's KV from a P decodes exactly what a D that computed it decodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from pdwire.planning import NULL_BLOCK_ID
from pdwire.sim.geometry import Geometry

if TYPE_CHECKING:
    import torch

#: The stop token: a sequence ends when it is decoded (it is not part of the text).
EOS: Final = 0
DTYPES: Final = ("bfloat16", "float16")  # both two bytes wide


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
    kernel_block_size: int | None = None  # the pool's rows, when smaller than a block (10.6.6)
    sliding_window: int | None = None  # the odd layers' window: KV-cache group 1 (10.4.7)
    mamba: bool = False  # the odd layers are state-space layers: KV-cache group 1 (10.6.3)
    packed_rows: bool = False  # a block is one row of every layer, the regions views into it
    opaque_rows: bool = False  # packed rows registered whole (10.2.8), shared by groups (10.6.7)
    kv_layout: str = "apart"  # how a layer's blocks lie (``Geometry.kv_layout``)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.vocab < 2:
            raise ValueError(f"vocab must be at least 2, got {self.vocab}")
        if self.kv_layout == "mla" and self.head_dim % 2:
            raise ValueError(f"an MLA latent here has an even size, got {self.head_dim}")
        self.geometry()  # checks kernel_block_size and the layout

    @property
    def kv_together(self) -> bool:
        return self.kv_layout == "together"

    @property
    def channels(self) -> int:
        """Channels of a K (or V) row of the node's KV: an MLA latent of ``head_dim`` elements
        is held as a token's K then its V, of half as many each (the "together" layout of one
        head, byte for byte the latent's)."""
        return self.head_dim // 2 if self.kv_layout == "mla" else self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: the node's front process never loads torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def geometry(self) -> Geometry:
        return Geometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype_bytes=2,
            num_blocks=self.num_blocks,
            kernel_block_size=self.kernel_block_size,
            sliding_window=self.sliding_window,
            mamba=self.mamba,
            packed_rows=self.packed_rows,
            opaque_rows=self.opaque_rows,
            kv_layout=self.kv_layout,
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

    def table_sizes(self, prompt_tokens: int, tokens: int) -> tuple[list[int], list[int]]:
        """(blocks per KV-cache group, each group's first block) of a request of
        ``prompt_tokens`` that may grow to ``tokens``: a sliding-window or state-space group
        holds only the prompt's last blocks it keeps (10.4.7, 10.6.3), and every block after
        them."""
        firsts = self.geometry().firsts(self.blocks_for(prompt_tokens))
        return [self.blocks_for(tokens) - f for f in firsts], firsts


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """A request's block ids per KV-cache group. ``firsts[g]``: which of the request's blocks
    group ``g``'s first id holds (0, or the first block a sliding-window or state-space group
    kept)."""

    ids: tuple[tuple[int, ...], ...]
    firsts: tuple[int, ...]

    @classmethod
    def split(cls, ids: Sequence[int], sizes: Sequence[int], firsts: Sequence[int]) -> BlockTable:
        """``ids`` cut into groups of ``sizes``, in group order."""
        cuts = list(itertools.accumulate(sizes, initial=0))
        groups = tuple(tuple(ids[a:b]) for a, b in itertools.pairwise(cuts))
        return cls(groups, tuple(firsts))

    @classmethod
    def empty(cls, groups: int) -> BlockTable:
        return cls(((),) * groups, (0,) * groups)

    def all(self) -> list[int]:
        return [b for group in self.ids for b in group]

    def lists(self, placeholders: frozenset[int] = frozenset()) -> list[list[int]]:
        """The per-group lists a transfer carries; in the ``placeholders`` groups (state-space
        ones) each block before the group's first is a null block (10.6.3)."""
        out = []
        for g, (group, first) in enumerate(zip(self.ids, self.firsts, strict=True)):
            nulls = first if g in placeholders else 0
            out.append([NULL_BLOCK_ID] * nulls + list(group))
        return out

    def upto(self, blocks: int) -> BlockTable:
        """The ids of the request's first ``blocks`` blocks (its prompt's, say)."""
        return BlockTable(
            tuple(g[: max(0, blocks - f)] for g, f in zip(self.ids, self.firsts, strict=True)),
            self.firsts,
        )


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


# -- decoding --------------------------------------------------------------------------------


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(index in blocks, first block id, count)`` of each run of consecutive block ids."""
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield i, blocks[i], j - i
        i = j


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
