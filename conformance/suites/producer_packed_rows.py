"""Producer cases: packed rows. A whole packed row registered under its first layer name (an
opaque one) hides the other layers it holds, so a P cannot align it with a D of another PP size;
with equal PP sizes the layer sets are aligned whole and it is served (§10.2.8). A slice of a
packed row stays a slice when a layer of its row was skipped (§10.7.8)."""

from __future__ import annotations

from collections.abc import Callable

from pdwire import error_strings

from ..case import Unsupported, case
from ..peers.fake_d import DWorker
from .producer_env import ProducerCtx
from .producer_pairing import expect_error, load_like_control


def first_region_packed(worker: DWorker) -> list[int]:
    """``worker``'s row offsets with its first region an opaque packed row (3.2-R10): offset 0,
    and the fake D's regions are whole rows (``kv_block_lens`` equal to ``block_lens``)."""
    region = worker.regions[0]
    assert region.kv_block_len == region.block_len, "a fake D region is a whole row"
    return [0] + [-1] * (len(worker.regions) - 1)


async def _expect_refused_across_pp(
    t: ProducerCtx, what: str, row_offsets: Callable[[DWorker], list[int]]
) -> None:
    """A pull of a D of one PP stage more than P, its row offsets ``row_offsets`` of it, gets
    ERROR with message #2 from every P worker it pulls."""
    d_pp = t.p_pp + 1
    stage = t.worker(t.p_tp, 0, d_pp, 0)
    await expect_error(
        t,
        stage,
        f"{what}, from a D of PP {d_pp}",
        error_strings.PP_PACKED_ROWS.format(p_pp_size=t.p_pp, d_pp_size=d_pp),
        registered_row_offsets=row_offsets(stage),
    )


@case(
    "producer/10.2/2",
    "10.2.8",
    covers=("7.1-R1",),
)
async def packed_rows_across_pp_sizes(t: ProducerCtx) -> None:
    """A D of one PP stage more than P whose first region is an opaque packed row gets ERROR
    with message #2 from every P worker it pulls; the same layout from a D of P's PP size is
    served, every block written."""
    await _expect_refused_across_pp(t, "an opaque packed row", first_region_packed)
    workers = t.d_workers(d_pp=t.p_pp)
    offsets = {tuple(first_region_packed(w)) for w in workers}
    if len(offsets) == 1:
        loaded = await t.load(d_pp=t.p_pp, registered_row_offsets=list(offsets.pop()))
        try:
            t.expect_loaded(loaded)
        finally:
            t.release(loaded)


@case(
    "producer/10.2/4",
    "10.2.8",
    covers=("7.1-R1",),
)
async def own_opaque_rows_across_pp_sizes(t: ProducerCtx) -> None:
    """A P whose packed rows are registered whole answers ERROR with message #2 to a D of one
    PP stage more, though D's own regions are no packed rows."""
    if not t.geometry.opaque_rows:
        raise Unsupported("P's rows are not registered whole (give --opaque-rows when they are)")
    await _expect_refused_across_pp(t, "no packed rows", lambda w: [-1] * len(w.regions))


@case(
    "producer/10.7/3",
    "10.7.8",
    covers=("10.7.6",),
)
async def packed_slices_are_not_widened(t: ProducerCtx) -> None:
    """With P's regions slices of packed rows, a D of one PP stage more than P, its rows packed
    too (each holding fewer layers than P's), gets each layer it holds in that layer's slice of
    its rows, with the control's bytes, and nothing past them: P does not widen a slice to its
    whole row when a layer of that row was skipped."""
    if not t.geometry.packed_rows:
        raise Unsupported(
            "P's regions are not slices of packed rows (give --packed-rows when they are)"
        )
    await load_like_control(t, d_pp=t.p_pp + 1)
