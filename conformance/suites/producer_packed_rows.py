"""Producer case: opaque packed rows across PP sizes (§10.2.8). A whole packed row registered
under its first layer name hides the other layers it holds, so a P cannot align it with a D of
another PP size; with equal PP sizes the layer sets are aligned whole and it is served."""

from __future__ import annotations

from pdwire import error_strings

from ..case import case
from ..peers.fake_d import DWorker
from .producer_env import ProducerCtx
from .producer_pairing import expect_error


def first_region_packed(worker: DWorker) -> list[int]:
    """``worker``'s row offsets with its first region an opaque packed row (3.2-R10): offset 0,
    and the fake D's regions are whole rows (``kv_block_lens`` equal to ``block_lens``)."""
    region = worker.regions[0]
    assert region.kv_block_len == region.block_len, "a fake D region is a whole row"
    return [0] + [-1] * (len(worker.regions) - 1)


@case(
    "producer/10.2/2",
    "10.2.8",
    covers=("7.1-R1",),
    caught_by=("packed-rows-across-pp",),
)
async def packed_rows_across_pp_sizes(t: ProducerCtx) -> None:
    """A D of one PP stage more than P whose first region is an opaque packed row gets ERROR
    with message #2 from every P worker it pulls; the same layout from a D of P's PP size is
    served, every block written."""
    d_pp = t.p_pp + 1
    stage = t.worker(t.p_tp, 0, d_pp, 0)
    await expect_error(
        t,
        stage,
        f"an opaque packed row from a D of PP {d_pp}",
        error_strings.PP_PACKED_ROWS.format(p_pp_size=t.p_pp, d_pp_size=d_pp),
        registered_row_offsets=first_region_packed(stage),
    )
    workers = t.d_workers(d_pp=t.p_pp)
    offsets = {tuple(first_region_packed(w)) for w in workers}
    if len(offsets) == 1:
        loaded = await t.load(d_pp=t.p_pp, registered_row_offsets=list(offsets.pop()))
        try:
            t.expect_loaded(loaded)
        finally:
            t.release(loaded)
