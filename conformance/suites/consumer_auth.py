"""Consumer cases of authentication (§8.6), for a D that shares a key with the harness
(``--auth-key-file``; skipped without one). The fake P's then announce ``auth`` and sign their
pdwire/2 replies with the key unless a case says otherwise."""

from __future__ import annotations

import hmac
from collections.abc import Callable

import msgspec

from pdwire import auth
from pdwire.messages import XferResponseV2
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
    covers=("8.6-R6", "8.6-R13", "8.6-R16"),
)
async def reply_with_a_bad_tag_fails_the_request(t: ConsumerCtx) -> None:
    """A FINISH listing the request, its bytes written, fails the request when its `auth_tag`
    is missing, is not the tag under the shared key, does not cover the pull's tag (a reply
    recorded on another pull), or is right but the reply names no key by `auth_key_id`: D does
    not trust the reply."""
    key = t.auth_key
    fake = await t.fake_p()
    other = b"other" + key
    bad_tags: tuple[tuple[str, Callable[[XferResponseV2, bytes], XferResponseV2]], ...] = (
        ("without auth_tag", lambda reply, pull_tag: reply),
        ("with a wrong tag", lambda reply, pull_tag: _wrong_tag(reply, key, other, pull_tag)),
        ("signed without the pull's tag", lambda reply, pull_tag: auth.sign(reply, key)),
        ("naming no key by its id", lambda reply, pull_tag: _unnamed(reply, key, pull_tag)),
    )
    for what, bad in bad_tags:
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        fake.write(rx)
        ok = [rx.d_req(leg.transfer_id)]
        reply = bad(fake.response(rx, ok=ok, auth_tag=None), rx.auth_tag or b"")
        await fake.reply(rx, ok=ok, auth_tag=reply.auth_tag, auth_key_id=reply.auth_key_id)
        t.expect_failed(await leg.result(), f"after a FINISH {what}")


def _wrong_tag(reply: XferResponseV2, key: bytes, other: bytes, pull_tag: bytes) -> XferResponseV2:
    """``reply`` naming ``key`` by its id, with the tag ``other`` makes."""
    signed = auth.sign(reply, other, pull_tag)
    return msgspec.structs.replace(signed, auth_key_id=auth.key_id(key))


def _unnamed(reply: XferResponseV2, key: bytes, pull_tag: bytes) -> XferResponseV2:
    """``reply`` with a right tag under ``key`` but no ``auth_key_id`` (8.6-R16)."""
    return msgspec.structs.replace(reply, auth_tag=auth.tag(reply, key, pull_tag))


@consumer_case("consumer/8.6/3", "8.6-R14", covers=("8.6-R5",))
async def keyed_d_never_speaks_legacy(t: ConsumerCtx) -> None:
    """A D with a key, sent to a P whose /query entry and replies say legacy, still announces
    pdwire/2 and signs its pull, and fails the request on P's unsigned FINISH though P wrote
    the bytes: nothing on the path can talk it down to a profile with no tag."""
    key = t.auth_key
    fake = await t.fake_p(version=None)
    leg = t.start(fake)
    rx = await t.pull_of(fake, leg)
    pull = rx.pull
    assert pull is not None
    expect(rx.announced, "D sent a legacy pull, which carries no tag, to a legacy P")
    expect(
        pull.auth_tag is not None and hmac.compare_digest(pull.auth_tag, auth.tag(pull, key)),
        "D's pull to a legacy P is not signed under the shared key",
    )
    fake.write(rx)
    await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)], announce=False)
    t.expect_failed(await leg.result(), "after a legacy, unsigned FINISH")
