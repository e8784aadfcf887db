"""Producer case: block ids that stand for several kernel blocks (§10.6.6)."""

from __future__ import annotations

from ..case import Unsupported, case
from .producer_env import ProducerCtx


@case(
    "producer/10.6/2",
    "10.6.6",
    covers=("10.8.12",),
)
async def block_ids_stand_for_kernel_blocks(t: ProducerCtx) -> None:
    """With q kernel blocks per block, each block D asks for, scattered over its memory, gets
    every one of its q rows written in every region, and nothing between them changes."""
    q = t.geometry.kernel_blocks
    if q == 1:
        raise Unsupported(
            "P's kernel block size is its block size (give --kernel-block-size when smaller)"
        )
    loaded = await t.load(scattered=True)
    try:
        t.expect_loaded(loaded)
    finally:
        t.release(loaded)
