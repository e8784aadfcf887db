"""Producer case: a KV-cache group with a sliding window (§10.4.7). P keeps of a prompt's blocks
in that group only the last ``ceil(window / block_size) + 1``, and a D lists just those."""

from __future__ import annotations

import numpy as np

from pdwire import error_strings
from pdwire.messages import XferResponseStatus
from pdwire.planning import window_blocks

from ..case import Unsupported, case, expect, expect_equal
from ..peers.fake_d import SENTINEL, DWorker
from .producer_env import Loaded, ProducerCtx

FINISH = XferResponseStatus.FINISH


def _window_rows_written(worker: DWorker, blocks: list[int]) -> list[tuple[int, int]]:
    """(region, block) pairs of the window group's regions among ``blocks`` that P wrote."""
    return [
        (i, b)
        for i, r in enumerate(worker.regions)
        if r.group_index == 1
        for b in blocks
        if not all(bool(np.all(row == SENTINEL)) for row in worker.rows(i, b))
    ]


def _expect_window_kept(loaded: Loaded, kept: int) -> None:
    for w, blocks in loaded.blocks.items():
        touched = _window_rows_written(w, blocks[: len(blocks) - kept])
        expect(
            not touched,
            f"P wrote the window group's layers in blocks D did not list there (region, block): "
            f"{touched[:8]}",
        )


@case("producer/10.4/4", "10.4.7", covers=("10.6.4",), caught_by=("window-unclipped",))
async def window_group_carries_its_last_blocks(t: ProducerCtx) -> None:
    """With a sliding-window KV-cache group, a D that lists every block of the prompt in the
    full-attention group and only the last ceil(window / block_size) + 1 in the window group
    gets each of them written, and nothing of the earlier blocks in the window group's layers;
    a D that lists every block in the window group too gets the request in err_reqs with
    message #8b: P kept fewer blocks there than D asks for."""
    g = t.geometry
    if g.sliding_window is None:
        raise Unsupported(
            "P has one KV-cache group (give --sliding-window when its odd layers have a "
            "sliding window)"
        )
    kept = window_blocks(g.sliding_window, g.block_size)
    prompt = t.prompt(max(t.options.prompt_tokens, (kept + 2) * g.block_size))
    loaded = await t.load(prompt=prompt)
    try:
        t.expect_loaded(loaded)
        _expect_window_kept(loaded, kept)
    finally:
        t.release(loaded)
    tid, d_req = t.new_transfer_id(), t.new_d_req()
    t.expect_leg_ok(await t.prefill(tid, prompt=prompt))
    taken = {w: w.take(t.blocks_for(len(prompt))) for w in t.d_workers()}
    try:
        for w, blocks in taken.items():
            for addr in t.targets(w):
                r = await t.pull(w, addr, {d_req: (tid, [blocks, blocks])})
                expect(
                    r.status is FINISH and d_req in r.err(),
                    f"every block listed in the window group too, to {addr}: expected FINISH "
                    f"with {d_req} in err_reqs, got {r.describe()}",
                )
                assert r.terminal is not None
                expect_equal(
                    r.terminal.err_msg, error_strings.P_BLOCKS_LESS_THAN_D, f"to {addr}: err_msg"
                )
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)
