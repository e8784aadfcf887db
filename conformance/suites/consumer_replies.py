"""Consumer cases: what D does with each kind of reply (§2.4, §3.4, §3.7, §10.10)."""

from __future__ import annotations

import json

import msgspec

from pdwire import error_strings
from pdwire.messages import ErrorCode, XferResponseStatus
from pdwire.versions import Capability

from ..case import Unsupported, expect, expect_equal
from ..peers.fake_p import Received
from .consumer_env import QUIET, ConsumerCtx, consumer_case

FINISH, CONTINUE = XferResponseStatus.FINISH, XferResponseStatus.CONTINUE
ERROR, LAYOUT_MISS = XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS
STRANGER = "no-such-request-of-d"


def _not_cached(rx: Received) -> str:
    assert rx.pull is not None
    return error_strings.LAYOUT_NOT_CACHED.format(
        layout_id=rx.pull.layout_id,
        remote_hostname=rx.pull.remote_hostname,
        remote_port=rx.pull.remote_port,
    )


@consumer_case(
    "consumer/3.4/1",
    "3.4-R19",
    covers=("3.4-R21",),
)
async def finish_that_omits_the_request(t: ConsumerCtx) -> None:
    """A FINISH that does not list the request (listing nothing, or only an id D never sent)
    fails it, though its bytes were written."""
    fake = await t.fake_p()
    for ok in ([], [STRANGER]):
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        fake.write(rx)
        await fake.reply(rx, ok=ok)
        t.expect_failed(await leg.result(), f"after FINISH with ok_reqs {ok}")


@consumer_case(
    "consumer/3.4/2",
    "3.4-R20",
    covers=("10.10.6",),
)
async def error_fails_the_request(t: ConsumerCtx) -> None:
    """ERROR fails every request of the pull, with or without err_msg, though bytes were
    written."""
    fake = await t.fake_p()
    for err_msg in ("the fake P failed this pull", None):
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        fake.write(rx)
        await fake.reply(rx, ERROR, err_msg=err_msg, err_code="INTERNAL")
        t.expect_failed(await leg.result(), f"after ERROR with err_msg {err_msg!r}")


@consumer_case(
    "consumer/3.4/3",
    "3.4-R21",
)
async def unknown_ids_are_ignored(t: ConsumerCtx) -> None:
    """D ignores ids a reply lists that are not pending in the pull: after a CONTINUE listing
    only strangers, a FINISH listing the request loads it."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    fake.write(rx)
    await fake.reply(rx, CONTINUE, ok=[STRANGER], err=[f"{STRANGER}-2"])
    await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)])
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/3.4/4",
    "3.4-R5",
    covers=("10.10.3",),
)
async def continue_then_finish(t: ConsumerCtx) -> None:
    """CONTINUE does not end a pull: after a CONTINUE without ok_reqs or err_reqs (read as
    empty) and one listing the request, an empty FINISH leaves it loaded."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    await fake.send_raw(
        rx, msgspec.msgpack.encode({"status": int(CONTINUE)}), "CONTINUE (no lists)"
    )
    fake.write(rx)
    await fake.reply(rx, CONTINUE, ok=[rx.d_req(leg.transfer_id)])
    await fake.reply(rx)
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/2.4/1",
    "2.4-R4",
    covers=("2.4-R5", "2.2-R3", "3.3-R1", "3.4-R25"),
)
async def undecodable_reply_fails(t: ConsumerCtx) -> None:
    """A reply D cannot decode fails the request even when it lists it ok: bytes that are not
    MessagePack, an unknown status, a request both ok and failed."""
    fake = await t.fake_p()
    for what in ("not MessagePack", "status 7", "both ok and failed"):
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        fake.write(rx)
        d_req = rx.d_req(leg.transfer_id)
        data = {
            "not MessagePack": b"\xc1\x91",
            "status 7": msgspec.msgpack.encode({"status": 7, "ok_reqs": [d_req], "err_reqs": []}),
            "both ok and failed": msgspec.msgpack.encode(
                {"status": int(FINISH), "ok_reqs": [d_req], "err_reqs": [d_req]}
            ),
        }[what]
        await fake.send_raw(rx, data, f"a reply D cannot decode: {what}")
        t.expect_failed(await leg.result(), f"after a reply that is {what}")


@consumer_case(
    "consumer/10.10/1",
    "10.10.4",
    covers=("10.10.6",),
    risk=1,
)
async def err_reqs_fail_the_request(t: ConsumerCtx) -> None:
    """A request P lists in err_reqs (here: P will not send its KV) fails at once, an HTTP error
    under the default load-failure policy."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    d_req = rx.d_req(leg.transfer_id)
    assert rx.pull is not None
    agreed = rx.announced and Capability.WILL_NOT_SEND in rx.pull.pdwire_caps
    codes = {d_req: "WILL_NOT_SEND"} if agreed else None
    await fake.reply(rx, err=[d_req], err_msg=error_strings.WILL_NOT_SEND, err_codes=codes)
    got = await leg.result()
    t.expect_failed(got)


@consumer_case(
    "consumer/3.7/1",
    "3.7-R7",
    covers=("3.7-R4", "3.1-R2"),
)
async def layout_miss_gets_the_layout(t: ConsumerCtx) -> None:
    """After LAYOUT_MISS to a pull that omitted its layout, D sends the same pull again with its
    layout, on a new socket, and the request loads."""
    fake = await t.fake_p()
    leg = t.start(fake)
    await t.serve_leg(fake, leg)
    t.expect_decoded(await leg.result())
    leg = t.start(fake)
    rx = await t.pull(fake)
    if rx.with_layout:
        await fake.serve(rx)
        await leg.result()
        raise Unsupported("D carried its layout though P had echoed it: no layout cache in use")
    await fake.reply(rx, LAYOUT_MISS, err_msg=_not_cached(rx), err_code="LAYOUT_MISS")
    again = await t.pull(fake, min(t.options.request_timeout, 3.0), what="pull sent again")
    assert again.pull is not None and rx.pull is not None
    expect(again.with_layout, "D sent the pull again after LAYOUT_MISS without its layout")
    expect(again.identity != rx.identity, "D sent the pull again on the same socket")
    expect_equal(again.pull.req_blocks, rx.pull.req_blocks, "req_blocks of the pull sent again")
    await fake.serve(again)
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/3.7/2",
    "3.7-R8",
)
async def layout_miss_to_a_full_pull_fails(t: ConsumerCtx) -> None:
    """LAYOUT_MISS to a pull that carried its layout fails the request, as ERROR would: D does
    not send the pull again."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    assert rx.pull is not None
    if not rx.pull.layout_id:
        await fake.serve(rx)
        await leg.result()
        raise Unsupported("D sends layout_id 0: a P never answers it LAYOUT_MISS (3.3-R2)")
    await fake.reply(rx, LAYOUT_MISS, err_msg=_not_cached(rx), err_code="LAYOUT_MISS")
    again = await fake.next(QUIET, lambda r: r.kind == "pull")
    expect(again is None, "D sent the pull again after LAYOUT_MISS to a pull with its layout")
    t.expect_failed(await leg.result())


@consumer_case(
    "consumer/7.1/1",
    "7.1-R2",
)
async def err_msg_decides_nothing(t: ConsumerCtx) -> None:
    """D decides by status and request lists, not by err_msg: a FINISH listing the request ok
    loads it, though its err_msg (about another request) reads like a failure."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    fake.write(rx)
    ok = [rx.d_req(leg.transfer_id)]
    await fake.reply(rx, ok=ok, err=[STRANGER], err_msg=error_strings.READY_TIMEOUT)
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/3.4/5",
    "3.4-R11",
    covers=("7.2-R1",),
)
async def code_of_a_failed_request(t: ConsumerCtx) -> None:
    """A pdwire/2 D takes a failed request's code from err_codes before err_code, and a code it
    does not know as INTERNAL (as far as its HTTP error shows codes)."""
    fake = await t.fake_p()
    for sent, want in (("EXPIRED", "EXPIRED"), ("A_CODE_FROM_A_LATER_VERSION", "INTERNAL")):
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        if not rx.announced:
            await fake.serve(rx)
            raise Unsupported("D does not announce pdwire/2: P sends it no codes")
        d_req = rx.d_req(leg.transfer_id)
        await fake.reply(
            rx, err=[d_req], err_msg="failed", err_code="ENGINE_ERROR", err_codes={d_req: sent}
        )
        got = await leg.result()
        t.expect_failed(got)
        text = json.dumps(got.body)
        shown = {c.value for c in ErrorCode if c.value in text}
        if not shown:
            raise Unsupported("D's HTTP error shows no error code")
        expect(
            shown == {want},
            f"for err_codes {sent!r} (err_code ENGINE_ERROR) D's error shows {sorted(shown)}, "
            f"not {want}",
        )
