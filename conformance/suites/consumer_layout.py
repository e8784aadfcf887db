"""Consumer cases: D's ``layout_id`` over its life (§3.7): kept through sleep and wake, minted
anew at each start."""

from __future__ import annotations

import asyncio
import time
from typing import Final

from pdwire.messages import XferMetadata

from ..case import Unsupported, expect, expect_equal
from ..peers.fake_p import FakeP
from ..peers.http import request
from .consumer_env import ConsumerCtx, consumer_case

#: What D's API answers ``POST /sleep`` with when it has no sleep mode.
NO_SLEEP_MODE: Final = frozenset({404, 405, 501})
#: How long D may refuse to sleep (HTTP 409) while it winds down a request that has answered.
SLEEP_WAIT_S: Final = 5.0


async def _exchange(t: ConsumerCtx, fake: FakeP) -> XferMetadata:
    """One request loaded from ``fake``, whose FINISH echoes D's layout_id; D's pull."""
    leg = t.start(fake)
    rx = await t.pull(fake)
    await fake.serve(rx)
    t.expect_decoded(await leg.result())
    assert rx.pull is not None
    return rx.pull


async def _sleep_and_wake(t: ConsumerCtx) -> None:
    """Put D to sleep and wake it (vLLM's ``POST /sleep``, ``POST /wake_up``); unsupported when
    D's API has no sleep mode."""
    deadline = time.monotonic() + SLEEP_WAIT_S
    while True:
        slept = await request(t.env.http, "POST", f"{t.api}/sleep?level=1", t.log)
        if slept.status != 409 or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.2)  # D is still winding down: polling its API, nothing to await
    if slept.status in NO_SLEEP_MODE:
        raise Unsupported(
            f"D answers POST /sleep with HTTP {slept.status}: it has no sleep mode (vLLM has one "
            "with VLLM_SERVER_DEV_MODE=1)"
        )
    try:
        expect(slept.status == 200, f"POST /sleep to an idle D: HTTP {slept.status}")
    finally:
        woke = await request(t.env.http, "POST", f"{t.api}/wake_up", t.log)
    expect(woke.status == 200, f"POST /wake_up: HTTP {woke.status}")


def _layout_id_of(pull: XferMetadata) -> int:
    if not pull.layout_id:
        raise Unsupported("D sends layout_id 0: it does not use the layout cache (3.7-R1)")
    return pull.layout_id


@consumer_case(
    "consumer/3.7/3",
    "3.7-R3",
)
async def layout_id_kept_through_sleep(t: ConsumerCtx) -> None:
    """D put to sleep and woken registers the same memory again: while its layout keeps the
    same addresses, its pulls keep the same layout_id (a new one only for new addresses)."""
    fake = await t.fake_p()
    before = await _exchange(t, fake)
    layout_id = _layout_id_of(before)
    await _sleep_and_wake(t)
    after = await _exchange(t, fake)
    if after.kv_caches_base_addr and after.kv_caches_base_addr != before.kv_caches_base_addr:
        expect(
            after.layout_id != layout_id,
            f"D woke with its KV at new addresses but kept layout_id {layout_id:#x} (3.7-R2)",
        )
        t.log.note("D woke with its KV at new addresses, under a new layout_id")
        return
    expect_equal(after.layout_id, layout_id, "layout_id after sleep and wake")


@consumer_case(
    "consumer/3.7/4",
    "3.7-R2",
    covers=("3.7-R5",),
    timeout=300.0,  # two starts of D, each bounded by D_START_S
)
async def restart_mints_a_new_layout_id(t: ConsumerCtx) -> None:
    """A D started twice from the same command (the same engine id, where the command sets
    one) mints a new layout_id at its second start, and carries its layout in its first pull
    to a P worker that had echoed the old one."""
    fake = await t.fake_p()
    await t.own_d()
    layout_id = _layout_id_of(await _exchange(t, fake))
    await t.own_d()
    after = await _exchange(t, fake)
    expect(
        after.layout_id != layout_id,
        f"D restarted sent layout_id {layout_id:#x} again: it must mint a new one at each "
        "start (3.7-R2)",
    )
    expect(
        bool(after.kv_caches_base_addr),
        "D restarted omitted its layout in its first pull to a P worker that had echoed only "
        "its old layout_id (3.7-R5)",
    )
