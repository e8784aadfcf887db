"""Consumer cases: kv_transfer_params and D's timers (§3.1, §5.2, §6, §10.10)."""

from __future__ import annotations

import asyncio
import time

from pdwire import error_strings
from pdwire.messages import XferResponseStatus
from pdwire.versions import Capability

from ..case import Unsupported, expect, expect_equal
from ..peers.http import transfer_id
from .consumer_env import (
    DECODE_KEYS,
    OUTPUT_BODY,
    QUIET,
    ConsumerCtx,
    consumer_case,
    same_output,
)

FINISH = XferResponseStatus.FINISH
SLACK = 1.5  # how much later than its deadline D may give up
TEXT_TRIES = 8  # prompts tried for one whose local text is not empty


@consumer_case("consumer/5.2/1", "5.2-R2", breaks_testee=True)
async def incomplete_params_compute_locally(t: ConsumerCtx) -> None:
    """A D leg without remote_engine_id, remote_bootstrap_addr or transfer_id is computed by D
    itself: HTTP 200 with D's local text, and no query and no pull."""
    fake = await t.fake_p()
    prompt = t.prompt()
    local = await t.local(prompt)
    for key in DECODE_KEYS:
        got = await t.complete(prompt, t.params(fake, transfer_id(), drop=(key,)))
        t.expect_decoded(got, f"D, for a D leg without {key}")
        expect_equal(got.text(), local, f"D's text for a D leg without {key}")
    expect(not fake.queries, "D queried the bootstrap server for a request it must compute")
    expect(not fake.history, f"D sent {[rx.describe() for rx in fake.history[:1]]}")


@consumer_case(
    "consumer/5.2/2",
    "5.2-R5",
    covers=("4.4-R17", "10.10.3"),
)
async def decodes_from_the_loaded_kv(t: ConsumerCtx) -> None:
    """D decodes from the KV P wrote, not from its own prefill: given bytes that are not the
    prompt's KV (the fake P's random bytes), its text differs from its local text for the same
    prompt, which is exactly what a D that silently recomputed would give. Its generated token
    ids and their log probabilities (within a tolerance) are compared too where D returns them,
    and the prompt is one whose local output is not empty: a model that stops at once on it
    tells nothing."""
    for _ in range(TEXT_TRIES):
        prompt = t.prompt()
        local = await t.local_output(prompt)
        if local != ("", None, None):
            break
    else:
        raise Unsupported(
            f"D's own text is empty for {TEXT_TRIES} prompts and it returns no token ids: its "
            "output cannot tell KV it loaded from a recompute"
        )
    fake = await t.fake_p()
    leg = t.start(fake, prompt=prompt, body=dict(OUTPUT_BODY))
    rx = await t.pull(fake)
    expect(fake.write(rx) > 0, "the pull asks for no bytes")
    await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)])
    got = await leg.result()
    t.expect_decoded(got)
    expect(bool(fake.queries), f"D did not query the bootstrap server it was given, {fake.url}")
    expect(
        not same_output(got.output(), local),
        f"D's output {got.output()!r} (text, token ids, log probabilities) is its local output "
        f"{local!r} for the prompt, though P wrote other bytes: D did not decode from the KV it "
        "loaded (it recomputed the prompt)",
    )


DEADLINE_COVERS = ("6.3-R4", "10.11.3", "3.5-R1", "3.5-R2", "3.5-R3", "3.5-R4", "3.5-R17", "8.2-R1")


@consumer_case(
    "consumer/5.2/3",
    "5.2-R4",
    covers=(*DEADLINE_COVERS, "3.2-R17", "3.5-R5"),
    risk=6,
    timeout=15.0,
)
async def deadline_ms_bounds_the_wait(t: ConsumerCtx) -> None:
    """With deadline_ms in its D leg, D sends the time left until then as its pull's
    deadline_ms, and stops waiting for the KV at that deadline though P never answered: it
    withdraws the pull with an XferCancel on a new socket, and the request fails."""
    await t.require_pdwire2(Capability.DEADLINE, Capability.CANCEL)
    budget = 0.6
    fake = await t.fake_p()
    leg = t.start(fake, deadline_ms=int(budget * 1000))
    rx = await t.pull(fake)
    assert rx.pull is not None
    left_ms = (budget - (rx.t - leg.sent)) * 1000
    sent_ms = rx.pull.deadline_ms
    expect(
        0 < sent_ms <= min(budget * 1000, left_ms + DEADLINE_SLACK_MS),
        f"the pull's deadline_ms is {sent_ms}: at most the {left_ms:.0f} ms left of the "
        f"request's {budget * 1000:.0f} ms when it arrived",
    )
    d_req = rx.d_req(leg.transfer_id)
    left = budget + SLACK - (time.monotonic() - leg.sent)
    cancel = await t.pull(fake, max(0.1, left), kind="cancel", what="XferCancel")
    assert cancel.cancel is not None and rx.pull is not None
    expect(cancel.identity != rx.identity, "D sent its XferCancel on the pull's socket")
    expect(len(cancel.frames) == 2, f"the XferCancel came as {len(cancel.frames) - 1} frames")
    expect_equal(cancel.cancel.cancel_reqs, {d_req: leg.transfer_id}, "cancel_reqs")
    c, p = cancel.cancel, rx.pull
    expect(
        c.remote_tp_rank < c.remote_tp_size and c.remote_pp_rank < c.remote_pp_size,
        f"the cancel names TP rank {c.remote_tp_rank} of {c.remote_tp_size}, PP rank "
        f"{c.remote_pp_rank} of {c.remote_pp_size}",
    )
    expect_equal(
        (c.remote_hostname, c.remote_port, c.remote_tp_size, c.remote_tp_rank, c.remote_pp_size),
        (p.remote_hostname, p.remote_port, p.remote_tp_size, p.remote_tp_rank, p.remote_pp_size),
        "the cancel's remote_* fields (those of D's pull)",
    )
    done, _ = await asyncio.wait([leg.task], timeout=QUIET)
    expect(
        not done,
        "D answered the request (its blocks free again) before P confirmed the cancel, while "
        "P could still write into them",
    )
    await fake.reply(cancel, ok=[d_req])
    await fake.reply(
        rx, err=[d_req], err_msg=error_strings.CANCELLED, err_codes={d_req: "CANCELLED"}
    )
    got = await leg.result()
    t.expect_failed(got)
    took = time.monotonic() - leg.sent
    expect(took < budget + 2 * SLACK, f"D answered {took:.2f}s after a deadline of {budget}s")


#: How far a pull's deadline_ms may exceed the time left when it arrives (never the whole
#: budget): clocks are read at different moments on each side, and the D leg spends time on its
#: way to D, which a loaded machine makes longer.
DEADLINE_SLACK_MS = 250


@consumer_case(
    "consumer/3.1/2",
    "3.1-R9",
    covers=("3.1-R8",),
    timeout=900.0,
)
async def receive_timeout_fails_the_pull(t: ConsumerCtx) -> None:
    """A pull P never answers fails its request when D's receive timeout expires, and not
    before."""
    wait = t.receive_timeout
    fake = await t.fake_p(version=None)
    # A deadline past the receive timeout, so that only the receive timeout can end the pull.
    leg = t.start(fake, timeout=wait + 5.0, deadline_ms=int((wait + 30.0) * 1000))
    rx = await t.pull(fake)
    got = await leg.result()
    t.expect_failed(got, f"a pull unanswered for longer than the receive timeout of {wait}s")
    took = time.monotonic() - rx.t
    expect(took >= wait - 0.25, f"D gave up {took:.2f}s after its pull, before {wait}s")
    expect(took <= wait + 2.5, f"D gave up {took:.2f}s after its pull, its timeout is {wait}s")


@consumer_case(
    "consumer/6.3/1",
    "6.3-R6",
    covers=("10.11.3", "5.2-R4"),
    risk=6,
)
async def no_pull_after_the_deadline(t: ConsumerCtx) -> None:
    """A request whose deadline passes while D still asks the bootstrap server (a slow /query)
    fails by its deadline, and D sends no pull for it once P is known."""
    await t.require_pdwire2(Capability.DEADLINE)
    fake = await t.fake_p()
    fake.hold_query = 0.6
    budget = 0.25
    leg = t.start(fake, deadline_ms=int(budget * 1000))
    got = await leg.result()
    t.expect_failed(got, "a request whose deadline passed while D resolved P")
    took = time.monotonic() - leg.sent
    expect(took < budget + 2 * SLACK, f"D answered {took:.2f}s after a deadline of {budget}s")
    late = await t.quiet(fake, fake.hold_query + QUIET)
    expect(
        late is None,
        f"D pulled after the request's deadline had passed: {late and late.describe()}",
    )


#: As DEADLINE_SLACK_MS, for two requests sent at once: D may read the second one's deadline
#: that much after the harness sent it.
BATCH_SLACK_MS = 500


@consumer_case(
    "consumer/6.3/2",
    "6.3-R7",
    covers=("6.3-R4",),
    timeout=20.0,
)
async def one_pull_carries_the_latest_deadline(t: ConsumerCtx) -> None:
    """Two requests that wait together for P's slow /query, with deadlines of 1.5 s and 5 s:
    when D sends them in one pull, its deadline_ms is the time left until the later deadline,
    and D still withdraws the earlier request at its own deadline (an XferCancel naming it
    alone) and fails it, while the later one loads."""
    await t.require_pdwire2(Capability.DEADLINE, Capability.CANCEL)
    fake = await t.fake_p()
    fake.hold_query = 0.4
    early, late = 1.5, 5.0
    legs = [t.start(fake, deadline_ms=int(budget * 1000)) for budget in (early, late)]
    rx = await t.pull(fake)
    assert rx.pull is not None
    named = {tid for tid, _ in rx.pull.req_blocks.values()}
    if len(named) < 2:
        await t.serve_until_done(fake, legs)
        raise Unsupported("D sent the two requests in pulls of their own")
    first, second = (rx.d_req(leg.transfer_id) for leg in legs)
    early_left, late_left = (
        (budget - (rx.t - leg.sent)) * 1000 for budget, leg in zip((early, late), legs, strict=True)
    )
    sent_ms = rx.pull.deadline_ms
    # Bounds that hold however late D got each leg: a deadline_ms taken from the earlier
    # request is at most its whole budget; the later one's is at least what the harness saw
    # left of it, and at most its budget less the query D waited for before it could pull.
    most = (late - fake.hold_query) * 1000 + 100
    expect(
        early * 1000 < sent_ms and late_left - BATCH_SLACK_MS <= sent_ms <= most,
        f"the pull's deadline_ms is {sent_ms}: expected the {late_left:.0f} ms left until the "
        f"later deadline, not the {early_left:.0f} ms until the earlier one",
    )
    wait = max(0.1, early + SLACK - (time.monotonic() - legs[0].sent))
    cancel = await t.pull(fake, wait, kind="cancel", what="XferCancel at the earlier deadline")
    assert cancel.cancel is not None
    expect_equal(cancel.cancel.cancel_reqs, {first: legs[0].transfer_id}, "cancel_reqs")
    await fake.reply(cancel, ok=[first])
    t.expect_failed(await legs[0].result(), "the request past its deadline")
    took = time.monotonic() - legs[0].sent
    expect(took < early + 2 * SLACK, f"D answered {took:.2f}s after a deadline of {early}s")
    fake.write(rx, [second])
    await fake.reply(
        rx,
        ok=[second],
        err=[first],
        err_msg=error_strings.CANCELLED,
        err_codes={first: "CANCELLED"},
    )
    t.expect_decoded(await legs[1].result(), "the request whose deadline had not passed")


@consumer_case(
    "consumer/3.5/1",
    "3.5-R18",
    covers=("6.3-R4", "8.4-R6"),
    timeout=20.0,
)
async def no_cancel_to_a_legacy_p(t: ConsumerCtx) -> None:
    """A request whose deadline passes while its pull waits at a legacy P fails, and D sends that
    P no XferCancel (a legacy P cannot decode one). D may answer only once P can no longer write
    into the request's blocks: at the pull's receive timeout."""
    await t.require_pdwire2(Capability.DEADLINE)
    budget = 0.5
    wait = t.receive_timeout
    fake = await t.fake_p(version=None)
    leg = t.start(fake, deadline_ms=int(budget * 1000), timeout=wait + 2 * SLACK)
    rx = await t.pull(fake)
    got = await leg.result()
    t.expect_failed(got, "a request whose deadline passed while a legacy P held its pull")
    took = time.monotonic() - leg.sent
    expect(took < wait + 2 * SLACK, f"D answered {took:.2f}s after its request, past {wait}s")
    late = await t.quiet(fake, QUIET)
    expect(late is None, f"after the deadline D sent the legacy P {late and late.describe()}")
    expect(rx.pull is not None and not rx.announced, "D announced pdwire/2 to a legacy P")
