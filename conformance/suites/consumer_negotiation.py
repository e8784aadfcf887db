"""Consumer cases: what D learns of P's version and what it may send it (§8)."""

from __future__ import annotations

from pdwire.versions import Capability

from ..case import Unsupported, expect
from ..peers.fake_p import DEFAULT_CAPS
from .consumer_env import ConsumerCtx, consumer_case
from .consumer_pull import V2_PULL_KEYS


@consumer_case(
    "consumer/8.2/1",
    "8.2-R3",
    covers=("8.3-R1",),
)
async def legacy_reply_makes_p_legacy(t: ConsumerCtx) -> None:
    """A D that announced to a P its /query entry shows as pdwire/2, and got a reply without
    pdwire_version, sends that P worker legacy pulls from then on."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    fake.write(rx)
    await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)], announce=False)
    t.expect_decoded(await leg.result())
    if not rx.announced:
        raise Unsupported("D does not announce pdwire/2 (a legacy D)")
    leg = t.start(fake)
    again = await t.pull(fake)
    await fake.serve(again)
    t.expect_decoded(await leg.result())
    extra = V2_PULL_KEYS & set(again.keys)
    expect(not extra, f"after P answered as legacy, D's next pull still carries {sorted(extra)}")


@consumer_case(
    "consumer/8.2/2",
    "8.2-R2",
    covers=("8.3-R1",),
)
async def reply_beats_query_entry(t: ConsumerCtx) -> None:
    """What a P worker's latest reply shows beats its /query entry: to a P registered as legacy
    that answered with pdwire_version 2, a pdwire/2 D announces in its next pull."""
    await t.require_pdwire2()
    fake = await t.fake_p(version=None)
    leg = t.start(fake)
    rx = await t.pull(fake)
    fake.write(rx)
    await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)], announce=True)
    t.expect_decoded(await leg.result())
    leg = t.start(fake)
    again = await t.pull(fake)
    await fake.serve(again)
    t.expect_decoded(await leg.result())
    expect(
        again.announced,
        "the P worker answered with pdwire_version 2, yet D's next pull does not announce",
    )


@consumer_case(
    "consumer/8.4/1",
    "8.4-R4",
    covers=("3.5-R1", "8.3-R3", "7.3-R2"),
    risk=10,
)
async def no_cancel_unless_agreed(t: ConsumerCtx) -> None:
    """D sends no XferCancel to a P that did not announce cancel, even when it gives up on a
    request at its deadline; a request whose deadline passed stays failed when P then answers
    ok."""
    offer = await t.d_announcement()
    fake = await t.fake_p(caps=DEFAULT_CAPS - {Capability.CANCEL})
    budget = 0.5
    leg = t.start(fake, deadline_ms=int(budget * 1000))
    rx = await t.pull(fake)
    cancel = await fake.next(budget + 0.6, lambda r: r.kind == "cancel")
    expect(cancel is None, f"D sent {cancel and cancel.describe()} to a P without cancel")
    fake.write(rx)
    await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)])
    got = await leg.result()
    if Capability.DEADLINE in offer.caps:
        t.expect_failed(got, "a request whose deadline passed before P answered")


@consumer_case(
    "consumer/8.1/1",
    "8.1-R2",
    covers=("8.2-R5",),
)
async def newer_p_gets_d_own_version(t: ConsumerCtx) -> None:
    """To a P that announces a later wire version (3) and a capability D does not know, a
    pdwire/2 D speaks pdwire/2: it announces its own version, and loads."""
    offer = await t.require_pdwire2()
    fake = await t.fake_p(version=3, caps=DEFAULT_CAPS | {"from-a-later-version"})
    for _ in range(2):  # the first pull knows P from /query, the second from P's reply too
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        await fake.serve(rx)
        t.expect_decoded(await leg.result())
        assert rx.pull is not None
        expect(
            rx.pull.pdwire_version == offer.version,
            f"to a P of version 3 D sent pdwire_version {rx.pull.pdwire_version}, not its own "
            f"{offer.version}",
        )
