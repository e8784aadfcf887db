"""ConsumerSession (spec §3, §4.2, §6, §10.10): which pulls D sends where, and when it reports
each request, in virtual time. Pull and cancel bytes are read back with pdwire's decoders."""

from __future__ import annotations

from typing import Any

import pytest

from pdwire import ErrorCode, XferCancel, XferResponseStatus, decode_cancel, decode_pull
from pdwire.consumer import UNREPORTED, ConsumerSession, mint_layout_id
from pdwire.events import (
    AbortRequested,
    BlocksReleased,
    ClosePull,
    EngineResolved,
    LoadRequest,
    LoadsRequested,
    QueryBootstrap,
    ReplyReceived,
    RequestFailed,
    RequestLoaded,
    SendPull,
)
from pdwire.http_models import EngineEntry
from pdwire.transitions import LoadState
from pdwire.versions import ALL_CAPS, LEGACY

from .sessions_helpers import (
    FP,
    LEGACY_PULL_KEYS,
    Driver,
    consumer,
    d_side,
    entry,
    of_type,
    reply_bytes,
    wire_keys,
)

FINISH, CONTINUE = XferResponseStatus.FINISH, XferResponseStatus.CONTINUE
ERROR, LAYOUT_MISS = XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS
BOOT = "http://p-bootstrap:8998"
RECEIVE, DEADLINE = 540.0, 60.0


def load(
    d_req: str, transfer: str | None = None, engine: str = "e0", blocks: Any = None
) -> LoadRequest:
    blocks = [[1, 2]] if blocks is None else blocks
    return LoadRequest(d_req, transfer or f"x-{d_req}", engine, BOOT, blocks)


def pulls(out: list[object]) -> list[SendPull]:
    return [o for o in of_type(out, SendPull) if not isinstance(o.message, XferCancel)]


def cancels(out: list[object]) -> list[SendPull]:
    return [o for o in of_type(out, SendPull) if isinstance(o.message, XferCancel)]


def reports(out: list[object]) -> list[object]:
    return [o for o in out if isinstance(o, RequestLoaded | RequestFailed | BlocksReleased)]


def started(
    c: Driver[ConsumerSession], *reqs: LoadRequest, at: float = 0.0, **entry_kw: Any
) -> list[SendPull]:
    """Ask D to load ``reqs`` from engine e0 and resolve it; return the pulls D sends."""
    c(LoadsRequested(reqs), at)
    return pulls(c(EngineResolved("e0", entry(**entry_kw)), at))


# -- targets (§10.1, §10.2) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("d", "p_tp", "p_pp", "expected"),
    [
        ((1, 0, 1, 0), 2, 1, [(0, 0), (1, 0)]),
        ((2, 1, 1, 0), 1, 1, [(0, 0)]),
        ((4, 3, 1, 0), 2, 1, [(1, 0)]),
        ((2, 0, 1, 0), 4, 1, [(0, 0), (1, 0)]),
        ((1, 0, 2, 1), 1, 2, [(0, 1)]),
        ((1, 0, 2, 0), 1, 4, [(0, 0), (0, 1), (0, 2), (0, 3)]),
        ((1, 0, 1, 0), 1, 2, [(0, 0), (0, 1)]),
        ((2, 1, 2, 1), 4, 2, [(2, 1), (3, 1)]),
    ],
    ids=["D1-P2", "D2r1-P1", "D4r3-P2", "D2r0-P4", "PP2s1-PP2", "PP2-PP4", "PP1-PP2", "TP+PP"],
)
@pytest.mark.parametrize("v2_entry", [True, False], ids=["v2-entry", "legacy-entry"])
def test_targets(
    d: tuple[int, int, int, int],
    p_tp: int,
    p_pp: int,
    expected: list[tuple[int, int]],
    v2_entry: bool,
) -> None:
    """10.1.2, 10.1.5, 10.2.2/10.2.3/10.2.5: D pulls from exactly the paired P TP ranks, from
    its own PP rank when the PP sizes match and from every P stage otherwise; each pull carries
    remote_pp_size and every layer D registered. P_tp comes from the /query entry (its tp_size,
    or the number of TP ranks of a legacy entry)."""
    d_tp, d_rank, d_pp, d_pp_rank = d
    c = Driver(consumer(d_tp, d_rank, d_pp, d_pp_rank))
    c(LoadsRequested((load("r1"),)))
    e = entry(tp=p_tp, pp=p_pp, v2=v2_entry)
    sent = pulls(c(EngineResolved("e0", e)))
    want = [e.worker_addr[t][s] for t, s in expected]
    assert sorted(p.addr for p in sent) == sorted(want)
    layers = [r.layer_name for r in d_side(d_tp, d_rank, d_pp, d_pp_rank).regions]
    for p in sent:
        msg = decode_pull(p.data)
        assert (msg.remote_tp_size, msg.remote_tp_rank) == (d_tp, d_rank)
        assert msg.remote_pp_size == d_pp and msg.registered_layer_names == layers
        assert msg.req_blocks == {"r1": ("x-r1", [[1, 2]])}


def test_one_bootstrap_query_per_engine() -> None:
    """§4.2, 10.10.1: concurrent requests for one unknown engine share one query; all go out in
    one pull once it resolves; a later request for the known engine queries nothing."""
    c = Driver(consumer())
    out = c(LoadsRequested((load("r1"), load("r2"), load("q1", engine="e1"))))
    assert sorted(of_type(out, QueryBootstrap), key=lambda q: q.engine_id) == [
        QueryBootstrap("e0", BOOT),
        QueryBootstrap("e1", BOOT),
    ]
    assert c.session.state_of("r1") is LoadState.RESOLVING
    assert c(LoadsRequested((load("r3"),)), 1) == []
    (pull,) = pulls(c(EngineResolved("e0", entry()), 2))
    assert sorted(decode_pull(pull.data).req_blocks) == ["r1", "r2", "r3"]
    assert c.session.state_of("r1") is LoadState.PULLING
    out = c(LoadsRequested((load("r4"),)), 3)
    assert of_type(out, QueryBootstrap) == [] and len(pulls(out)) == 1


# -- layout cache (§3.7) -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("echo", "omitted"), [(0x11, True), (0, False), (0x13, False)], ids=["echo", "none", "other"]
)
def test_layout_omitted_only_after_echo(echo: int, omitted: bool) -> None:
    """3.7-R4/R6, 3.4-R4, 3.2-R12/R13, 3.2-R16: D omits its layout (and fingerprint) only from
    pulls to a P worker that echoed D's own layout_id in a FINISH or CONTINUE."""
    c = Driver(consumer(layout_id=0x11, fingerprint=FP))
    (first,) = started(c, load("r1"))
    msg = decode_pull(first.data)
    assert msg.kv_caches_base_addr and msg.layout_id == 0x11 and msg.fingerprint == FP
    c(ReplyReceived(first.pull_id, reply_bytes(FINISH, ["r1"], layout_id=echo, v2=True)), 1)
    (second,) = pulls(c(LoadsRequested((load("r2"),)), 2))
    msg = decode_pull(second.data)
    assert (not msg.kv_caches_base_addr) is omitted
    assert (not msg.registered_layer_names) is omitted
    assert (msg.fingerprint is None) is omitted
    assert msg.layout_id == 0x11


def test_minted_layout_ids_are_random_odd_and_below_2_63() -> None:
    """3.7-R1/R2: each registration mints another id, never 0 (a D restarted under the same
    engine id must not reuse its layout_id at new addresses)."""
    ids = [mint_layout_id() for _ in range(64)]
    assert all(i % 2 == 1 and 0 < i < 2**63 for i in ids)
    assert len(set(ids)) == len(ids)


def test_layout_echo_is_per_p_worker() -> None:
    """3.7-R4: with P TP2, only the worker that echoed gets pulls without the layout."""
    c = Driver(consumer(layout_id=0x11))
    sent = started(c, load("r1"), tp=2)
    c(ReplyReceived(sent[0].pull_id, reply_bytes(FINISH, ["r1"], layout_id=0x11)), 1)
    c(ReplyReceived(sent[1].pull_id, reply_bytes(FINISH, ["r1"])), 1)
    nxt = {p.addr: decode_pull(p.data) for p in pulls(c(LoadsRequested((load("r2"),)), 2))}
    assert not nxt[sent[0].addr].kv_caches_base_addr
    assert nxt[sent[1].addr].kv_caches_base_addr


def test_layout_miss_resends_with_the_layout() -> None:
    """3.7-R7: LAYOUT_MISS to a pull that omitted the layout is not a failure: D closes it and
    sends the same pull again with its layout, and keeps sending it until echoed again."""
    c = Driver(consumer(layout_id=0x11))
    (first,) = started(c, load("r0"))
    c(ReplyReceived(first.pull_id, reply_bytes(FINISH, ["r0"], layout_id=0x11)), 1)
    (lean,) = pulls(c(LoadsRequested((load("r1"), load("r2"))), 2))
    assert not decode_pull(lean.data).kv_caches_base_addr
    out = c(ReplyReceived(lean.pull_id, reply_bytes(LAYOUT_MISS, err_msg="not cached")), 3)
    assert ClosePull(lean.pull_id) in out and reports(out) == []
    (again,) = pulls(out)
    msg = decode_pull(again.data)
    assert again.addr == lean.addr and msg.kv_caches_base_addr
    assert msg.req_blocks == decode_pull(lean.data).req_blocks
    out = c(ReplyReceived(again.pull_id, reply_bytes(FINISH, ["r1", "r2"])), 4)
    assert reports(out) == [RequestLoaded("r1"), RequestLoaded("r2")]
    (nxt,) = pulls(c(LoadsRequested((load("r3"),)), 5))
    assert decode_pull(nxt.data).kv_caches_base_addr  # the echo was forgotten (3.7-R7)


def test_layout_miss_to_a_pull_with_layout_fails() -> None:
    """3.7-R8: LAYOUT_MISS to a pull that carried the layout fails it, like ERROR."""
    c = Driver(consumer(layout_id=0x11))
    (first,) = started(c, load("r1"))
    out = c(ReplyReceived(first.pull_id, reply_bytes(LAYOUT_MISS, err_msg="lost")), 1)
    assert pulls(out) == []
    (failed,) = of_type(out, RequestFailed)
    assert (failed.d_req_id, failed.reason, failed.blocks_free) == ("r1", "lost", True)


def test_layout_miss_after_the_deadline_does_not_resend() -> None:
    """6.3-R6, 3.5-R17: D MUST NOT send a pull for a request whose deadline has passed."""
    c = Driver(consumer(layout_id=0x11))
    (first,) = started(c, load("r0"))
    c(ReplyReceived(first.pull_id, reply_bytes(FINISH, ["r0"], layout_id=0x11, v2=True)), 0)
    (lean,) = pulls(c(LoadsRequested((load("r1"),)), 1))
    assert cancels(c.advance(1 + DEADLINE))
    out = c(ReplyReceived(lean.pull_id, reply_bytes(LAYOUT_MISS, err_msg="miss", v2=True)), 62)
    assert pulls(out) == []


def test_layout_miss_resend_to_a_legacy_p_stays_legacy() -> None:
    """8.2-R2/R3, 8.3 table (D pdwire/2, P legacy: send legacy, do not announce), 3.7-R7: the
    resend after LAYOUT_MISS is sent under the same profile as the pull it replaces."""
    c = Driver(consumer(layout_id=0x11))
    (first,) = started(c, load("r0"), v2=False)
    assert wire_keys(first.data) <= LEGACY_PULL_KEYS
    c(ReplyReceived(first.pull_id, reply_bytes(FINISH, ["r0"], layout_id=0x11)), 1)
    (lean,) = pulls(c(LoadsRequested((load("r1"),)), 2))
    assert wire_keys(lean.data) <= LEGACY_PULL_KEYS
    (again,) = pulls(c(ReplyReceived(lean.pull_id, reply_bytes(LAYOUT_MISS, err_msg="m")), 3))
    assert wire_keys(again.data) <= LEGACY_PULL_KEYS


# -- completion (§10.10) -----------------------------------------------------------------------


def test_loaded_only_after_every_paired_worker_replied() -> None:
    """10.10.1-10.10.3: D TP1 pulling from P TP2 reports RequestLoaded only when both pulls
    listed the request in ok_reqs."""
    c = Driver(consumer())
    a, b = started(c, load("r1"), tp=2)
    assert c.session.state_of("r1") is LoadState.PULLING
    assert reports(c(ReplyReceived(a.pull_id, reply_bytes(FINISH, ["r1"])), 1)) == []
    assert reports(c(ReplyReceived(b.pull_id, reply_bytes(FINISH, ["r1"])), 2)) == [
        RequestLoaded("r1")
    ]
    assert (c.session.loading, c.session.open_pulls) == (0, 0)


@pytest.mark.parametrize("failed_first", [True, False])
def test_one_failed_pull_fails_the_request_for_good(failed_first: bool) -> None:
    """10.10.2/10.10.4, 3.4-R11: one pull listing the request in err_reqs fails it, but D
    reports only once every pull settled, with that pull's message and code."""
    c = Driver(consumer())
    a, b = started(c, load("r1"), tp=2)
    bad = reply_bytes(
        FINISH,
        err=["r1"],
        err_msg="P num blocks less than D",
        v2=True,
        err_code="P_BLOCKS_LESS_THAN_D",
        err_codes={"r1": "P_BLOCKS_LESS_THAN_D"},
    )
    replies = [(a, bad), (b, reply_bytes(FINISH, ["r1"]))]
    if not failed_first:
        replies.reverse()
    assert reports(c(ReplyReceived(replies[0][0].pull_id, replies[0][1]), 1)) == []
    out = reports(c(ReplyReceived(replies[1][0].pull_id, replies[1][1]), 2))
    assert out == [RequestFailed("r1", ErrorCode.P_BLOCKS_LESS_THAN_D, "P num blocks less than D")]


def test_finish_without_reporting_a_request_fails_it() -> None:
    """3.4-R19: a FINISH that leaves a request of the pull unreported fails it with "peer
    finished without reporting a transfer result"."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1"), load("r2"))
    out = c(ReplyReceived(pull.pull_id, reply_bytes(FINISH, ["r1"])), 1)
    assert RequestLoaded("r1") in out and ClosePull(pull.pull_id) in out
    (failed,) = of_type(out, RequestFailed)
    assert (failed.d_req_id, failed.reason) == ("r2", UNREPORTED)
    assert UNREPORTED == "peer finished without reporting a transfer result"


@pytest.mark.parametrize(
    ("err_msg", "err_code", "reason", "code"),
    [
        ("Timeout", "TP_RANK_NOT_PAIRED", "Timeout", ErrorCode.TP_RANK_NOT_PAIRED),
        (None, None, "transfer error", ErrorCode.INTERNAL),
        ("x", "SOMETHING_NEW", "x", ErrorCode.INTERNAL),
    ],
    ids=["code", "no-message", "unknown-code"],
)
def test_error_fails_every_unreported_request(
    err_msg: str | None, err_code: str | None, reason: str, code: ErrorCode
) -> None:
    """3.4-R20, 3.4-R11/R12, 7.2-R1: ERROR fails every request not reported earlier, with
    err_msg (else "transfer error") and err_code (unknown or absent: INTERNAL); a request
    listed ok in an earlier CONTINUE stays loaded."""
    c = Driver(consumer())
    (pull,) = started(c, load("r0"), load("r1"), load("r2"))
    assert reports(c(ReplyReceived(pull.pull_id, reply_bytes(CONTINUE, ["r0"], v2=True)), 1)) == [
        RequestLoaded("r0")
    ]
    out = c(
        ReplyReceived(
            pull.pull_id, reply_bytes(ERROR, err_msg=err_msg, err_code=err_code, v2=True)
        ),
        2,
    )
    assert reports(out) == [RequestFailed(r, code, reason) for r in ("r1", "r2")]
    assert ClosePull(pull.pull_id) in out and c.session.open_pulls == 0


def test_ignores_unknown_requests_and_late_frames() -> None:
    """3.4-R21, 3.1-R10: a d_req_id that is not pending in the pull is ignored, and so is a frame
    on a closed pull."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1"))
    assert reports(c(ReplyReceived(pull.pull_id, reply_bytes(CONTINUE, ["zz"], ["yy"])), 1)) == []
    c(ReplyReceived(pull.pull_id, reply_bytes(FINISH, ["r1"])), 2)
    assert c(ReplyReceived(pull.pull_id, reply_bytes(FINISH, err=["r1"])), 3) == []


# -- timers: receive timeout, deadline (§6) ------------------------------------------------------


def test_receive_timeout_under_legacy() -> None:
    """3.1-R8/R9, §6.1: a legacy D fails a pull's pending requests at 540 s with "transfer
    failed: ..."; each reply (CONTINUE) restarts the timer; a legacy D has no deadline."""
    c = Driver(consumer(profile=LEGACY))
    (pull,) = started(c, load("r1"), load("r2"), at=10)
    assert c.advance(10 + DEADLINE + 1) == []
    c(ReplyReceived(pull.pull_id, reply_bytes(CONTINUE, ["r1"])), 100)
    assert reports(c.advance(100 + RECEIVE - 0.01)) == []
    out = c.advance(100 + RECEIVE)
    (failed,) = of_type(out, RequestFailed)
    assert failed.d_req_id == "r2" and failed.reason.startswith("transfer failed: ")
    assert failed.blocks_free and ClosePull(pull.pull_id) in out
    assert c.session.next_deadline() is None


@pytest.mark.parametrize("released_by", ["cancel-reply", "pull-reply"])
def test_deadline_cancels_and_releases_after_p_answers(released_by: str) -> None:
    """10.11.3, §6.2 D deadline, 3.5-R1/R3/R4, 3.5-R17: at 60 s a pdwire/2 D fails the request
    with DEADLINE_EXCEEDED and blocks_free=False, and sends an XferCancel to a P that announced
    cancel; it releases the blocks only on P's reply to the cancel or the withdrawn pull's
    terminal reply."""
    c = Driver(consumer(tp=2, rank=1, pp=1))
    (pull,) = started(c, load("r1"), at=5)
    assert decode_pull(pull.data).deadline_ms == 60_000
    assert reports(c.advance(5 + DEADLINE - 0.01)) == []
    out = c.advance(5 + DEADLINE)
    assert reports(out) == [
        RequestFailed("r1", ErrorCode.DEADLINE_EXCEEDED, "deadline", blocks_free=False)
    ]
    assert c.session.state_of("r1") is LoadState.TIMED_OUT
    (cancel,) = cancels(out)
    msg = decode_cancel(cancel.data)
    assert cancel.addr == pull.addr
    assert msg.cancel_reqs == {"r1": "x-r1"}
    assert (msg.remote_hostname, msg.remote_port, msg.remote_tp_size, msg.remote_tp_rank) == (
        "d0",
        1,
        2,
        1,
    )
    assert c.advance(100) == []  # nothing until P answers
    if released_by == "cancel-reply":
        out = c(ReplyReceived(cancel.pull_id, reply_bytes(FINISH, ["r1"], v2=True)), 101)
    else:
        withdrawn = reply_bytes(
            FINISH,
            err=["r1"],
            err_msg="Request cancelled by the consumer.",
            err_code="CANCELLED",
            err_codes={"r1": "CANCELLED"},
            v2=True,
        )
        out = c(ReplyReceived(pull.pull_id, withdrawn), 101)
    assert reports(out) == [BlocksReleased("r1")]
    assert ClosePull(pull.pull_id) in out
    if released_by == "pull-reply":  # the cancel's own answer is then harmless
        out = c(ReplyReceived(cancel.pull_id, reply_bytes(FINISH, ["r1"], v2=True)), 102)
        assert reports(out) == [] and ClosePull(cancel.pull_id) in out
    assert (c.session.loading, c.session.open_pulls) == (0, 0)


@pytest.mark.parametrize(
    "entry_kw",
    [{"v2": False}, {"v2": True, "caps": ALL_CAPS - {"cancel"}}],
    ids=["legacy-P", "P-without-cancel"],
)
def test_deadline_sends_no_cancel_to_a_p_without_cancel(entry_kw: dict[str, Any]) -> None:
    """8.4-R4, 3.5-R1, 3.5-R17: at the deadline D fails the request (blocks_free=False) but
    sends nothing P cannot decode; it releases the blocks only at the receive timeout."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1"), **entry_kw)
    if not entry_kw["v2"]:
        assert wire_keys(pull.data) <= LEGACY_PULL_KEYS
    out = c.advance(DEADLINE)
    assert reports(out) == [
        RequestFailed("r1", ErrorCode.DEADLINE_EXCEEDED, "deadline", blocks_free=False)
    ]
    assert of_type(out, SendPull) == []
    assert reports(c.advance(RECEIVE - 0.01)) == []
    out = c.advance(RECEIVE)
    assert reports(out) == [BlocksReleased("r1")] and of_type(out, SendPull) == []


def test_no_cancel_to_a_p_whose_reply_was_legacy() -> None:
    """8.2-R2/R3, 8.4-R4: the P worker's latest reply outranks its /query entry; once a reply
    without pdwire_version shows it is legacy, D sends it no XferCancel."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1"))
    c(ReplyReceived(pull.pull_id, reply_bytes(CONTINUE)), 1)
    out = c.advance(DEADLINE)
    assert of_type(out, RequestFailed) and cancels(out) == []


def test_abort_while_pulling_cancels() -> None:
    """3.5 (abort), 3.5-R17: an aborted request fails at once with blocks_free=False, its pulls
    are withdrawn with a cancel, and its blocks are released on the cancel's reply."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1"), load("r2"))
    out = c(AbortRequested("r1"), 1)
    assert reports(out) == [RequestFailed("r1", ErrorCode.CANCELLED, "aborted", blocks_free=False)]
    (cancel,) = cancels(out)
    assert decode_cancel(cancel.data).cancel_reqs == {"r1": "x-r1"}
    out = c(ReplyReceived(cancel.pull_id, reply_bytes(FINISH, ["r1"], v2=True)), 2)
    assert reports(out) == [BlocksReleased("r1")]
    out = c(ReplyReceived(pull.pull_id, reply_bytes(FINISH, ["r2"], v2=True)), 3)
    assert reports(out) == [RequestLoaded("r2")]


CANCEL_ANSWERS = {
    "error": lambda pid: ReplyReceived(pid, reply_bytes(ERROR, err_msg="cannot decode")),
    "finish-unlisted": lambda pid: ReplyReceived(pid, reply_bytes(FINISH, [], v2=True)),
}


@pytest.mark.parametrize("answer", [*CANCEL_ANSWERS, "timeout"])
def test_withdrawn_blocks_stay_until_the_pull_ends(answer: str) -> None:
    """3.5-R17: neither an ERROR to the cancel, a FINISH not listing the request, nor the
    cancel's own timeout frees the blocks of a request withdrawn at its deadline; the withdrawn
    pull's end does."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1"))
    (cancel,) = cancels(c.advance(DEADLINE))
    halfway = DEADLINE + RECEIVE / 2
    c(ReplyReceived(pull.pull_id, reply_bytes(CONTINUE, v2=True)), halfway)  # keeps it open
    if answer == "timeout":
        out = c.advance(DEADLINE + RECEIVE)
    else:
        out = c(CANCEL_ANSWERS[answer](cancel.pull_id), halfway)
    assert reports(out) == []
    out = c(
        ReplyReceived(pull.pull_id, reply_bytes(FINISH, ["r1"], v2=True)), DEADLINE + RECEIVE + 1
    )
    assert reports(out) == [BlocksReleased("r1")]


# -- release-only (§10.10.8/9) -------------------------------------------------------------------

OUTCOMES = {
    "ok": lambda pid: ReplyReceived(pid, reply_bytes(FINISH, ["r1"])),
    "err": lambda pid: ReplyReceived(pid, reply_bytes(FINISH, err=["r1"], err_msg="no")),
    "error": lambda pid: ReplyReceived(pid, reply_bytes(ERROR, err_msg="no")),
    "garbage": lambda pid: ReplyReceived(pid, b"\x00garbage"),
}


@pytest.mark.parametrize("outcome", [*OUTCOMES, "timeout"])
def test_release_only_is_never_reported(outcome: str) -> None:
    """10.10.8/10.10.9, 3.2-R5: a request with no blocks is pulled (so P releases) but never
    reported to the scheduler, whatever the pull's outcome (at its deadline D may withdraw it
    with a cancel, which P counts as settled too)."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1", blocks=[]))
    assert decode_pull(pull.data).req_blocks == {"r1": ("x-r1", [])}
    out = c.advance(2 * RECEIVE) if outcome == "timeout" else c(OUTCOMES[outcome](pull.pull_id), 1)
    out += c.advance(2 * RECEIVE)
    assert reports(out) == []
    assert (c.session.loading, c.session.open_pulls) == (0, 0)


def test_abort_before_the_engine_is_resolved_becomes_release_only() -> None:
    """10.10.8, §4.1 facts (request_finished): aborted before D allocated anything, the request
    is still pulled, empty, so that P frees its blocks; it is never reported."""
    c = Driver(consumer())
    c(LoadsRequested((load("r1"),)))
    assert c(AbortRequested("r1"), 1) == []
    (pull,) = pulls(c(EngineResolved("e0", entry()), 2))
    assert decode_pull(pull.data).req_blocks == {"r1": ("x-r1", [])}
    out = c(ReplyReceived(pull.pull_id, reply_bytes(FINISH, ["r1"])), 3)
    assert reports(out) == [] and c.session.loading == 0


# -- bootstrap and bad replies -----------------------------------------------------------------


@pytest.mark.parametrize(
    "resolved",
    [
        EngineResolved("e0", None, error="HTTP 404"),
        EngineResolved("e0", entry(engine_id="other")),
        EngineResolved("e0", entry(tp=3)),
    ],
    ids=["query-failed", "other-engine", "tp-not-dividing"],
)
def test_unresolvable_engine_fails_its_requests(resolved: EngineResolved) -> None:
    """§4.2, 7.1.3, 10.1.1: when the engine cannot be resolved (or pairs with nothing), every
    request waiting for it fails at once, with its blocks free, and nothing is pulled."""
    c = Driver(consumer(tp=2))
    c(LoadsRequested((load("r1"), load("r2", blocks=[]))))
    out = c(resolved, 1)
    assert of_type(out, SendPull) == []
    (failed,) = of_type(out, RequestFailed)
    assert failed.d_req_id == "r1" and failed.blocks_free and failed.reason
    assert c.session.loading == 0


def test_unknown_engine_reason_names_the_bootstrap_server() -> None:
    """7.1.3: "remote engine_id {remote_engine_id} not found from bootstrap server
    {remote_bootstrap_addr}"."""
    c = Driver(consumer())
    c(LoadsRequested((load("r1"),)))
    (failed,) = of_type(c(EngineResolved("e0", None), 1), RequestFailed)
    assert failed.reason == f"remote engine_id e0 not found from bootstrap server {BOOT}"


@pytest.mark.parametrize("data", [b"\x00garbage", b"", reply_bytes(ERROR, ["r1"])[:-1]])
def test_malformed_reply_fails_the_pull(data: bytes) -> None:
    """3.1-R9, §2.4, 7.1.3: an undecodable reply fails every pending request of the pull with
    BAD_MESSAGE and "transfer failed: ...", and closes it."""
    c = Driver(consumer())
    (pull,) = started(c, load("r1"))
    out = c(ReplyReceived(pull.pull_id, data), 1)
    (failed,) = of_type(out, RequestFailed)
    assert failed.code is ErrorCode.BAD_MESSAGE and failed.reason.startswith("transfer failed: ")
    assert ClosePull(pull.pull_id) in out and c.session.open_pulls == 0


@pytest.mark.parametrize("bad", ["unsigned", "not-bound-to-the-pull"])
def test_unsigned_reply_fails_when_auth_is_agreed(bad: str) -> None:
    """8.6-R6/R8/R13: a D with a key rejects an unsigned reply, or one whose tag does not cover
    its pull's tag, and fails the pull; one signed for its pull is accepted."""
    key = b"k" * 32
    c = Driver(consumer(auth_key=key))
    (pull,) = started(c, load("r1"), load("r2"))
    pull_tag = decode_pull(pull.data).auth_tag
    assert pull_tag is not None
    signed = reply_bytes(CONTINUE, ["r1"], v2=True, auth_key=key, answers=pull_tag)
    assert reports(c(ReplyReceived(pull.pull_id, signed), 1)) == [RequestLoaded("r1")]
    unsigned = {"unsigned": {}, "not-bound-to-the-pull": {"auth_key": key}}[bad]
    out = c(ReplyReceived(pull.pull_id, reply_bytes(FINISH, ["r2"], v2=True, **unsigned)), 2)
    assert [type(r) for r in reports(out)] == [RequestFailed]
    assert of_type(out, RequestFailed)[0].code is ErrorCode.BAD_MESSAGE


@pytest.mark.parametrize("reply_v2", [False, True], ids=["legacy-reply", "unsigned-v2-reply"])
def test_a_keyed_d_never_speaks_legacy(reply_v2: bool) -> None:
    """8.6-R14: a D with a key announces and signs its pull to a P whose /query entry says
    legacy, and fails the request on P's unsigned reply, with or without pdwire_version."""
    c = Driver(consumer(auth_key=b"k" * 32))
    (pull,) = started(c, load("r1"), v2=False)
    msg = decode_pull(pull.data)
    assert msg.pdwire_version == 2 and msg.auth_tag is not None
    out = c(ReplyReceived(pull.pull_id, reply_bytes(FINISH, ["r1"], v2=reply_v2)), 1)
    assert [type(r) for r in reports(out)] == [RequestFailed]


def test_a_key_needs_the_pdwire2_profile() -> None:
    """8.6-R14: a key with the legacy profile is a configuration error."""
    with pytest.raises(ValueError, match=r"8\.6-R14"):
        consumer(profile=LEGACY, auth_key=b"k")


# -- announcing (§8) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "v2_entry", "announces"),
    [("pdwire/2", True, True), ("pdwire/2", False, False), (LEGACY, True, False)],
    ids=["v2-D-v2-P", "v2-D-legacy-P", "legacy-D"],
)
def test_announcing(profile: str, v2_entry: bool, announces: bool) -> None:
    """8.1-R4, 8.3 table, 3.2-R14/R18/R20: a legacy D never announces (its pulls have vLLM's keys
    only); a pdwire/2 D announces version, capabilities, fingerprint and deadline_ms unless P is
    known to be legacy."""
    c = Driver(consumer(profile=profile, fingerprint=FP))
    (pull,) = started(c, load("r1"), v2=v2_entry)
    keys = wire_keys(pull.data)
    if announces:
        assert {"pdwire_version", "pdwire_caps", "fingerprint", "deadline_ms"} <= keys
        msg = decode_pull(pull.data)
        assert msg.pdwire_version == 2 and set(msg.pdwire_caps) == ALL_CAPS
        assert msg.fingerprint == FP and msg.deadline_ms == 60_000
    else:
        assert keys <= LEGACY_PULL_KEYS


@pytest.mark.parametrize(
    ("profile", "ended_by", "queries_again"),
    [
        ("pdwire/2", "receive-timeout", True),
        ("pdwire/2", "deadline", True),
        (LEGACY, "receive-timeout", False),  # a legacy D has no deadline of its own
    ],
)
def test_an_unanswered_pull_makes_d_query_the_bootstrap_again(
    profile: str, ended_by: str, queries_again: bool
) -> None:
    """4.2-R12: a pdwire/2 D forgets an engine's cached entry once a pull to it ended without an
    answer (P may have restarted on new ports), so the next request queries again; a legacy D
    caches the entry for good, as vLLM does."""
    c = Driver(consumer(profile=profile))
    started(c, load("r1"), at=10)
    c.advance(10 + (RECEIVE if ended_by == "receive-timeout" else DEADLINE) + 1)
    out = c(LoadsRequested((load("r2"),)))
    assert (of_type(out, QueryBootstrap) == [QueryBootstrap("e0", BOOT)]) is queries_again
    assert (len(pulls(out)) == 1) is not queries_again


def test_the_d_legs_deadline_ms_is_the_requests_deadline() -> None:
    """5.2-R4, 3.2-R17: a load carrying the D leg's budget (deadline_ms) ends at that budget,
    not at D's default deadline, and its pulls say how much of it is left."""
    c = Driver(consumer(tp=2, rank=1, pp=1))
    short = LoadRequest("r1", "x-r1", "e0", BOOT, [[1, 2]], deadline_ms=500)
    (pull,) = started(c, short, at=5)
    assert decode_pull(pull.data).deadline_ms == 500
    assert reports(c.advance(5.49)) == []
    out = c.advance(5.5)
    assert reports(out) == [
        RequestFailed("r1", ErrorCode.DEADLINE_EXCEEDED, "deadline", blocks_free=False)
    ]


def test_a_legacy_entry_with_a_gap_in_its_tp_ranks_fails_the_batch() -> None:
    """4.2-R5/R6, 10.1.5: a legacy /query entry whose TP keys are not 0..n-1 (a rank has not
    registered yet) cannot be paired: the batch fails at once instead of hanging, and the entry
    is not cached."""
    c = Driver(consumer())
    c(LoadsRequested((load("r1"),)))
    gap = EngineEntry(engine_id="e0", worker_addr={0: {0: "tcp://p0:1"}, 2: {0: "tcp://p2:1"}})
    out = c(EngineResolved("e0", gap))
    assert pulls(out) == []
    (failed,) = of_type(out, RequestFailed)
    assert failed.d_req_id == "r1" and "TP ranks" in failed.reason
    again = c(LoadsRequested((load("r2"),)))  # not cached: D asks the bootstrap server again
    assert of_type(again, QueryBootstrap) == [QueryBootstrap("e0", BOOT)]
