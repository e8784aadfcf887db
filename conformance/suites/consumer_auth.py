"""Consumer cases of authentication (§8.6), for a D that shares a key with the harness
(``--auth-key-file``; skipped without one). The fake P's then announce ``auth`` and sign their
pdwire/2 replies with the key unless a case says otherwise."""

from __future__ import annotations

import hmac

from pdwire import auth
from pdwire.versions import Capability

from ..case import expect, expect_equal
from .consumer_env import ConsumerCtx, consumer_case


@consumer_case(
    "consumer/8.6/1",
    "8.6-R5",
    covers=("3.2-R19", "8.6-R1", "8.6-R2", "8.6-R3", "8.6-R4", "8.6-R9"),
)
async def pulls_are_signed(t: ConsumerCtx) -> None:
    """A D with a key announces `auth` and signs every pull to a pdwire/2 P: its `auth_tag` is
    32 bytes, the HMAC-SHA256 of the pull's canonical encoding under the key."""
    key = t.auth_key
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    await fake.serve(rx)
    t.expect_decoded(await leg.result())
    pull = rx.pull
    assert pull is not None
    expect(Capability.AUTH in pull.pdwire_caps, f"D's pull announces {pull.pdwire_caps}")
    tag = pull.auth_tag
    expect(tag is not None, "D's pull carries no auth_tag")
    assert tag is not None
    expect_equal(len(tag), 32, "the length of auth_tag")
    expect(
        hmac.compare_digest(tag, auth.tag(pull, key)),
        "auth_tag of D's pull is not the tag of its canonical encoding under the shared key",
    )


@consumer_case(
    "consumer/8.6/2",
    "8.6-R8",
    covers=("8.6-R6",),
)
async def reply_with_a_bad_tag_fails_the_request(t: ConsumerCtx) -> None:
    """A FINISH listing the request, its bytes written, fails the request when its `auth_tag`
    is missing or is not the tag under the shared key: D does not trust the reply."""
    key = t.auth_key
    fake = await t.fake_p()
    for what, tag in (("without auth_tag", None), ("signed with another key", b"other")):
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        fake.write(rx)
        ok = [rx.d_req(leg.transfer_id)]
        if tag is None:
            await fake.reply(rx, ok=ok, auth_tag=None)
        else:
            unsigned = fake.response(rx, ok=ok)
            await fake.reply(rx, ok=ok, auth_tag=auth.tag(unsigned, tag + key))
        t.expect_failed(await leg.result(), f"after a FINISH {what}")
