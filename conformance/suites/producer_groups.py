"""Producer cases: a second KV-cache group, of sliding-window layers (§10.4.7: P keeps of a
prompt's blocks there only the last ``ceil(window / block_size) + 1``, and a D lists just those)
or of state-space layers (§10.6.3: one state block, after null-block placeholders); a region
both groups share (§10.6.7)."""

from __future__ import annotations

import numpy as np

from pdwire import error_strings
from pdwire.messages import XferResponseStatus
from pdwire.planning import NULL_BLOCK_ID, window_blocks

from ..case import Unsupported, case, expect, expect_equal
from ..peers.fake_d import SENTINEL, DWorker
from .producer_env import Loaded, ProducerCtx

FINISH = XferResponseStatus.FINISH


def _group_one_written(worker: DWorker, blocks: list[int]) -> list[tuple[int, int]]:
    """(region, block) pairs of group 1's regions among ``blocks`` that P wrote."""
    return [
        (i, b)
        for i, r in enumerate(worker.regions)
        if r.group_index == 1
        for b in blocks
        if not all(bool(np.all(row == SENTINEL)) for row in worker.rows(i, b))
    ]


def _expect_group_one_kept(loaded: Loaded, kept: int) -> None:
    """P wrote group 1's layers in none but the last ``kept`` blocks of each D worker."""
    for w, blocks in loaded.blocks.items():
        touched = _group_one_written(w, blocks[: len(blocks) - kept])
        expect(
            not touched,
            f"P wrote group 1's layers in blocks D did not list there (region, block): "
            f"{touched[:8]}",
        )


@case(
    "producer/10.4/4",
    "10.4.7",
    covers=("10.6.4",),
)
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
        _expect_group_one_kept(loaded, kept)
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


@case(
    "producer/10.6/3",
    "10.6.3",
)
async def state_space_null_blocks_are_placeholders(t: ProducerCtx) -> None:
    """With a KV-cache group of state-space layers, a D that lists there its state block after
    a null block (id 0) for each earlier block of the prompt gets the state written, and
    nothing in its null block or its other blocks of that group's layers; a D that lists more
    null blocks than P holds blocks there is served alike: P drops the null blocks of both
    sides before comparing the lists."""
    if not t.geometry.mamba:
        raise Unsupported(
            "P has no KV-cache group of state-space layers (give --mamba when its odd layers are)"
        )
    prompt = t.prompt()
    loaded = await t.load(prompt=prompt)
    try:
        t.expect_loaded(loaded)
        _expect_group_one_kept(loaded, 1)
    finally:
        t.release(loaded)
    tid, d_req = t.new_transfer_id(), t.new_d_req()
    t.expect_leg_ok(await t.prefill(tid, prompt=prompt))
    n = t.blocks_for(len(prompt))
    taken = {w: w.take(n) for w in t.d_workers()}
    try:
        for w, blocks in taken.items():
            lists = [blocks, [NULL_BLOCK_ID] * (n + 2) + blocks[-1:]]
            for addr in t.targets(w):
                t.expect_ok(w, addr, await t.pull(w, addr, {d_req: (tid, lists)}), d_req)
            t.expect_written(w, blocks)
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


@case(
    "producer/10.6/4",
    "10.6.7",
    covers=("10.7.3",),
)
async def shared_region_takes_every_group(t: ProducerCtx) -> None:
    """With a region P's two KV-cache groups share (group -1: a packed row registered whole), a
    D whose shared region lists other blocks for each group gets every one of them written,
    and nothing else of its memory: P takes the blocks of both groups together."""
    g = t.geometry
    if not (g.opaque_rows and g.num_groups == 2):
        raise Unsupported(
            "P has no region its KV-cache groups share (give --opaque-rows, and --sliding-window "
            "or --mamba, when its packed rows are registered whole and it has two groups)"
        )
    tid, d_req, prompt = t.new_transfer_id(), t.new_d_req(), t.prompt()
    t.expect_leg_ok(await t.prefill(tid, prompt=prompt))
    n = t.blocks_for(len(prompt))
    taken = {w: (w.take(n), w.take(n)) for w in t.d_workers()}
    try:
        for w, (first, second) in taken.items():
            lists = [first, w.group_lists(second)[1]]
            for addr in t.targets(w):
                t.expect_ok(w, addr, await t.pull(w, addr, {d_req: (tid, lists)}), d_req)
            asked = [b for ids in lists for b in ids if b != NULL_BLOCK_ID]
            missing = [b for b in asked if any(bool(np.all(r == SENTINEL)) for r in w.rows(0, b))]
            expect(not missing, f"blocks D listed that P did not write: {missing}")
            unasked = [b for b in second if b not in asked]
            touched = [b for b in unasked if not np.all(w.block(0, b) == SENTINEL)]
            expect(not touched, f"blocks D did not list that P wrote: {touched}")
            expect_equal(w.stray_bytes(), 0, "bytes written outside D's blocks")
    finally:
        for w, blocks in taken.items():
            w.give_back([*blocks[0], *blocks[1]])
