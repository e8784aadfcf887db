"""Producer cases: the layout cache (§3.7) and the LAYOUT_MISS status (§3.3): a layout sent
with a nonzero layout_id is kept and echoed, a pull that omits it is served from the cache,
and a miss is answered with LAYOUT_MISS, only where a D can decode it."""

from __future__ import annotations

import asyncio
from typing import Any

from pdwire import error_strings
from pdwire.consumer import mint_layout_id
from pdwire.messages import XferResponseStatus

from ..case import case, expect, expect_equal
from ..peers.fake_d import DWorker
from .producer_env import ProducerCtx

FINISH, MISS = XferResponseStatus.FINISH, XferResponseStatus.LAYOUT_MISS
ERROR = XferResponseStatus.ERROR
#: A msgpack byte that no value begins with: a frame P cannot decode.
UNDECODABLE = b"\xc1"


def miss_message(worker: DWorker, layout_id: int) -> str:
    return error_strings.LAYOUT_NOT_CACHED.format(
        layout_id=layout_id,
        remote_hostname=worker.engine.hostname,
        remote_port=worker.engine.port,
    )


@case(
    "producer/3.7/1",
    "3.7-R11",
    covers=("3.7-R10", "3.4-R15", "3.4-R8", "7.1-R1", "3.3-R2", "7.1-R5"),
)
async def miss_for_unknown_layout(t: ProducerCtx) -> None:
    """A pull that omits its layout under a layout_id P never saw gets LAYOUT_MISS, its only
    reply, with message #3 (and, to a pdwire/2 D, err_code LAYOUT_MISS)."""
    worker = t.worker(1, 0)
    variants = [False, True] if t.env.p_version >= 2 else [False]
    ids = {announce: mint_layout_id() for announce in variants}
    results = await asyncio.gather(
        *(
            t.pull(
                worker,
                t.addr(),
                {t.new_d_req(): (t.new_transfer_id(), [[0]])},
                announce=announce,
                with_layout=False,
                layout_id=ids[announce],
                linger_after=0.2,
            )
            for announce in variants
        )
    )
    for announce, r in zip(variants, results, strict=True):
        what = "pdwire/2 pull" if announce else "legacy pull"
        expect(
            len(r.replies) == 1 and r.status is MISS,
            f"{what}: expected LAYOUT_MISS as the only reply, got {r.describe()}",
        )
        assert r.terminal is not None
        expect_equal(r.terminal.err_msg, miss_message(worker, ids[announce]), f"{what}: err_msg")
        if announce:
            expect_equal(r.terminal.err_code, "LAYOUT_MISS", f"{what}: err_code")


@case(
    "producer/3.3/1",
    "3.3-R2",
    covers=("8.4-R5", "9.3-R1", "3.7-R12"),
)
async def miss_only_to_layout_cache_users(t: ProducerCtx) -> None:
    """No LAYOUT_MISS to a pull with layout_id 0, even one without a layout (a vLLM 0.32 D
    cannot decode it), nor to one that carries its layout with a nonzero id (it is served)."""
    worker = t.worker(1, 0)
    r = await t.pull(
        worker, t.addr(), {t.new_d_req(): (t.new_transfer_id(), [[0]])}, with_layout=False
    )
    expect(
        r.terminal is not None and r.status is not MISS,
        f"a pull with layout_id 0 and no layout: expected a terminal reply other than "
        f"LAYOUT_MISS, got {r.describe()}",
    )
    await served_with_layout(t, worker, mint_layout_id())


async def served_with_layout(
    t: ProducerCtx, worker: DWorker, layout_id: int, *, with_layout: bool = True
) -> None:
    """A ready transfer pulled by ``worker`` from every P worker it pairs with, under
    ``layout_id``: served, and every FINISH echoes the id (3.4-R3)."""
    (tid,) = await t.ready(1)
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    try:
        addrs = t.targets(worker)
        req = {d_req: (tid, [blocks])}
        results = await asyncio.gather(
            *(t.pull(worker, a, req, with_layout=with_layout, layout_id=layout_id) for a in addrs)
        )
        how = "with" if with_layout else "without"
        for addr, r in zip(addrs, results, strict=True):
            t.expect_ok(worker, addr, r, d_req)
            assert r.terminal is not None
            expect_equal(
                r.terminal.layout_id, layout_id, f"{addr}: layout_id of the FINISH ({how} layout)"
            )
        t.expect_written(worker, blocks)
    finally:
        worker.give_back(blocks)


@case(
    "producer/3.7/2",
    "3.7-R12",
    covers=("3.7-R10", "3.4-R3", "3.2-R13", "3.3-R2"),
)
async def cached_layout_is_reused(t: ProducerCtx) -> None:
    """A layout sent with a nonzero layout_id is echoed and kept: a later pull that omits it
    under that id is served from the cache; a pull with layout_id 0 is echoed 0."""
    worker = t.worker(1, 0)
    layout_id = mint_layout_id()
    await served_with_layout(t, worker, layout_id)
    await served_with_layout(t, worker, layout_id, with_layout=False)
    await served_with_layout(t, worker, 0)


@case(
    "producer/3.7/4",
    "3.7-R16",
)
async def cache_outlives_errors(t: ProducerCtx) -> None:
    """Nothing but registering its own KV caches clears P's layout cache: after P answered
    ERROR to a pull it could not decode and to one whose layout it could not align (under
    another layout_id), a pull that omits the cached layout under its id is served."""
    worker = t.worker(1, 0)
    layout_id = mint_layout_id()
    await served_with_layout(t, worker, layout_id)
    misfit = [r.kv_block_len - 2 for r in worker.regions]
    for addr in t.targets(worker):
        undecodable = await t.send(addr, UNDECODABLE)
        expect(
            undecodable.status is ERROR,
            f"{addr}: a frame that is not msgpack: expected ERROR, got {undecodable.describe()}",
        )
        req = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
        misaligned = await t.pull(
            worker, addr, req, kv_block_lens=misfit, layout_id=mint_layout_id()
        )
        expect(
            misaligned.status is ERROR,
            f"{addr}: a layout whose region lengths do not fit: expected ERROR, "
            f"got {misaligned.describe()}",
        )
    await served_with_layout(t, worker, layout_id, with_layout=False)


@case(
    "producer/3.7/3",
    "3.7-R9",
    covers=("3.7-R11",),
)
async def cache_key_has_six_fields(t: ProducerCtx) -> None:
    """A cached layout is found only under its whole key: a pull that omits its layout and
    differs from the caching pull in remote_hostname, remote_port, remote_tp_rank,
    remote_pp_size, remote_tp_size or layout_id gets LAYOUT_MISS."""
    d_tp = 2 * t.p_tp  # so that two D TP ranks pair with P rank 0
    worker, other = t.worker(d_tp, 0), t.worker(d_tp, 1)
    layout_id = mint_layout_id()
    # The last pull of D rank 0 has a transfer of its own: a P that counts every pull it served
    # (vLLM, 10.3.3) would free the first after two pulls of D rank 0.
    tid, again = await t.ready(2)
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    d_again, blocks_again = t.new_d_req(), worker.take(t.blocks_for())
    other_blocks = other.take(t.blocks_for())
    other_again = other.take(t.blocks_for())
    addr = t.addr(0)
    try:
        first = await t.pull(worker, addr, {d_req: (tid, [blocks])}, layout_id=layout_id)
        t.expect_ok(worker, addr, first, d_req)
        e = worker.engine
        differing: dict[str, dict[str, Any]] = {
            "remote_hostname": {"remote_hostname": "127.0.0.254"},
            "remote_port": {"remote_port": e.port % 65535 + 1},
            "remote_tp_rank": {"remote_tp_rank": 1},
            "remote_pp_size": {"remote_pp_size": 2},
            "remote_tp_size": {"remote_tp_size": t.p_tp},
            "layout_id": {"layout_id": layout_id + 2},
        }
        results = await asyncio.gather(
            *(
                t.pull(
                    worker,
                    addr,
                    {t.new_d_req(): (tid, [blocks])},
                    with_layout=False,
                    **{"layout_id": layout_id, **fields},
                )
                for fields in differing.values()
            )
        )
        for (name, fields), r in zip(differing.items(), results, strict=True):
            expect(
                r.status is MISS,
                f"a pull without layout differing in {name}: expected LAYOUT_MISS, "
                f"got {r.describe()}",
            )
            host = str(fields.get("remote_hostname", e.hostname))
            port = int(fields.get("remote_port", e.port))
            lid = int(fields.get("layout_id", layout_id))
            want = error_strings.LAYOUT_NOT_CACHED.format(
                layout_id=lid, remote_hostname=host, remote_port=port
            )
            assert r.terminal is not None
            expect_equal(r.terminal.err_msg, want, f"{name}: err_msg")
        same = await t.pull(
            worker,
            addr,
            {d_again: (again, [blocks_again])},
            with_layout=False,
            layout_id=layout_id,
        )
        t.expect_ok(worker, addr, same, d_again)
        # D rank 1's pull settles both transfers on P rank 0.
        reqs = {d_req: (tid, [other_blocks]), d_again: (again, [other_again])}
        rest = await t.pull(other, addr, reqs)
        for d in reqs:
            t.expect_ok(other, addr, rest, d)
    finally:
        worker.give_back(blocks)
        worker.give_back(blocks_again)
        other.give_back(other_blocks)
        other.give_back(other_again)
