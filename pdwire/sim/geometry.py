"""KV geometry of a model split over TP and PP: each worker's registered regions (LBHNC)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from ..messages import KV_LAYOUT_NAMES, Fingerprint
from ..planning import Region, Side, window_blocks

#: Where the simulated address spaces start; each worker region gets its own span.
_BASE: Final = 0x7F00_0000_0000
#: The values of ``--kv-layout`` (``Geometry.kv_layout``), and what each means.
KV_LAYOUTS: Final = tuple(KV_LAYOUT_NAMES)
KV_LAYOUT_HELP: Final = (
    "how a layer's KV blocks lie in memory: 'apart' (the default), K and V each a region of its "
    "own, as vLLM's FlashAttention backend lays them out; 'together', one region per layer whose "
    "blocks hold each head's tokens, a token's K then its V, as vLLM's CPU attention backend "
    "does; 'mla', one region per layer whose blocks hold each token's latent vector, the same on "
    "every TP rank, as vLLM's MLA backends do (give --kv-heads 1 and the latent size as "
    "--head-dim)"
)


@dataclasses.dataclass(frozen=True)
class Geometry:
    num_layers: int = 8
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype_bytes: int = 2
    num_blocks: int = 4096
    kernel_block_size: int | None = None  # the attention kernel's; None: block_size (10.6.6)
    #: tokens of the sliding window of the odd layers, which then form KV-cache group 1 (a
    #: hybrid model, as vLLM's hybrid KV-cache manager groups it); None: one group
    sliding_window: int | None = None
    #: the odd layers are state-space (Mamba) layers, KV-cache group 1: a request holds its
    #: state in one block, its list's other entries null-block placeholders (10.6.3)
    mamba: bool = False
    #: each block is one row holding every layer of the worker, K then V of each in turn; the
    #: regions are views into it (row offsets, §3.2), as in a packed MLA cache
    packed_rows: bool = False
    #: packed rows registered whole, one region a worker named after its first layer (an opaque
    #: packed row, 3.2-R10), shared by both KV-cache groups when there are two (10.6.7)
    opaque_rows: bool = False
    #: how a layer's blocks lie (``KV_LAYOUTS``): "apart", K and V regions of their own
    #: ([K/V, blocks, heads, tokens, channels], FlashAttention's); "together", one region whose
    #: blocks hold K and V, head-major, a token's K then its V ([blocks, heads, tokens, K and
    #: V], vLLM's CPU attention backend); "mla", one region whose blocks hold each token's
    #: latent vector of ``head_dim`` elements ([blocks, tokens, latent]), one KV "head" that
    #: every TP rank holds whole
    kv_layout: str = "apart"

    def __post_init__(self) -> None:
        kernel = self.kernel_block_size
        if kernel is not None and (kernel < 1 or self.block_size % kernel):
            raise ValueError(
                f"kernel_block_size must divide block_size {self.block_size}, got {kernel}"
            )
        window = self.sliding_window
        if window is not None and (window < 1 or self.num_layers < 2):
            raise ValueError(
                f"sliding_window needs at least 1 token and 2 layers, got {window} over "
                f"{self.num_layers} layers"
            )
        if self.mamba and (window is not None or kernel is not None or self.num_layers < 2):
            raise ValueError(
                "mamba needs 2 layers or more, and neither a sliding window nor a kernel block "
                "size (its group 1 would be two kinds at once)"
            )
        if self.packs_rows and kernel is not None:
            raise ValueError("packed rows take no kernel block size: a row is a whole block")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.packs_rows and self.kv_layout != "apart":
            raise ValueError(f"packed rows lay K and V out themselves: not {self.kv_layout!r}")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(
                f"an MLA cache has one latent vector per token: 1 KV head, got {self.num_kv_heads}"
            )

    @property
    def kv_together(self) -> bool:
        return self.kv_layout == "together"

    @property
    def mla(self) -> bool:
        return self.kv_layout == "mla"

    @property
    def num_groups(self) -> int:
        """KV-cache groups: 2 with a sliding window or state-space layers (its odd layers)."""
        return 2 if self.sliding_window is not None or self.mamba else 1

    @property
    def packs_rows(self) -> bool:
        """Whether a block is one row of every layer (``packed_rows`` or ``opaque_rows``)."""
        return self.packed_rows or self.opaque_rows

    @property
    def mamba_groups(self) -> frozenset[int]:
        return frozenset({1}) if self.mamba else frozenset()

    def group_of(self, layer: int) -> int:
        return layer % 2 if self.num_groups == 2 else 0

    def group_layers(self, layers: Sequence[int]) -> list[list[int]]:
        """Per KV-cache group, the positions in ``layers`` of the layers it holds."""
        return [
            [i for i, layer in enumerate(layers) if self.group_of(layer) == g]
            for g in range(self.num_groups)
        ]

    def firsts(self, prompt_blocks: int) -> list[int]:
        """Per group, the first of a prompt's blocks it keeps: all of them; in a sliding-window
        group the last ``ceil(window / block_size) + 1`` (10.4.7); in a state-space group the
        last, which holds the state."""
        if self.sliding_window is not None:
            kept = window_blocks(self.sliding_window, self.block_size)
        elif self.mamba:
            kept = 1
        else:
            return [0]
        return [0, max(0, prompt_blocks - kept)]

    @property
    def kernel_blocks(self) -> int:
        """Kernel blocks per block: a block id ``b`` stands for rows ``b*q ... b*q+q-1``."""
        return self.block_size // (self.kernel_block_size or self.block_size)

    def fingerprint(self, model: str) -> Fingerprint:
        """The compatibility fingerprint (§3.6) of ``model`` in this geometry, bf16, its layout
        named as §3.6.1 registers it."""
        return Fingerprint(
            model=model,
            dtype="bfloat16",
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            block_size=self.block_size,
            kv_layout=KV_LAYOUT_NAMES[self.kv_layout],
        )

    def block_bytes(self, tp_size: int) -> int:
        """Payload of one layer's K (or V) for one kernel block on one TP rank."""
        heads = max(1, self.num_kv_heads // tp_size)
        tokens = self.block_size // self.kernel_blocks
        return heads * self.head_dim * tokens * self.dtype_bytes

    def stage_layers(self, pp_size: int, pp_rank: int) -> range:
        per = -(-self.num_layers // pp_size)
        return range(pp_rank * per, min(self.num_layers, (pp_rank + 1) * per))

    def side(self, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int, worker: int) -> Side:
        """The regions of one worker: K and V of each layer of its PP stage, each a tensor of
        its own, or one region per layer (``kv_layout`` "together" or "mla"), or with
        ``packed_rows`` a slice of the worker's rows."""
        parts = 2 if self.kv_layout == "apart" else 1  # regions per layer
        length = self.block_bytes(tp_size) * (2 if self.kv_together else 1)
        span = length * self.num_blocks * self.kernel_blocks
        base = _BASE + worker * (parts * self.num_layers + 1) * span
        layers = self.stage_layers(pp_size, pp_rank)

        def region(i: int, layer: int, kv: int) -> Region:
            if self.packs_rows:  # slot 2i + kv of a row of every layer of the stage
                offset, stride, in_row = (2 * i + kv) * length, 2 * len(layers) * length, True
            else:
                offset, stride, in_row = (parts * layer + kv) * span, length, False
            return Region(
                layer_name=f"model.layers.{layer}.self_attn.attn",
                layer_index=layer,
                base_addr=base + offset,
                block_len=stride,
                kv_block_len=length,
                group_index=self.group_of(layer),
                row_offset=offset if in_row else -1,
            )

        regions = tuple(
            region(i, layer, kv) for i, layer in enumerate(layers) for kv in range(parts)
        )
        if self.opaque_rows:
            whole = regions[0].block_len
            shared = self.num_groups > 1
            regions = (
                dataclasses.replace(
                    regions[0],
                    kv_block_len=whole,
                    group_index=-1 if shared else 0,
                    shared_group_ids=tuple(range(self.num_groups)) if shared else (),
                ),
            )
        return Side(
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            regions=regions,
            replicated=tp_size > self.num_kv_heads,
            total_kv_heads=self.num_kv_heads,
            kernel_blocks=self.kernel_blocks,
            mamba_groups=self.mamba_groups,
        )
