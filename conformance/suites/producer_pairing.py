"""Producer cases: TP and PP pairing (§10.1, §10.2), completion counting (§10.3), block
selection (§10.6), region alignment (§10.7), byte placement (§10.8) and freeing (§10.9).

P's KV bytes are unknown to the harness, but they are a function of the prompt: a control
transfer of the same prompt to a D of P's own TP and PP (served at offset 0, §10.8.1) gives the
KV of every head of every layer, and every other D must receive exactly its slice of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Final

from pdwire import error_strings
from pdwire.messages import XferResponseStatus

from ..case import Skip, Unsupported, case, expect, expect_equal
from ..peers.fake_d import DWorker, PullResult
from .producer_env import Loaded, ProducerCtx, describe

FINISH, ERROR = XferResponseStatus.FINISH, XferResponseStatus.ERROR
Key = tuple[str, int]  # (layer name, occurrence of that name)
Full = dict[Key, list[bytes]]  # per region key: each block's bytes over every KV head
SHORT: Final = 1.0  # how long to wait for a reply that must not be a served one


def region_keys(worker: DWorker) -> list[Key]:
    seen: dict[str, int] = {}
    keys = []
    for r in worker.regions:
        keys.append((r.layer_name, seen.get(r.layer_name, 0)))
        seen[r.layer_name] = keys[-1][1] + 1
    return keys


def full_kv(loaded: Loaded) -> Full:
    """The bytes of a transfer loaded by a D of PP 1, its TP ranks' slices put together."""
    workers = sorted(loaded.blocks, key=lambda w: w.side.tp_rank)
    full: Full = {}
    for w in workers:
        for i, key in enumerate(region_keys(w)):
            parts = [w.block(i, b).tobytes() for b in loaded.blocks[w]]
            full[key] = [
                a + p for a, p in zip(full.get(key, [b""] * len(parts)), parts, strict=True)
            ]
    return full


async def control(t: ProducerCtx, prompt: list[int]) -> Full:
    """``prompt``'s KV, from a transfer to a D of P's TP and PP."""
    loaded = await t.load(prompt=prompt, d_pp=t.p_pp)
    try:
        t.expect_loaded(loaded)
        return full_kv(loaded)
    finally:
        t.release(loaded)


def expect_slice(
    full: Full, worker: DWorker, blocks: list[int], first: int = 0, only: set[Key] | None = None
) -> None:
    """Each block of ``worker`` holds its TP rank's share of the KV heads of the control's
    block ``first + j``, for the layers it holds (``only``: of these regions)."""
    s = worker.side
    # Ranks beyond the KV head count hold copies: TP is capped at the heads (10.8.9).
    shards = min(s.tp_size, worker.geometry.num_kv_heads)
    shard = s.tp_rank // (s.tp_size // shards)
    for i, key in enumerate(region_keys(worker)):
        if only is not None and key not in only:
            continue
        expect(key in full, f"{describe(worker)}: the control has no region {key}")
        for j, b in enumerate(blocks):
            whole = full[key][first + j]
            size = len(whole) // shards
            want = whole[shard * size : (shard + 1) * size]
            got = worker.block(i, b).tobytes()
            expect(
                got == want,
                f"{describe(worker)}: region {key} block {b} differs from the control's "
                f"block {first + j} slice ({sum(x != y for x, y in zip(got, want, strict=False))}"
                f" of {len(want)} bytes)",
            )


def expect_loaded_slices(t: ProducerCtx, loaded: Loaded, full: Full) -> None:
    t.expect_loaded(loaded)
    for w, blocks in loaded.blocks.items():
        expect_slice(full, w, blocks)


async def load_like_control(t: ProducerCtx, **load: Any) -> None:
    """A transfer of a new prompt (``load``: the D side's sizes and blocks): each D rank's
    blocks must hold its share of a control transfer's bytes."""
    prompt = t.prompt()
    full = await control(t, prompt)
    loaded = await t.load(prompt=prompt, **load)
    try:
        expect_loaded_slices(t, loaded, full)
    finally:
        t.release(loaded)


# -- TP ---------------------------------------------------------------------------------------


@case(
    "producer/10.8/1",
    "10.8.5",
    covers=("10.8.6", "10.8.12", "10.8.14", "10.1.3", "10.3.1", "9.2-R1", "3.6-R2"),
)
async def d_tp_larger(t: ProducerCtx) -> None:
    """A D of twice P's TP, announcing P's fingerprint where P speaks pdwire/2, gets on each
    rank its half of the paired P rank's heads."""
    await load_like_control(t, d_tp=2 * t.p_tp, announce=t.env.p_version >= 2)


@case(
    "producer/10.8/2",
    "10.8.3",
    covers=("10.8.4", "10.8.12", "10.8.14", "10.1.3", "10.3.1", "9.2-R1", "9.1-R3"),
)
async def d_tp_smaller(t: ProducerCtx) -> None:
    """A D of TP 1 gets every P rank's heads, each at its offset of D's block."""
    if t.p_tp == 1:
        raise Skip("P has TP 1: no D can have a smaller TP")
    await load_like_control(t, d_tp=1)


@case(
    "producer/10.8/6",
    "10.8.14",
    covers=("10.8.12",),
)
async def scattered_d_blocks(t: ProducerCtx) -> None:
    """D asks for every other one of its free blocks: each gets its own block's bytes, and the
    blocks between them stay untouched, whether or not P's own block ids are consecutive."""
    await load_like_control(t, scattered=True)


@case(
    "producer/10.8/4",
    "10.8.9",
    covers=("10.8.10", "10.8.5", "10.8.14", "10.3.1"),
)
async def d_tp_above_kv_heads(t: ProducerCtx) -> None:
    """A D whose TP is twice the model's KV heads (two D ranks hold each head) gets on each
    rank the one head it holds, placed per head."""
    d_tp = 2 * t.geometry.num_kv_heads
    if d_tp % t.p_tp or d_tp <= t.p_tp:
        raise Skip(f"a D of TP {d_tp} does not pair with a P of TP {t.p_tp}")
    await load_like_control(t, d_tp=d_tp)


async def pull_each(
    t: ProducerCtx, workers: list[DWorker], tid: str, d_req: str, taken: dict[DWorker, list[int]]
) -> None:
    """The pulls of ``workers`` for one request, each to its paired P workers; all served."""
    groups = await asyncio.gather(*(t.pull_to_targets(w, tid, d_req, taken[w]) for w in workers))
    for w, addr, r in (p for g in groups for p in g):
        t.expect_ok(w, addr, r, d_req)


async def churn(t: ProducerCtx) -> None:
    """Another transfer through P: blocks freed too early are reused and overwritten."""
    loaded = await t.load()
    t.release(loaded)


async def staged(
    t: ProducerCtx, workers: list[DWorker], first: list[DWorker], full: Full, prompt: list[int]
) -> None:
    """One transfer of ``prompt``: ``first`` pull, another transfer goes through P, then the
    other workers pull; every pull is served with the control's bytes."""
    tid, d_req = t.new_transfer_id(), t.new_d_req()
    t.expect_leg_ok(await t.prefill(tid, prompt=prompt))
    taken = {w: w.take(t.blocks_for(len(prompt))) for w in workers}
    try:
        await pull_each(t, first, tid, d_req, taken)
        await churn(t)
        await pull_each(t, [w for w in workers if w not in first], tid, d_req, taken)
        for w in workers:
            t.expect_written(w, taken[w])
            expect_slice(full, w, taken[w])
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


@case(
    "producer/10.3/1",
    "10.3.1",
    covers=("10.9.1", "10.3.3", "10.1.3", "10.4.3"),
)
async def every_paired_d_rank_is_served(t: ProducerCtx) -> None:
    """With D's TP twice P's, each P rank keeps its blocks until both of its D ranks pulled:
    the second pull, after another transfer went through P, is served with the same bytes as
    a control transfer of the same prompt."""
    prompt = t.prompt()
    full = await control(t, prompt)
    workers = t.d_workers(2 * t.p_tp)
    first = [w for w in workers if w.side.tp_rank % 2 == 0]
    await staged(t, workers, first, full, prompt)


# -- PP ---------------------------------------------------------------------------------------


@case(
    "producer/10.2/1",
    "10.2.7",
    covers=("10.7.6", "10.3.1", "9.2-R2"),
)
async def d_pp_larger(t: ProducerCtx) -> None:
    """A D with one stage more than P: each D stage pulls P and gets only the layers it holds,
    with the control's bytes."""
    await load_like_control(t, d_pp=t.p_pp + 1)


def written_regions(worker: DWorker, blocks: list[int]) -> tuple[set[Key], set[Key]]:
    """The regions of ``worker`` whose ``blocks`` were all written, and those written in part."""
    keys = region_keys(worker)
    unwritten: dict[int, int] = {}
    for region, _ in worker.unwritten(blocks):
        unwritten[region] = unwritten.get(region, 0) + 1
    whole = {k for i, k in enumerate(keys) if i not in unwritten}
    part = {k for i, k in enumerate(keys) if 0 < unwritten.get(i, 0) < len(blocks)}
    return whole, part


@case(
    "producer/10.2/3",
    "10.2.1",
    covers=("10.2.7", "10.3.1"),
)
async def each_p_stage_serves_its_own_layers(t: ProducerCtx) -> None:
    """With a P of several PP stages, a D of one stage pulls each stage into blocks of their
    own: each stage writes whole layers, no two stages the same one, all of them together
    every layer, with the bytes of a control transfer to a D of P's PP."""
    if t.p_pp < 2:
        raise Unsupported(f"P runs {t.p_pp} PP stage: the case needs a P of PP 2 or more")
    prompt = t.prompt()
    tid, d_req = t.new_transfer_id(), t.new_d_req()
    t.expect_leg_ok(await t.start_prefill(tid, prompt=prompt))
    n = t.blocks_for(len(prompt))
    staged: list[tuple[DWorker, list[int], set[Key]]] = []
    try:
        for worker in t.d_workers(t.p_tp, 1):
            owner: dict[Key, int] = {}
            for stage in range(t.p_pp):
                blocks = worker.take(n)
                staged.append((worker, blocks, set()))
                for addr in t.targets(worker, stage):
                    got = await t.pull(worker, addr, {d_req: (tid, [blocks])})
                    t.expect_ok(worker, addr, got, d_req)
                whole, part = written_regions(worker, blocks)
                expect(not part, f"P stage {stage} wrote only some blocks of {sorted(part)}")
                expect(bool(whole), f"P stage {stage} wrote no layer for {describe(worker)}")
                twice = {k: owner[k] for k in whole if k in owner}
                expect(
                    not twice,
                    f"P stage {stage} wrote the regions {sorted(twice)}, which the stages "
                    f"{sorted(set(twice.values()))} wrote too: a stage serves layers it does "
                    "not hold",
                )
                staged[-1][2].update(whole)
                owner.update(dict.fromkeys(whole, stage))
            missing = set(region_keys(worker)) - set(owner)
            expect(not missing, f"no P stage wrote the regions {sorted(missing)}")
        full = await control(t, prompt)
        for worker, blocks, whole in staged:
            expect_slice(full, worker, blocks, only=whole)
    finally:
        for worker, blocks, _ in staged:
            worker.give_back(blocks)


@case(
    "producer/10.8/5",
    "10.8.7",
    covers=("10.8.8", "10.3.1"),
)
async def replicas_write_once(t: ProducerCtx) -> None:
    """With P's KV replicated over its TP ranks (more ranks than KV heads), a D of TP 1 pulls
    each P rank into blocks of their own: the first rank of each replica group writes every
    region, the others answer the request in ok_reqs and write nothing."""
    heads = t.geometry.num_kv_heads
    if t.p_tp <= heads:
        raise Unsupported(
            f"P's {heads} KV heads over TP {t.p_tp} are not replicated: the case needs a P of "
            "more TP ranks than KV heads"
        )
    replicas = t.p_tp // heads
    prompt = t.prompt()
    tid, d_req = t.new_transfer_id(), t.new_d_req()
    t.expect_leg_ok(await t.start_prefill(tid, prompt=prompt))
    [worker] = t.d_workers(1)
    everything = set(region_keys(worker))
    taken: list[list[int]] = []
    try:
        for p_rank in range(t.p_tp):
            blocks = worker.take(t.blocks_for(len(prompt)))
            taken.append(blocks)
            addr = t.addr(p_rank)
            t.expect_ok(worker, addr, await t.pull(worker, addr, {d_req: (tid, [blocks])}), d_req)
            whole, part = written_regions(worker, blocks)
            if p_rank % replicas == 0:
                expect(
                    whole == everything and not part,
                    f"P rank {p_rank}, the first of its replica group, wrote {len(whole)} of "
                    f"the {len(everything)} regions whole (in part: {sorted(part)})",
                )
            else:
                expect(
                    not whole and not part,
                    f"P rank {p_rank} holds a replica of rank {p_rank - p_rank % replicas}'s KV "
                    f"and wrote it again, into the regions {sorted(whole | part)}",
                )
    finally:
        for blocks in taken:
            worker.give_back(blocks)


@case(
    "producer/10.3/2",
    "10.3.1",
    covers=("10.9.1", "10.2.7"),
    risk=5,
)
async def every_d_stage_is_served(t: ProducerCtx) -> None:
    """With a D of two stages (P of one), P keeps its blocks until both stages pulled: the
    second stage's pull, after another transfer went through P, is served with the control's
    bytes (heterogeneous PP counting, PR #56033)."""
    if t.p_pp != 1:
        raise Skip("this case pairs a D of PP 2 with a P of PP 1")
    prompt = t.prompt()
    full = await control(t, prompt)
    workers = t.d_workers(t.p_tp, 2)
    first = [w for w in workers if w.pp_rank == 0]
    await staged(t, workers, first, full, prompt)


# -- counting: release-only and failed pulls --------------------------------------------------


def served(r: PullResult, d_req: str) -> bool:
    return r.status is FINISH and d_req in r.ok()


@dataclasses.dataclass(frozen=True)
class HalfPulled:
    """A ready transfer that the even TP ranks of a fake D of twice P's TP have pulled."""

    transfer: str
    d_req: str
    others: list[DWorker]  # the odd ranks, which have not
    taken: dict[DWorker, list[int]]  # the blocks each even rank pulled into


@contextlib.asynccontextmanager
async def half_pulled(t: ProducerCtx) -> AsyncIterator[HalfPulled]:
    (tid,) = await t.ready(1)
    d_req = t.new_d_req()
    workers = t.d_workers(2 * t.p_tp)
    loading = [w for w in workers if w.side.tp_rank % 2 == 0]
    taken = {w: w.take(t.blocks_for()) for w in loading}
    try:
        await pull_each(t, loading, tid, d_req, taken)
        yield HalfPulled(tid, d_req, [w for w in workers if w not in loading], taken)
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


async def expect_settled(t: ProducerCtx, h: HalfPulled, timeout: float, after: str) -> None:
    """P has settled ``h``'s transfer: the first even rank's pull again is not served."""
    again, blocks = next(iter(h.taken.items()))
    for addr in t.targets(again):
        r = await t.pull(again, addr, {h.d_req: (h.transfer, [blocks])}, timeout=timeout)
        expect(not served(r, h.d_req), f"{addr}: served a pull after {after}")


@case(
    "producer/10.3/3",
    "10.3.3",
    covers=("10.9.3", "10.5.5", "3.2-R5", "10.6.1", "3.4-R1"),
    risk=11,
)
async def release_only_pull_counts(t: ProducerCtx) -> None:
    """A release-only pull (empty block lists) is answered ok and counts as served: once the
    other paired D rank pulled too, P drops the transfer, and a further pull is not served."""
    async with half_pulled(t) as h:
        pulls = (t.pull_to_targets(w, h.transfer, h.d_req, []) for w in h.others)
        for w, addr, r in (p for g in await asyncio.gather(*pulls) for p in g):
            t.expect_ok(w, addr, r, h.d_req)
            expect(w.stray_bytes() == 0, f"{describe(w)}: a release-only pull wrote bytes")
        await expect_settled(
            t, h, SHORT, "every paired D rank had pulled (a release-only pull was not counted)"
        )


@case(
    "producer/10.3/4",
    "10.3.4",
    covers=("10.6.4", "10.9.1"),
)
async def failed_request_does_not_count(t: ProducerCtx) -> None:
    """A pull that lists the request in err_reqs (it asked for more blocks than P holds) does
    not count as served: a correct pull afterwards is served."""
    (tid,) = await t.ready(1)
    d_req, n = t.new_d_req(), t.blocks_for()
    workers = t.d_workers()
    taken = {w: w.take(n + 1) for w in workers}
    try:
        for w in workers:
            for addr in t.targets(w):
                r = await t.pull(w, addr, {d_req: (tid, [taken[w]])})
                expect(
                    r.status is FINISH and d_req in r.err(),
                    f"{addr}: expected FINISH with {d_req} in err_reqs, got {r.describe()}",
                )
        fitting = {w: blocks[:n] for w, blocks in taken.items()}
        await pull_each(t, workers, tid, d_req, fitting)
        for w in workers:
            missing = w.unwritten(fitting[w])
            expect(not missing, f"{describe(w)}: never written: {missing[:8]}")
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


@case(
    "producer/10.3/5",
    "10.3.2",
)
async def first_ready_pull_fixes_the_count(t: ProducerCtx) -> None:
    """P counts the pulls it waits for from the first pull that finds the transfer ready: after
    a pull of a D of TP twice P's and two stages (four pulls for each P rank), a pull that
    claims a D of P's TP and one stage (one pull) does not make P drop the transfer, and a
    third pull is served."""
    if t.p_pp != 1:
        raise Skip("this case pairs a D of PP 2 with a P of PP 1")
    (tid,) = await t.ready(1)
    d_req = t.new_d_req()
    wide = t.d_workers(2 * t.p_tp, 2)
    first, narrow = wide[0], t.worker(t.p_tp, 0)
    same_p = [w for w in wide[1:] if t.targets(w) == t.targets(first)]
    assert t.targets(narrow) == t.targets(first)  # D rank 0 pairs with P rank 0 in either TP
    taken = {w: w.take(t.blocks_for()) for w in (*wide, narrow)}
    try:
        await pull_each(t, [first], tid, d_req, taken)
        await pull_each(t, [narrow], tid, d_req, taken)
        await pull_each(t, [same_p[0]], tid, d_req, taken)
        # The rest of the transfer: the last of P rank 0's four pulls, and P's other ranks'.
        rest = [same_p[1], *(w for w in wide if t.targets(w) != t.targets(first))]
        await pull_each(t, rest, tid, d_req, taken)
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


@case(
    "producer/10.9/1",
    "10.9.4",
    covers=("3.4-R22", "10.8.2", "7.1-R1", "3.3-R4", "10.4.1"),
)
async def error_reply_frees_nothing(t: ProducerCtx) -> None:
    """A pull answered ERROR (its region lengths do not fit: message #6b) lists nothing in
    ok_reqs and frees nothing: a correct pull afterwards is served."""
    (tid,) = await t.ready(1)
    d_req = t.new_d_req()
    workers = t.d_workers()
    taken = {w: w.take(t.blocks_for()) for w in workers}
    try:
        for w in workers:
            local = w.regions[0].kv_block_len  # P's too: the TP sizes are equal
            short = [r.kv_block_len - 2 for r in w.regions]
            for addr in t.targets(w):
                r = await t.pull(w, addr, {d_req: (tid, [taken[w]])}, kv_block_lens=short)
                expect(r.status is ERROR, f"{addr}: expected ERROR, got {r.describe()}")
                assert r.terminal is not None
                expect(not r.ok(), f"{addr}: an ERROR reply lists {r.ok()} in ok_reqs")
                want = error_strings.REGION_LENGTH_HOMOGENEOUS.format(
                    i=0, local=local, remote=local - 2
                )
                expect_equal(r.terminal.err_msg, want, f"{addr}: err_msg")
            expect(w.stray_bytes() == 0, f"{describe(w)}: an ERROR pull wrote bytes")
        await pull_each(t, workers, tid, d_req, taken)
        for w in workers:
            t.expect_written(w, taken[w])
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


# -- lengths and alignment --------------------------------------------------------------------


async def expect_error(
    t: ProducerCtx, worker: DWorker, what: str, message: str, **fields: Any
) -> None:
    """A pull of ``worker`` with ``fields`` overriding its layout gets ERROR with
    ``message``, from every P worker it pairs with."""
    req = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
    for addr in t.targets(worker):
        r = await t.pull(worker, addr, req, **fields)
        expect(r.status is ERROR, f"{what}, to {addr}: expected ERROR, got {r.describe()}")
        assert r.terminal is not None
        expect_equal(r.terminal.err_msg, message, f"{what}, to {addr}: err_msg")


@case(
    "producer/10.8/3",
    "10.8.11",
    covers=("10.8.4", "10.8.6", "7.1-R1", "3.3-R4", "9.1-R4", "7.1-R5"),
)
async def lengths_must_fit_the_tp_ratio(t: ProducerCtx) -> None:
    """With different TP sizes, region lengths that do not fit the ratio get ERROR with message
    #6c or #6d, and a D holding more regions of P's layers than P gets #6a."""
    if t.p_tp == 1:
        raise Skip("needs a P of TP 2 or more")
    small, big = t.worker(1, 0), t.worker(2 * t.p_tp, 0)
    p_len = small.regions[0].kv_block_len // t.p_tp
    ratio = t.p_tp
    bad = [r.kv_block_len - 2 for r in small.regions]
    await expect_error(
        t,
        small,
        "D TP 1, lengths not P's times the ratio",
        error_strings.REGION_LENGTH_PRODUCER_RATIO.format(
            i=0, local=p_len, remote=bad[0], tp_ratio=ratio
        ),
        kv_block_lens=bad,
    )
    bad = [r.kv_block_len - 2 for r in big.regions]
    await expect_error(
        t,
        big,
        "D TP 2x, lengths not P's over the ratio",
        error_strings.REGION_LENGTH_CONSUMER_RATIO.format(
            i=0, local=p_len, remote=bad[0], tp_ratio=-2
        ),
        kv_block_lens=bad,
    )
    layout = small.layout()
    extra = {k: [*v, v[0]] for k, v in layout.items()}  # one more region of P's first layer
    extra["kv_caches_base_addr"][-1] += small.regions[-1].block_len
    await expect_error(
        t,
        small,
        "D TP 1 with an extra region of a layer P holds",
        error_strings.ASYMMETRIC_REGION_COUNT,
        **extra,
    )


def permuted_layout(worker: DWorker) -> dict[str, Any]:
    """``worker``'s layout with its layers listed in reverse order (K before V in each)."""
    layout = worker.layout()
    keys = region_keys(worker)
    order = sorted(range(len(keys)), key=lambda i: (-worker.regions[i].layer_index, keys[i][1]))
    return {k: [v[i] for i in order] for k, v in layout.items()}


@case(
    "producer/10.7/1",
    "10.7.1",
    covers=("3.2-R7", "10.8.1"),
)
async def regions_align_by_name(t: ProducerCtx) -> None:
    """A D that lists its regions in another order than P's gets each layer's bytes in the
    region of that layer's name: P aligns by (layer name, occurrence), not by position."""
    prompt = t.prompt()
    full = await control(t, prompt)
    tid = t.new_transfer_id()
    t.expect_leg_ok(await t.prefill(tid, prompt=prompt))
    workers = t.d_workers()
    d_req = t.new_d_req()
    taken = {w: w.take(t.blocks_for(len(prompt))) for w in workers}
    try:
        for w in workers:
            for addr in t.targets(w):
                r = await t.pull(w, addr, {d_req: (tid, [taken[w]])}, **permuted_layout(w))
                t.expect_ok(w, addr, r, d_req)
            t.expect_written(w, taken[w])
            expect_slice(full, w, taken[w])
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


@case(
    "producer/10.7/2",
    "10.7.4",
    covers=("10.7.3", "10.7.5", "10.2.6", "7.1-R1", "3.3-R4", "9.1-R5", "9.1-R7"),
)
async def misaligned_regions_are_an_error(t: ProducerCtx) -> None:
    """Aligned regions that name different layer indices or KV-cache groups get ERROR with
    message #4b or #4c; with equal PP sizes, a P region D lacks gets #4a."""
    worker = t.worker()
    layout = worker.layout()
    name = worker.regions[0].layer_name
    indices = [layout["registered_layer_indices"][0] + 5, *layout["registered_layer_indices"][1:]]
    await expect_error(
        t,
        worker,
        "a layer index off by 5",
        error_strings.LAYER_INDEX_MISMATCH.format(
            layer_name=name, producer=indices[0] - 5, consumer=indices[0]
        ),
        registered_layer_indices=indices,
    )
    groups = [1, *layout["registered_group_indices"][1:]]
    await expect_error(
        t,
        worker,
        "a region in KV-cache group 1",
        error_strings.GROUP_INDEX_MISMATCH.format(layer_name=name, producer=0, consumer=1),
        registered_group_indices=groups,
    )
    # The last region only: D still holds every layer, so remote_pp_size 1 is right (10.11.11).
    last, occurrence = region_keys(worker)[-1]
    fewer = {k: v[:-1] for k, v in layout.items()}
    await expect_error(
        t,
        worker,
        f"no region {last} occurrence {occurrence}",
        error_strings.NO_MATCHING_OCCURRENCE.format(layer_name=last, occurrence=occurrence),
        **fewer,
    )


@case(
    "producer/10.6/1",
    "10.6.5",
    covers=("10.6.4",),
)
async def prefix_hit_gets_the_last_blocks(t: ProducerCtx) -> None:
    """A D that asks for fewer blocks than P holds (a prefix-cache hit) gets P's last ones."""
    prompt = t.prompt()
    full = await control(t, prompt)
    skip = 2
    loaded = await t.load(prompt=prompt, blocks=t.blocks_for(len(prompt)) - skip)
    try:
        t.expect_loaded(loaded)
        for w, blocks in loaded.blocks.items():
            expect_slice(full, w, blocks, first=skip)
    finally:
        t.release(loaded)
