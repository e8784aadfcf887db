"""Producer cases: the replies of a pull (§3.3, §3.4, §10.5, §10.6): one terminal reply and
nothing after it, CONTINUE for a round while requests still wait, consistent request lists and
codes."""

from __future__ import annotations

import asyncio
import re
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from typing import Any, Final

import msgspec

from pdwire import error_strings
from pdwire.codec import encode_response
from pdwire.messages import XferResponse, XferResponseStatus
from pdwire.versions import LEGACY

from ..case import case, expect, expect_equal
from ..peers.fake_d import Reply
from ..ports import free_port
from .producer_env import ProducerCtx

FINISH, CONTINUE = XferResponseStatus.FINISH, XferResponseStatus.CONTINUE
TERMINAL: Final = {FINISH, XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS}
LINGER: Final = 0.3  # how long to watch for anything after a terminal reply
ENGINE_RETURNED: Final = re.compile(
    re.escape(error_strings.ENGINE_RETURNED).replace(re.escape("{ret}"), "-?[0-9]+")
)
CODE_MESSAGES: Final = {
    "KV_GROUP_COUNT_MISMATCH": error_strings.KV_GROUP_COUNT_MISMATCH,
    "P_BLOCKS_LESS_THAN_D": error_strings.P_BLOCKS_LESS_THAN_D,
}


@case(
    "producer/3.4/5",
    "3.4-R14",
)
async def one_terminal_reply(t: ProducerCtx) -> None:
    """A served pull ends with exactly one terminal reply, and P sends nothing after it."""
    (tid,) = await t.ready(1)
    worker = t.worker(1, 0)
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    try:
        addrs = t.targets(worker)
        req = {d_req: (tid, [blocks])}
        results = await asyncio.gather(
            *(t.pull(worker, a, req, linger_after=LINGER) for a in addrs)
        )
        for addr, r in zip(addrs, results, strict=True):
            statuses = [reply.msg.status if reply.msg else None for reply in r.replies]
            terminal = [i for i, s in enumerate(statuses) if s in TERMINAL]
            expect(
                len(terminal) == 1 and terminal[0] == len(statuses) - 1,
                f"{addr}: expected one terminal reply, the last, got {r.describe()}",
            )
            t.expect_ok(worker, addr, r, d_req)
    finally:
        worker.give_back(blocks)


@case(
    "producer/10.5/1",
    "10.5.6",
    covers=("10.5.1", "3.4-R16", "3.4-R17", "3.1-R6", "10.4.6"),
)
async def continue_then_finish(t: ProducerCtx) -> None:
    """One pull names two transfers: the one ready first is served in a CONTINUE while the other
    still waits; the other, ready later, in the FINISH."""
    (first,) = await t.ready(1)
    second = t.new_transfer_id()
    worker = t.worker(1, 0)
    n = t.blocks_for()
    reqs = {t.new_d_req(): (first, [worker.take(n)]), t.new_d_req(): (second, [worker.take(n)])}
    d_first, d_second = list(reqs)
    addrs = t.targets(worker)
    continued = [asyncio.Event() for _ in addrs]

    def watch(i: int) -> Callable[[Reply], None]:
        def seen(reply: Reply) -> None:
            if reply.msg is not None and reply.msg.status is CONTINUE:
                continued[i].set()

        return seen

    pulls = [
        asyncio.create_task(t.pull(worker, a, reqs, on_reply=watch(i))) for i, a in enumerate(addrs)
    ]
    every: asyncio.Future[Any] = asyncio.ensure_future(
        asyncio.gather(*(e.wait() for e in continued))
    )
    try:
        # Until every P worker sent its CONTINUE, or a pull ended without one.
        waits: list[asyncio.Future[Any]] = [every, *pulls]
        await asyncio.wait(waits, timeout=t.options.request_timeout, return_when=FIRST_COMPLETED)
        expect(
            all(e.is_set() for e in continued),
            "not every P worker sent a CONTINUE for the ready transfer while the other one "
            "was not yet sent",
        )
        t.expect_leg_ok(await t.prefill(second))
        for addr, r in zip(addrs, await asyncio.gather(*pulls), strict=True):
            decoded = r.decoded()
            expect(
                [m.status for m in decoded] == [CONTINUE, FINISH],
                f"{addr}: expected CONTINUE then FINISH, got {r.describe()}",
            )
            expect_equal(
                (decoded[0].ok_reqs, decoded[1].ok_reqs),
                ([d_first], [d_second]),
                f"{addr}: ok_reqs of the CONTINUE and the FINISH",
            )
        for _, (_, groups) in reqs.items():
            t.expect_written(worker, groups[0])
    finally:
        every.cancel()
        for task in pulls:
            task.cancel()
        await asyncio.gather(every, *pulls, return_exceptions=True)
        for _, (_, groups) in reqs.items():
            worker.give_back(groups[0])


@case(
    "producer/3.4/6",
    "3.4-R23",
    covers=(
        "3.4-R24",
        "3.4-R26",
        "3.4-R9",
        "3.4-R10",
        "3.4-R2",
        "3.4-R16",
        "3.4-R17",
        "7.1-R1",
        "10.6.2",
        "10.6.4",
        "3.3-R4",
        "7.3-R1",
        "9.1-R6",
    ),
)
async def mixed_results_are_consistent(t: ProducerCtx) -> None:
    """A pull whose requests end differently (one served, one with a block list per KV-cache
    group too many, one asking for more blocks than P holds) gets a FINISH that lists each in
    ok_reqs or err_reqs, never both, with the verbatim message of each failure and, to a
    pdwire/2 D, err_codes for exactly the failed requests."""
    announce = t.env.p_version >= 2
    ok, groups, more = await t.ready(3)
    worker = t.worker(1, 0)
    n = t.blocks_for()
    taken = [worker.take(n), worker.take(n), worker.take(n + 1)]
    d_ok, d_groups, d_more = (t.new_d_req() for _ in range(3))
    reqs = {
        d_ok: (ok, [taken[0]]),
        d_groups: (groups, [taken[1], []]),
        d_more: (more, [taken[2]]),
    }
    try:
        addrs = t.targets(worker)
        results = await asyncio.gather(*(t.pull(worker, a, reqs, announce=announce) for a in addrs))
        for addr, r in zip(addrs, results, strict=True):
            undecodable = [reply.error for reply in r.replies if reply.msg is None]
            expect(not undecodable, f"{addr}: a reply breaks the rules of §3.4: {undecodable}")
            expect(r.status is FINISH, f"{addr}: expected FINISH, got {r.describe()}")
            for reply in r.decoded():
                both = set(reply.ok_reqs or ()) & set(reply.err_reqs or ())
                expect(not both, f"{addr}: {sorted(both)} both in ok_reqs and err_reqs")
                codes = set(reply.err_codes or {})
                expect(
                    codes <= set(reply.err_reqs or ()),
                    f"{addr}: err_codes names {sorted(codes - set(reply.err_reqs or ()))} "
                    "not in err_reqs",
                )
            expect_equal(sorted(r.ok()), [d_ok], f"{addr}: ok_reqs")
            expect_equal(sorted(r.err()), sorted([d_groups, d_more]), f"{addr}: err_reqs")
            final = r.terminal
            assert final is not None
            # 3.4-R2: the first error of the reply, or several joined by "; ", verbatim (7.1-R1).
            messages = (final.err_msg or "").split("; ")
            known = {error_strings.KV_GROUP_COUNT_MISMATCH, error_strings.P_BLOCKS_LESS_THAN_D}
            expect(
                bool(final.err_msg) and set(messages) <= known,
                f"{addr}: err_msg {final.err_msg!r} is not the failures' messages {sorted(known)}",
            )
            if announce:
                expect_equal(
                    final.err_codes,
                    {d_groups: "KV_GROUP_COUNT_MISMATCH", d_more: "P_BLOCKS_LESS_THAN_D"},
                    f"{addr}: err_codes",
                )
                expect(
                    final.err_code in CODE_MESSAGES
                    and CODE_MESSAGES[final.err_code] == messages[0],
                    f"{addr}: err_code {final.err_code!r} is not the code of the first error "
                    f"of err_msg {final.err_msg!r}",
                )
        t.expect_written(worker, taken[0])
    finally:
        for blocks in taken:
            worker.give_back(blocks)


def _plain(obj: Any) -> bool:
    """Whether ``obj``, generically decoded, holds only maps, arrays, str, int, bin and nil."""
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_plain(v) for v in obj)
    return obj is None or isinstance(obj, (str, bytes)) or type(obj) is int


@case(
    "producer/2.1/6",
    "2.1-R12",
    covers=("2.1-R1", "2.1-R10", "2.2-R4", "8.4-R1", "3.4-R6"),
)
async def legacy_replies_are_vllm_bytes(t: ProducerCtx) -> None:
    """Every reply to a legacy pull (FINISH, ERROR, LAYOUT_MISS) is one MessagePack map of
    XferResponse's field names, its status an integer, no float, bool or ext anywhere, and
    its bytes are exactly vLLM 0.33's encoding of its fields."""
    loaded = await t.load()
    t.release(loaded)
    replies = [reply for _, _, r in loaded.pulls for reply in r.replies]
    worker = t.worker(1, 0)
    bad = await t.send(t.addr(), msgspec.msgpack.encode({"remote_hostname": "x"}))
    miss = await t.pull(
        worker,
        t.addr(),
        {t.new_d_req(): (t.new_transfer_id(), [[0]])},
        with_layout=False,
        layout_id=1,
    )
    replies += bad.replies + miss.replies
    expect(len(replies) >= 3, f"expected replies of three pulls, got {len(replies)}")
    fields = set(XferResponse.__struct_fields__)
    for reply in replies:
        obj = msgspec.msgpack.decode(reply.data)
        expect(isinstance(obj, dict), f"a reply is not a map: {reply.data[:32].hex()}")
        expect(set(obj) <= fields, f"a reply has keys that are no fields: {set(obj) - fields}")
        expect(type(obj.get("status")) is int, f"status is not an integer: {obj.get('status')!r}")
        expect(_plain(obj), f"a reply holds a float, bool or ext: {obj!r}")
        assert reply.msg is not None
        vllm = encode_response(reply.msg, LEGACY)
        expect(
            reply.data == vllm,
            f"a {reply.msg.status.name} reply is not vLLM's encoding: {reply.data.hex()} "
            f"instead of {vllm.hex()}",
        )


@case(
    "producer/10.5/2",
    "10.5.4",
    covers=("7.1-R1", "3.4-R1", "10.3.4"),
    timeout=20.0,
)
async def failed_write_fails_the_round(t: ProducerCtx) -> None:
    """A round whose batch write fails (D's transfer-engine port is dead) fails its request with
    "Mooncake transfer engine returned {ret}" (and, to a pdwire/2 D, ENGINE_ERROR); the pull
    does not count, so a pull from a live D afterwards is served."""
    announce = t.env.p_version >= 2
    (tid,) = await t.ready(1)
    d_req = t.new_d_req()
    workers = t.d_workers()
    taken = {w: w.take(t.blocks_for()) for w in workers}
    dead = free_port()
    try:
        for w in workers:
            for addr in t.targets(w):
                req = {d_req: (tid, [taken[w]])}
                r = await t.pull(w, addr, req, announce=announce, remote_port=dead)
                expect(
                    r.status is FINISH and d_req in r.err() and not r.ok(),
                    f"{addr}: expected FINISH with {d_req} in err_reqs, got {r.describe()}",
                )
                assert r.terminal is not None
                expect(
                    ENGINE_RETURNED.fullmatch(r.terminal.err_msg or "") is not None,
                    f"{addr}: err_msg {r.terminal.err_msg!r} is not message #9",
                )
                if announce:
                    code = (r.terminal.err_codes or {}).get(d_req)
                    expect_equal(code, "ENGINE_ERROR", f"{addr}: err_codes[{d_req}]")
        for w in workers:
            for addr in t.targets(w):
                r = await t.pull(w, addr, {d_req: (tid, [taken[w]])})
                t.expect_ok(w, addr, r, d_req)
            t.expect_written(w, taken[w])
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)
