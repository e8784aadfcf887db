"""Pair cases: TP/PP pairing as observed, completion, and freeing (§10.1, §10.2, §10.9, §10.10).
The reference pair of ``pdwire conformance self`` is a P of TP 2 and a D of TP 1: each D pull
set covers both P ranks."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

from pdwire.planning import target_ranks

from ..case import Unsupported, case, expect
from ..peers.observer import DWorker, Worker
from .pair_env import PROMPTS, Exchange, PairCtx


def _pairing_problems(t: PairCtx, x: Exchange) -> list[str]:
    """How the pulls D sent for ``x`` differ from §10.1 and §10.2's."""
    p_tp, p_pp = t.env.p_tp, t.env.p_pp
    pulled: dict[DWorker, list[Worker]] = defaultdict(list)
    sizes: set[tuple[int, int]] = set()
    for rec, _ in t.pulls(x):
        assert rec.pull is not None and rec.d_worker is not None
        pulled[rec.d_worker].append(rec.worker)
        sizes.add((rec.pull.remote_tp_size, rec.pull.remote_pp_size))
    if len(sizes) != 1:
        return [f"D's pulls give D's (TP, PP) sizes as {sorted(sizes)}"]
    ((d_tp, d_pp),) = sizes
    try:
        pairs = {r: target_ranks(d_tp, r, p_tp) for r in range(d_tp)}
    except ValueError:
        return [f"D of TP {d_tp} pulled from P of TP {p_tp}: neither divides the other (10.1.1)"]
    problems = []
    for rank, tps in pairs.items():
        workers = [d for d in pulled if d[2] == rank]
        if len(workers) != d_pp:
            problems.append(f"{len(workers)} D worker(s) of TP rank {rank} pulled; D has PP {d_pp}")
        every = Counter((tp, pp) for tp in tps for pp in range(p_pp))
        if d_pp == p_pp:
            got = Counter(w for d in workers for w in pulled[d])
            per_worker = {d: len(pulled[d]) for d in workers if len(pulled[d]) != len(tps)}
            if per_worker:
                problems.append(f"D workers of TP rank {rank} pulled {per_worker} P workers each")
        else:
            got = Counter()
            for d in workers:
                if Counter(pulled[d]) != every:
                    problems.append(f"D worker {d} pulled {sorted(pulled[d])}")
                got += Counter(pulled[d])
            every = Counter({w: n * d_pp for w, n in every.items()})
        if got != every:
            problems.append(
                f"D TP rank {rank} (D TP {d_tp}, PP {d_pp}) pulled P workers "
                f"{sorted(got.elements())}, expected {sorted(every.elements())} "
                f"(P TP {p_tp}, PP {p_pp})"
            )
    return problems


@case(
    "pair/10.1/1",
    "10.1.2",
    covers=("10.1.5", "10.2.2", "10.2.3", "10.10.1", "4.2-R5", "4.2-R7", "9.2-R1"),
)
async def d_pulls_its_paired_p_workers(t: PairCtx) -> None:
    """For each request, each D worker pulls exactly the P workers it pairs with (§10.1, §10.2),
    once each: the D TP 1 of the reference pair pulls both ranks of its P TP 2. P's TP size comes
    from /query, with tp_size or (shown as legacy) from its worker_addr keys."""
    legacy = await t.new_view(legacy=True)
    exchanges = await asyncio.gather(
        *(t.exchange(t.body(p)) for p in PROMPTS[:2]),
        t.exchange(t.body(PROMPTS[2]), view=legacy),
    )
    for x in exchanges:
        t.expect_served(x)
        t.expect_pulled(x)
        problems = _pairing_problems(t, x)
        expect(not problems, f"transfer {x.transfer_id}: " + "; ".join(problems))


@case(
    "pair/10.10/1",
    "10.10.2",
    covers=("10.10.3", "10.10.4"),
)
async def d_waits_for_every_pull(t: PairCtx) -> None:
    """D decodes only once every pull of a request has settled: with the replies of one P worker
    held back 0.3 s, D's answer still comes after them."""
    delay = 0.3
    t.observer.delays[(t.env.p_tp - 1, t.env.p_pp - 1)] = delay
    t.log.note(
        f"the observer holds every reply of P worker {(t.env.p_tp - 1, t.env.p_pp - 1)} "
        f"back {delay}s"
    )
    x = await t.exchange(t.body(PROMPTS[1]))
    t.expect_served(x)
    pulls = t.expect_pulled(x)
    await t.observer.ended([rec for rec, _ in pulls], delay + t.options.request_timeout)
    for rec, _ in pulls:
        expect(rec.terminal_at is not None, f"the pull to P worker {rec.worker} never ended")
        assert rec.terminal_at is not None
        early = rec.terminal_at - x.d.done_at
        expect(
            early <= 0,
            f"D answered {early:.3f}s before P worker {rec.worker}'s terminal reply reached it",
        )


async def _held(t: PairCtx) -> tuple[int, int] | None:
    stats = await t.p_stats()
    if stats is None:
        return None
    return int(stats.get("transfers_held", 0)), int(stats.get("blocks_in_use", 0))


async def _until_idle(t: PairCtx, limit: float) -> tuple[int, int] | None:
    """P's (transfers held, blocks in use) once it holds no transfer, or the last seen after
    ``limit`` seconds. P has no way to say when it frees, so this polls its stats."""
    end = time.monotonic() + limit
    while True:
        held = await _held(t)
        if held is None or held[0] == 0 or time.monotonic() >= end:
            return held
        await asyncio.sleep(0.05)


@case(
    "pair/10.9/1",
    "10.9.3",
    covers=("10.9.1", "10.3.3"),
)
async def p_frees_once_served(t: PairCtx) -> None:
    """Once every pull of a transfer has been served, P frees its blocks (seen in P's
    /pdwire/stats; unsupported without that route)."""
    before = await _until_idle(t, 3.0)
    if before is None:
        raise Unsupported("P has no /pdwire/stats: what it holds cannot be seen")
    exchanges = await asyncio.gather(*(t.exchange(t.body(p)) for p in PROMPTS[:3]))
    for x in exchanges:
        t.expect_served(x)
        t.expect_pulled(x)
    after = await _until_idle(t, 2.0)
    assert after is not None
    expect(
        after[0] <= before[0] and after[1] <= before[1],
        f"2s after D answered every request, P still holds {after[0]} transfer(s) and "
        f"{after[1]} blocks (before: {before[0]} and {before[1]})",
    )
