"""Producer cases on a write in flight: what P must not do while it writes into D's memory
(§3.5, §6.3, §10.9). The fake D names a write gate (``peers.write_gate``) as its engine, so
that P's write waits there, begun and not completed, until the case opens the gate."""

from __future__ import annotations

import asyncio
from typing import Final

from pdwire.messages import XferResponseStatus
from pdwire.versions import Capability

from ..case import case, expect
from ..peers.fake_d import DWorker, PullResult
from ..peers.write_gate import WriteGate
from .producer_env import ProducerCtx
from .producer_pairing import control, expect_slice
from .producer_timers import EXPIRED, SLACK, expect_failed
from .producer_v2 import QUICK

FINISH = XferResponseStatus.FINISH
#: How long the cancel case holds the write in flight, watching for P's answer to the cancel.
HOLD_S: Final = 1.0
#: The prompt of the prefill that would overwrite freed blocks, in prompts of the case: longer,
#: so that it takes the freed blocks even when some of lower ids were freed meanwhile.
OVERWRITE_PROMPTS: Final = 3


def gate(t: ProducerCtx) -> WriteGate:
    assert t.env.engine is not None
    return WriteGate(t.env.engine, t.log)


async def expect_held(g: WriteGate, pull: asyncio.Task[PullResult]) -> None:
    """P's write of ``pull`` has begun and waits at the gate, and P has not answered the pull."""
    began = await g.entered(QUICK + SLACK)
    so_far = pull.result().describe() if pull.done() else "no reply yet"
    expect(began, f"P began no write for a ready transfer within {QUICK + SLACK}s ({so_far})")
    expect_unanswered(pull, "as soon as its write began")


def expect_unanswered(pull: asyncio.Task[PullResult], when: str) -> None:
    """No reply to ``pull`` yet: its write is held in flight (3.4-R1)."""
    expect(
        not pull.done(),
        f"P answered the pull {when}, its write still in flight: "
        f"{pull.result().describe() if pull.done() else ''}",
    )


@case(
    "producer/3.5/4",
    "3.5-R10",
    covers=("3.4-R1",),
)
async def cancel_waits_for_the_write(t: ProducerCtx) -> None:
    """A cancel of a request whose write to this D worker is in flight is answered only once
    the write has completed: the gate holds P's write for 1 s, P answers neither the pull nor
    the cancel meanwhile, and once the gate opens the pull is served and the cancel answered
    FINISH."""
    t.require_cap(Capability.CANCEL)
    (tid,) = await t.ready(1)
    worker, addr = t.worker(1, 0), t.addr()
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    wait = HOLD_S + QUICK + SLACK
    try:
        async with gate(t) as g:
            req = {d_req: (tid, [blocks])}
            pull = asyncio.create_task(
                t.pull(worker, addr, req, announce=True, remote_port=g.port, timeout=wait)
            )
            await expect_held(g, pull)
            cancel = asyncio.create_task(
                t.cancel(worker, addr, {d_req: tid}, port=g.port, timeout=wait)
            )
            await asyncio.wait({cancel}, timeout=HOLD_S)
            if cancel.done():
                early = cancel.result()
                expect(
                    not early.replies,
                    f"P answered the cancel {early.replies[0].t:.2f}s after it, while its write "
                    f"of the request to this D worker was in flight: {early.describe()}",
                )
            expect_unanswered(pull, f"within {HOLD_S}s of the cancel")
            g.open()
            served, answer = await pull, await cancel
        t.expect_ok(worker, addr, served, d_req)
        t.expect_written(worker, blocks)
        expect(
            answer.status is FINISH,
            f"the cancel, once the write completed: expected FINISH, got {answer.describe()}",
        )
    finally:
        worker.give_back(blocks)


@case(
    "producer/6.3/2",
    "6.3-R1",
    covers=("10.9.2", "3.4-R1"),
    timeout=40.0,
)
async def no_expiry_while_writing(t: ProducerCtx) -> None:
    """A transfer whose write to the first of its two paired D ranks is held in flight past T
    does not expire meanwhile: a prefill of another prompt while the write is held does not
    change the bytes it writes (P kept its blocks), and the pull is served with a control
    transfer's bytes. The expiry then takes effect: the second D rank's pull gets EXPIRED."""
    t.require_pdwire2()
    due = t.abort_timeout
    prompt = t.prompt()
    full = await control(t, prompt)
    first, second = t.worker(2 * t.p_tp, 0), t.worker(2 * t.p_tp, 1)
    addr = t.addr()
    tid, d_req = t.new_transfer_id(), t.new_d_req()
    t.expect_leg_ok(await t.prefill(tid, prompt=prompt))
    taken: dict[DWorker, list[int]] = {}
    try:
        for w in (first, second):
            taken[w] = w.take(t.blocks_for(len(prompt)))
        async with gate(t) as g:
            req = {d_req: (tid, [taken[first]])}
            wait = due + 2 * SLACK + QUICK
            pull = asyncio.create_task(
                t.pull(first, addr, req, announce=True, remote_port=g.port, timeout=wait)
            )
            await expect_held(g, pull)
            await asyncio.sleep(due + SLACK)  # past P's expiry of the transfer: nothing to await
            expect_unanswered(pull, f"past its transfer's expiry ({due}s)")
            # P's engine writes nothing else while one write waits at the gate (a pull would
            # wait too): a prefill alone overwrites whatever blocks P freed.
            other = t.prompt(OVERWRITE_PROMPTS * len(prompt))
            t.expect_leg_ok(await t.prefill(t.new_transfer_id(), prompt=other))
            g.open()
            served = await pull
        t.expect_ok(first, addr, served, d_req)
        t.expect_written(first, taken[first])
        expect_slice(full, first, taken[first])
        late = await t.pull(
            second, addr, {d_req: (tid, [taken[second]])}, announce=True, timeout=QUICK + SLACK
        )
        what = "the other D rank's pull, once the held write completed"
        expect_failed(late, d_req, what, EXPIRED)
        untouched = len(second.unwritten(taken[second]))
        expect(
            untouched == len(second.regions) * len(taken[second]),
            "P wrote the KV of an expired transfer into the second D rank's blocks",
        )
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)
