"""Producer cases: the pull and its replies, as a D sees them (§3.1, §3.4, §5.3, §10.4, §10.5)."""

from __future__ import annotations

import msgspec

from pdwire import error_strings
from pdwire.messages import XferResponseStatus

from ..case import Skip, case, expect, expect_equal
from .producer_env import ProducerCtx

FINISH, ERROR = XferResponseStatus.FINISH, XferResponseStatus.ERROR
V2_REPLY_KEYS = frozenset({"pdwire_version", "pdwire_caps", "err_code", "err_codes", "auth_tag"})


@case(
    "producer/3.4/1",
    "3.4-R17",
    covers=(
        "3.4-R1",
        "3.4-R14",
        "10.5.2",
        "10.5.3",
        "10.5.6",
        "10.8.1",
        "10.8.12",
        "10.9.3",
        "5.1-R1",
        "5.1-R3",
    ),
)
async def pull_after_ready_is_served(t: ProducerCtx) -> None:
    """A pull sent after P's leg answered gets FINISH with the request in ok_reqs, and every
    block it asked for holds P's bytes (nothing else changed)."""
    loaded = await t.load()
    t.expect_loaded(loaded)
    t.release(loaded)


@case(
    "producer/10.4/1",
    "10.4.6",
    covers=("10.4.2", "10.4.3", "3.1-R11"),
)
async def pull_before_ready_is_served(t: ProducerCtx) -> None:
    """A pull that reaches P before its leg does waits, and is then served like a late one."""
    loaded = await t.load(pull_first=True)
    t.expect_loaded(loaded)
    t.release(loaded)


@case(
    "producer/5.3/1",
    "5.3-R1",
)
async def p_response_has_null_params(t: ProducerCtx) -> None:
    """P's HTTP response carries kv_transfer_params null."""
    loaded = await t.load()
    t.release(loaded)
    assert loaded.prefill is not None
    body = loaded.prefill.body
    expect(
        isinstance(body, dict) and "kv_transfer_params" in body,
        f"P's response has no kv_transfer_params: {body!r}",
    )
    expect_equal(body["kv_transfer_params"], None, "P's kv_transfer_params")


@case(
    "producer/5.1/2",
    "5.1-R2",
)
async def p_leg_without_transfer_id_is_served(t: ProducerCtx) -> None:
    """A P leg with do_remote_decode true but no transfer_id is served as a plain completion
    (P sends its KV to no one), and P goes on serving transfers."""
    leg = await t.prefill(None)
    t.expect_leg_ok(leg)
    choices = leg.body.get("choices") if isinstance(leg.body, dict) else None
    expect(bool(choices), f"P's answer has no completion: {leg.body!r}")
    loaded = await t.load()
    try:
        t.expect_loaded(loaded)
    finally:
        t.release(loaded)


@case(
    "producer/3.1/1",
    "3.1-R4",
    covers=("3.1-R6",),
)
async def replies_are_single_frames(t: ProducerCtx) -> None:
    """Every reply reaches D's DEALER as one frame: P sends [identity, payload], no delimiter."""
    loaded = await t.load()
    t.release(loaded)
    for _, addr, r in loaded.pulls:
        for reply in r.replies:
            expect(
                len(reply.frames) == 1,
                f"a reply from {addr} arrived as {len(reply.frames)} frames "
                f"({[f[:16].hex() for f in reply.frames]}): an empty delimiter frame?",
            )


@case(
    "producer/3.1/2",
    "3.1-R5",
    covers=("7.3-R3",),
    breaks_testee=True,
)
async def multi_frame_message_is_dropped(t: ProducerCtx) -> None:
    """A message of three frames at P's ROUTER is dropped without a reply, and P goes on serving."""
    # The payload is one P would answer at once (it cannot be decoded), were it not dropped.
    r = await t.send(t.addr(), [b"", b"\xc1"], timeout=1.0)
    expect(not r.replies, f"P answered a three-frame message: {r.describe()}")
    loaded = await t.load()
    t.expect_loaded(loaded)
    t.release(loaded)


@case(
    "producer/2.4/1",
    "2.4-R1",
    covers=("2.4-R5", "3.3-R4", "7.3-R3"),
)
async def undecodable_pull_gets_one_error(t: ProducerCtx) -> None:
    """A pull P cannot decode gets one ERROR reply with an err_msg, and P goes on serving."""
    r = await t.send(t.addr(), msgspec.msgpack.encode({"remote_hostname": "x"}), linger_after=0.3)
    expect(
        len(r.replies) == 1 and r.status is ERROR,
        f"expected exactly one ERROR reply, got {r.describe()}",
    )
    terminal = r.terminal
    assert terminal is not None
    expect(bool(terminal.err_msg), "the ERROR reply has no err_msg")
    loaded = await t.load()
    t.expect_loaded(loaded)
    t.release(loaded)


@case(
    "producer/2.4/2",
    "2.4-R2",
    covers=("3.4-R8",),
)
async def undecodable_v2_pull_gets_bad_message(t: ProducerCtx) -> None:
    """A pull that announced pdwire/2 but cannot be decoded gets err_code BAD_MESSAGE."""
    t.require_pdwire2()
    bad = {"remote_hostname": "x", "remote_port": "not a port", "pdwire_version": 2}
    r = await t.send(t.addr(), msgspec.msgpack.encode(bad))
    terminal = r.terminal
    expect(terminal is not None and terminal.status is ERROR, f"expected ERROR, got {r.describe()}")
    assert terminal is not None
    expect_equal(terminal.err_code, "BAD_MESSAGE", "err_code")


@case(
    "producer/10.1/1",
    "10.1.4",
    covers=("10.1.3", "3.3-R4", "7.1-R1", "7.1-R5"),
)
async def unpaired_tp_rank_is_an_error(t: ProducerCtx) -> None:
    """A pull whose remote_tp_rank is not paired with the P rank gets ERROR with message #1."""
    if t.p_tp == 1:
        raise Skip("a P of TP 1 pairs with every D rank")
    # With equal TP sizes, P rank 0 pairs with D rank 0 alone.
    worker = t.worker(t.p_tp, t.p_tp - 1)
    r = await t.pull(worker, t.addr(0), {t.new_d_req(): (t.new_transfer_id(), [[]])})
    expect(r.status is ERROR, f"expected ERROR, got {r.describe()}")
    expected = error_strings.TP_RANK_NOT_PAIRED.format(
        d_tp_rank=t.p_tp - 1, p_tp_rank=0, expected=[0]
    )
    assert r.terminal is not None
    expect_equal(r.terminal.err_msg, expected, "err_msg")


@case(
    "producer/3.4/2",
    "3.4-R6",
    covers=("8.4-R3", "7.2-R2", "8.1-R1", "3.2-R15", "7.3-R2", "5.3-R4"),
)
async def legacy_pull_gets_legacy_replies(t: ProducerCtx) -> None:
    """Replies to a pull without pdwire_version carry none of the pdwire/2 fields, even when
    the request's P leg carried pdwire_version 2 (a pdwire/2 proxy's, which says nothing of
    D's)."""
    loaded = await t.load(leg_params={"pdwire_version": 2})
    t.release(loaded)
    for _, addr, r in loaded.pulls:
        for reply in r.replies:
            extra = V2_REPLY_KEYS & set(reply.keys)
            expect(not extra, f"a reply from {addr} to a legacy pull carries {sorted(extra)}")


@case(
    "producer/3.4/3",
    "3.4-R7",
    covers=("8.2-R4", "8.3-R1"),
)
async def v2_pull_gets_version_in_replies(t: ProducerCtx) -> None:
    """Every reply to a pull that announced pdwire/2 carries P's pdwire_version and caps."""
    t.require_pdwire2()
    loaded = await t.load(announce=True)
    t.expect_loaded(loaded)
    t.release(loaded)
    for _, addr, r in loaded.pulls:
        for reply in r.decoded():
            expect(
                reply.pdwire_version >= 2,
                f"a reply from {addr} to a pdwire/2 pull has pdwire_version {reply.pdwire_version}",
            )


@case(
    "producer/3.4/4",
    "3.4-R16",
    covers=("3.4-R18",),
)
async def each_request_listed_once(t: ProducerCtx) -> None:
    """Over all replies of a pull, P lists each d_req_id at most once and none it was not sent."""
    worker = t.worker()
    n = t.blocks_for()
    tids = [t.new_transfer_id() for _ in range(3)]
    legs = [t.start_prefill(tid) for tid in tids]
    reqs = {t.new_d_req(): (tid, [worker.take(n)]) for tid in tids}
    r = await t.pull(worker, t.addr(), reqs)
    for leg in legs:
        await leg
    worker.give_back(b for _, (_, groups) in reqs.items() for b in groups[0])
    listed = r.ok() + r.err()
    expect(len(listed) == len(set(listed)), f"a request is listed twice: {listed}")
    expect(
        set(listed) <= set(reqs),
        f"P listed requests that were not in the pull: {set(listed) - set(reqs)}",
    )
    expect(
        set(listed) == set(reqs) and r.status is FINISH,
        f"expected FINISH listing all of {sorted(reqs)}, got {r.describe()}",
    )
