"""ProducerSession (spec §3, §6, §7, §10): one focused test per behaviour, in virtual time.

Replies are read back from their bytes with ``decode_response``; replies to a legacy D are also
checked to carry only vLLM 0.33's keys.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from pdwire import ErrorCode, LocalProtocolError, XferResponseStatus, auth
from pdwire.codec import decode_pull
from pdwire.errors import RemoteProtocolError
from pdwire.events import (
    FreeBlocks,
    FreeReason,
    MessageReceived,
    RejectRequest,
    SendReply,
    StartWrite,
    TransferFinished,
    TransferStarted,
    TransferWillNotSend,
    WriteCompleted,
)
from pdwire.limits import Limits
from pdwire.messages import XferResponseV2
from pdwire.planning import Side, has_opaque_packed_row
from pdwire.producer import ProducerConfig, ProducerSession
from pdwire.transitions import TransferState
from pdwire.versions import ALL_CAPS

from .sessions_helpers import (
    FP,
    LEGACY_REPLY_KEYS,
    DPeer,
    Driver,
    T,
    d_side,
    decoded,
    of_type,
    p_side,
    producer,
    wire_keys,
)

FINISH, CONTINUE, ERROR = (
    XferResponseStatus.FINISH,
    XferResponseStatus.CONTINUE,
    XferResponseStatus.ERROR,
)
LAYOUT_MISS = XferResponseStatus.LAYOUT_MISS

V2 = DPeer()
LEGACY_D = DPeer(v2=False)
BOTH = pytest.mark.parametrize("d", [V2, LEGACY_D], ids=["pdwire2-D", "legacy-D"])


def only_reply(out: list[object], identity: bytes) -> XferResponseV2:
    """The one reply on ``identity`` in ``out``; for a legacy D, its bytes have legacy keys only."""
    sent = [o for o in of_type(out, SendReply) if o.identity == identity]
    assert len(sent) == 1, f"expected one reply on {identity!r}, got {sent}"
    reply = decoded(sent)[0]
    if reply.pdwire_version == 0:
        assert wire_keys(sent[0].data) <= LEGACY_REPLY_KEYS
    return reply


def expect_code(d: DPeer, reply: XferResponseV2, code: ErrorCode, *, per_request: bool) -> None:
    """pdwire/2 D: the code is there (per request too); legacy D: no code at all (7.2-R2)."""
    if not d.v2:
        assert (reply.err_code, reply.err_codes, reply.pdwire_version) == (None, None, 0)
        return
    assert reply.pdwire_version == 2
    assert reply.err_code == code
    if per_request:
        assert reply.err_codes == dict.fromkeys(reply.err_reqs or (), code)


def serve(p: Driver[ProducerSession], identity: bytes, data: bytes, at: float) -> XferResponseV2:
    """Send a pull that P can serve at once, complete its write, and return the reply."""
    out = p(MessageReceived(identity, data), at)
    for w in of_type(out, StartWrite):
        out += p(WriteCompleted(w.write_id, 0))
    return only_reply(out, identity)


def frees(out: list[object]) -> list[tuple[str, FreeReason]]:
    return [(f.p_req_id, f.reason) for f in of_type(out, FreeBlocks)]


# -- §10.1 TP pairing --------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    ("p_tp", "p_rank", "d_tp", "d_rank", "expected"),
    [(2, 0, 4, 2, [0, 1]), (4, 3, 2, 0, [1]), (2, 1, 2, 0, [1])],
)
def test_unpaired_tp_rank_is_an_error(
    d: DPeer, p_tp: int, p_rank: int, d_tp: int, d_rank: int, expected: list[int]
) -> None:
    """10.1.3/10.1.4: a pull from a D rank P does not pair with gets ERROR and message #1."""
    p = Driver(producer(tp=p_tp, rank=p_rank))
    d = dataclasses.replace(d, side=d_side(d_tp, d_rank))
    reply = only_reply(p(MessageReceived(b"i", d.pull({"r1": ("x1", [[0]])}))), b"i")
    assert reply.status is ERROR and not reply.ok_reqs and not reply.err_reqs
    assert reply.err_msg == (
        f"This D tp_rank {d_rank} is not paired with P tp_rank {p_rank}; expected one of "
        f"{expected}."
    )
    expect_code(d, reply, ErrorCode.TP_RANK_NOT_PAIRED, per_request=False)
    assert (p.session.open_pulls, p.session.state_of("x1")) == (0, None)


@BOTH
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "message"),
    [
        (2, 3, "Remote tensor parallel size 3 is not divisible by local tensor parallel size 2."),
        (3, 2, "Local tensor parallel size 3 is not divisible by remote tensor parallel size 2."),
    ],
)
def test_tp_sizes_that_do_not_divide_get_vllms_text(
    d: DPeer, p_tp: int, d_tp: int, message: str
) -> None:
    """10.1.1: vLLM's P answers such a pull ERROR with its assertion's text; so does pdwire's."""
    p = Driver(producer(tp=p_tp, rank=0))
    d = dataclasses.replace(d, side=d_side(d_tp, 0))
    reply = only_reply(p(MessageReceived(b"i", d.pull({"r1": ("x1", [[0]])}))), b"i")
    assert (reply.status, reply.err_msg) == (ERROR, message)
    expect_code(d, reply, ErrorCode.TP_RANK_NOT_PAIRED, per_request=False)
    assert (p.session.open_pulls, p.session.state_of("x1")) == (0, None)


def _pairs(p_tp: int, p_rank: int, d_tp: int, d_rank: int) -> bool:
    """The pairing of §10.1 written out, independent of target_ranks."""
    if d_tp >= p_tp:
        return d_rank // (d_tp // p_tp) == p_rank
    return p_rank // (p_tp // d_tp) == d_rank


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_paired_tp_ranks_are_served(p_tp: int, d_tp: int) -> None:
    """10.1.3: P serves exactly the D ranks of target_ranks(P_tp, P_rank, D_tp)."""
    for p_rank in range(p_tp):
        p = Driver(producer(tp=p_tp, rank=p_rank))
        p(TransferFinished("x1", "p1", [[1, 2]]))
        served = []
        for d_rank in range(d_tp):
            d = DPeer(side=d_side(d_tp, d_rank), port=1 + d_rank)
            out = p(MessageReceived(b"i", d.pull({"r": ("x1", [[5, 6]])})))
            if of_type(out, StartWrite):
                assert decoded(out) == []
                served.append(d_rank)
            else:
                assert decoded(out)[0].status is ERROR
        assert served == [r for r in range(d_tp) if _pairs(p_tp, p_rank, d_tp, r)]
        assert served


# -- §3.7 layout cache -------------------------------------------------------------------------


@BOTH
def test_layout_miss_then_cache_hit(d: DPeer) -> None:
    """3.7-R10/R11/R12, 3.4-R3: an omitted, uncached layout gets LAYOUT_MISS and #3; a pull
    that carries the layout with a nonzero layout_id is echoed and cached, so a later pull
    without it is served with the same descriptors."""
    d = dataclasses.replace(d, layout_id=0x1235)
    p = Driver(producer())
    for n in range(3):
        p(TransferFinished(f"x{n}", f"p{n}", [[1, 2, 3]]))

    miss = only_reply(
        p(MessageReceived(b"a", d.pull({"r0": ("x0", [[5]])}, with_layout=False))), b"a"
    )
    assert miss.status is LAYOUT_MISS and not miss.ok_reqs and not miss.err_reqs
    assert miss.err_msg == "Mooncake KV layout 0x1235 from d0:1 is not cached."
    expect_code(d, miss, ErrorCode.LAYOUT_MISS, per_request=False)
    assert p.session.blocks_held == 3 and p.session.open_pulls == 0

    out = p(MessageReceived(b"b", d.pull({"r0": ("x0", [[5]])})))
    first = of_type(out, StartWrite)[0].descriptors
    out += p(WriteCompleted(of_type(out, StartWrite)[0].write_id))
    full = only_reply(out, b"b")
    assert (full.status, full.ok_reqs, full.layout_id) == (FINISH, ["r0"], 0x1235)

    out = p(MessageReceived(b"c", d.pull({"r1": ("x1", [[5]])}, with_layout=False)))
    again = of_type(out, StartWrite)[0].descriptors
    assert np.array_equal(first.dst, again.dst) and np.array_equal(first.length, again.length)
    out += p(WriteCompleted(of_type(out, StartWrite)[0].write_id))
    hit = only_reply(out, b"c")
    assert (hit.status, hit.ok_reqs, hit.layout_id) == (FINISH, ["r1"], 0x1235)

    # The cache is keyed by D's worker (3.7-R9): another port misses.
    other = dataclasses.replace(d, port=2)
    out = p(MessageReceived(b"d", other.pull({"r2": ("x2", [[5]])}, with_layout=False)))
    assert only_reply(out, b"d").status is LAYOUT_MISS


def test_layout_id_zero_is_never_cached() -> None:
    """3.7-R12: a pull with layout_id 0 is not stored, and its replies echo nothing."""
    p = Driver(producer())
    p(TransferFinished("x0", "p0", [[1]]))
    assert serve(p, b"a", V2.pull({"r0": ("x0", [[5]])}), 0).layout_id == 0


# -- §10.4 ready wait, §10.5 rounds ------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("pull_first", [True, False], ids=["pull-before-ready", "pull-after"])
def test_ready_wait_then_write_then_finish(d: DPeer, pull_first: bool) -> None:
    """10.4.2/10.4.3/10.4.6, 10.5.2/10.5.3: a pull waits until TransferFinished; the write
    starts then, and only its completion gives FINISH ok_reqs."""
    p = Driver(producer())
    pull = MessageReceived(b"i", d.pull({"r1": ("x1", [[7, 8]])}))
    p(TransferStarted("x1", "p1"))
    if pull_first:
        assert p(pull, 1) == []
        assert p.session.state_of("x1") is TransferState.RECORDED
        out = p(TransferFinished("x1", "p1", [[3, 4]]), 2)
    else:
        assert of_type(p(TransferFinished("x1", "p1", [[3, 4]]), 1), StartWrite) == []
        out = p(pull, 2)
    (write,) = of_type(out, StartWrite)
    assert not of_type(out, SendReply)
    assert (write.peer, write.d_req_ids) == ("d0:1", ("r1",))
    assert p.session.blocks_held == 1
    out = p(WriteCompleted(write.write_id, 0), 3)
    reply = only_reply(out, b"i")
    assert (reply.status, reply.ok_reqs, reply.err_reqs) == (FINISH, ["r1"], None)
    assert frees(out) == [("p1", FreeReason.SERVED)]
    assert (p.session.blocks_held, p.session.open_pulls) == (0, 0)


@BOTH
def test_ready_wait_expires_after_480s(d: DPeer) -> None:
    """10.4.4/10.4.5, §6.1 ready wait: at 480 s the waiting request is reported in err_reqs of
    a FINISH with message #7 (code READY_TIMEOUT); not a moment before."""
    p = Driver(producer())
    p(TransferStarted("x1", "p1"))
    p(MessageReceived(b"i", d.pull({"r1": ("x1", [[7]])})), 10)
    assert p.session.next_deadline() == 10 + T
    assert p.advance(10 + T - 0.001) == []
    reply = only_reply(p.advance(10 + T), b"i")
    assert (reply.status, reply.ok_reqs, reply.err_reqs) == (FINISH, None, ["r1"])
    assert reply.err_msg == "Timeout waiting for P side ready."
    expect_code(d, reply, ErrorCode.READY_TIMEOUT, per_request=True)
    assert p.session.open_pulls == 0
    assert p.session.state_of("x1") is TransferState.RECORDED  # P's request goes on


@BOTH
def test_continue_then_finish(d: DPeer) -> None:
    """10.5.1/10.5.6, 6.3-R2: two transfers of one pull that become ready apart give CONTINUE
    (first round) then FINISH; the ready wait restarts after each round."""
    p = Driver(producer())
    p(TransferStarted("x1", "p1"))
    p(TransferStarted("x2", "p2"))
    p(MessageReceived(b"i", d.pull({"r1": ("x1", [[5]]), "r2": ("x2", [[6]])})), 0)
    (w1,) = of_type(p(TransferFinished("x1", "p1", [[1]]), 100), StartWrite)
    assert w1.d_req_ids == ("r1",)
    first = only_reply(p(WriteCompleted(w1.write_id), 101), b"i")
    assert (first.status, first.ok_reqs, first.err_reqs) == (CONTINUE, ["r1"], None)
    # 101 + 470 is past the first wait's 480 s, but the wait restarted after the round.
    assert p.advance(101 + 470) == []
    (w2,) = of_type(p(TransferFinished("x2", "p2", [[2]]), 101 + 470), StartWrite)
    last = only_reply(p(WriteCompleted(w2.write_id), 600), b"i")
    assert (last.status, last.ok_reqs, last.err_reqs) == (FINISH, ["r2"], None)
    assert p.session.open_pulls == 0


@BOTH
def test_failed_write_fails_the_round(d: DPeer) -> None:
    """10.5.4, 10.3.4, 10.9.4: a batch write returning 7 fails every request of the round with
    message #9; the pull does not count as served, so P keeps the blocks."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    p(TransferFinished("x2", "p2", [[2]]))
    out = p(MessageReceived(b"i", d.pull({"r1": ("x1", [[5]]), "r2": ("x2", [[6]])})))
    (write,) = of_type(out, StartWrite)
    assert set(write.d_req_ids) == {"r1", "r2"}
    out = p(WriteCompleted(write.write_id, 7), 1)
    reply = only_reply(out, b"i")
    assert (reply.status, reply.ok_reqs, sorted(reply.err_reqs or ())) == (
        FINISH,
        None,
        ["r1", "r2"],
    )
    assert reply.err_msg == "Mooncake transfer engine returned 7"
    expect_code(d, reply, ErrorCode.ENGINE_ERROR, per_request=True)
    assert frees(out) == [] and p.session.blocks_held == 2
    # D may pull again; this time it is served and P frees.
    assert serve(p, b"j", d.pull({"r1": ("x1", [[5]])}), 2).ok_reqs == ["r1"]
    assert p.session.blocks_held == 1


@pytest.mark.parametrize("deadline_ms", [5_000, 0])
def test_pdwire2_deadline_ms_is_honoured(deadline_ms: int) -> None:
    """6.3-R5, §6.2: a pull's nonzero deadline_ms ends the wait early with DEADLINE_EXCEEDED;
    without one, only the 480 s ready wait ends it."""
    p = Driver(producer())
    p(MessageReceived(b"i", V2.pull({"r1": ("x1", [[5]])}, deadline_ms=deadline_ms)), 1)
    out = p.advance(1 + deadline_ms / 1000 if deadline_ms else 1 + T)
    reply = only_reply(out, b"i")
    assert reply.err_reqs == ["r1"]
    if deadline_ms:
        assert reply.err_msg == "Consumer deadline exceeded."
        assert reply.err_codes == {"r1": ErrorCode.DEADLINE_EXCEEDED}
    else:
        assert reply.err_codes == {"r1": ErrorCode.READY_TIMEOUT}


# -- §10.3 need_send ---------------------------------------------------------------------------


@pytest.mark.parametrize("p_rank", [0, 1])
def test_need_send_p_tp2_d_tp1_frees_after_one_pull(p_rank: int) -> None:
    """10.3.1, 10.8.3: P TP2, D TP1: each P rank pairs with D rank 0 only, so one pull serves
    the transfer; P writes its half-head shard at offset (P_rank mod 2) x L_P."""
    p = Driver(producer(tp=2, rank=p_rank))
    d = DPeer(side=d_side(1, 0))
    p(TransferFinished("x1", "p1", [[3]]))
    out = p(MessageReceived(b"i", d.pull({"r1": ("x1", [[9]])})))
    (write,) = of_type(out, StartWrite)
    src, dst = p_side(2, p_rank).regions, d.side.regions
    l_p = src[0].kv_block_len
    assert dst[0].kv_block_len == 2 * l_p
    assert write.descriptors.src.tolist() == [r.base_addr + 3 * r.block_len for r in src]
    assert write.descriptors.dst.tolist() == [
        r.base_addr + 9 * r.block_len + p_rank * l_p for r in dst
    ]
    out = p(WriteCompleted(write.write_id))
    assert frees(out) == [("p1", FreeReason.SERVED)]


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_need_send_p_tp1_d_tp2_frees_after_both_ranks(order: tuple[int, int]) -> None:
    """10.3.1/10.3.2, 10.9.1: P TP1, D TP2: need_send is 2, so P frees only after both D
    ranks pulled, whichever comes first."""
    p = Driver(producer(tp=1))
    p(TransferFinished("x1", "p1", [[3]]))
    peers = {r: DPeer(side=d_side(2, r), port=1 + r) for r in (0, 1)}
    first, second = order
    assert serve(p, b"a", peers[first].pull({"r": ("x1", [[4]])}), 1).ok_reqs == ["r"]
    assert frees(p.log) == [] and p.session.blocks_held == 1
    serve(p, b"b", peers[second].pull({"r": ("x1", [[4]])}), 2)
    assert frees(p.log) == [("p1", FreeReason.SERVED)] and p.session.blocks_held == 0


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["shared-stage-first", "no-op-first"])
def test_heterogeneous_pp_holds_until_every_d_stage_pulled(order: tuple[int, int]) -> None:
    """10.2.3, 10.2.7, 10.3.1, 10.3.3: P PP4 stage 0 holds layer 0 only; D PP2 pulls it from
    both its stages. The stage without layer 0 gets a no-op pull (no write, ok); P keeps the
    blocks until both stages pulled (need_send = 1 x remote_pp_size)."""
    p = Driver(producer(pp=4, pp_rank=0))
    assert {r.layer_index for r in p.session.config.side.regions} == {0}
    p(TransferFinished("x1", "p1", [[3]]))
    stages = {s: DPeer(side=d_side(pp=2, pp_rank=s), port=1 + s, pp_rank=s) for s in (0, 1)}
    for n, stage in enumerate(order):
        out = p(MessageReceived(b"%d" % stage, stages[stage].pull({"r": ("x1", [[4]])})), n)
        writes = of_type(out, StartWrite)
        if stage == 0:  # the stage holding layer 0: K and V of layer 0
            assert len(writes) == 1 and len(writes[0].descriptors) == 2
            out += p(WriteCompleted(writes[0].write_id))
        else:  # no shared layer: answered at once, no write
            assert writes == []
        assert only_reply(out, b"%d" % stage).ok_reqs == ["r"]
        expected = [("p1", FreeReason.SERVED)] if n == 1 else []
        assert frees(p.log) == expected


# -- §10.6 block selection ---------------------------------------------------------------------


def test_partial_prefix_hit_uses_ps_last_blocks() -> None:
    """10.6.5, 10.8.12/10.8.13: D asks for 2 blocks, P holds 4: P sends its last 2 (12, 13),
    as one coalesced run per region at base + id x stride."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[10, 11, 12, 13]]))
    out = p(MessageReceived(b"i", V2.pull({"r1": ("x1", [[5, 6]])})))
    (write,) = of_type(out, StartWrite)
    src, dst = p_side().regions, V2.side.regions
    assert write.descriptors.src.tolist() == [r.base_addr + 12 * r.block_len for r in src]
    assert write.descriptors.dst.tolist() == [r.base_addr + 5 * r.block_len for r in dst]
    assert write.descriptors.length.tolist() == [2 * r.kv_block_len for r in src]


@BOTH
@pytest.mark.parametrize(
    ("p_blocks", "d_blocks", "message", "code"),
    [
        ([[1, 2]], [[1], [2]], "KV group count mismatch", ErrorCode.KV_GROUP_COUNT_MISMATCH),
        ([[1]], [[1, 2]], "P num blocks less than D", ErrorCode.P_BLOCKS_LESS_THAN_D),
    ],
)
def test_block_selection_errors_are_per_request(
    d: DPeer, p_blocks: list[list[int]], d_blocks: list[list[int]], message: str, code: ErrorCode
) -> None:
    """10.6.2/10.6.4, 3.3-R3, 10.3.4: the request fails in err_reqs with #8a/#8b while the other
    request of the pull is served; the failed transfer keeps its blocks."""
    p = Driver(producer())
    p(TransferFinished("bad", "p1", p_blocks))
    p(TransferFinished("good", "p2", [[4]]))
    out = p(MessageReceived(b"i", d.pull({"rb": ("bad", d_blocks), "rg": ("good", [[9]])})))
    (write,) = of_type(out, StartWrite)
    assert write.d_req_ids == ("rg",)
    reply = only_reply(out + p(WriteCompleted(write.write_id)), b"i")
    assert (reply.status, reply.ok_reqs, reply.err_reqs) == (FINISH, ["rg"], ["rb"])
    assert reply.err_msg == message
    expect_code(d, reply, code, per_request=True)
    assert p.session.state_of("bad") is TransferState.READY and p.session.blocks_held == 1


def test_release_only_request_is_ok_without_a_write() -> None:
    """10.6.1, 3.2-R5, 10.3.3: a release-only request is written nothing, listed in ok_reqs and
    counts as served."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    out = p(MessageReceived(b"i", V2.pull({"r1": ("x1", [])})))
    assert of_type(out, StartWrite) == []
    assert only_reply(out, b"i").ok_reqs == ["r1"]
    assert frees(out) == [("p1", FreeReason.SERVED)]


# -- §10.11 will-not-send, expiry, duplicates ---------------------------------------------------


@pytest.mark.parametrize(
    "d",
    [
        V2,
        LEGACY_D,
        DPeer(caps=tuple(sorted(ALL_CAPS - {"will-not-send"}))),
    ],
    ids=["pdwire2-D", "legacy-D", "pdwire2-D-without-will-not-send"],
)
def test_will_not_send_answers_at_once(d: DPeer) -> None:
    """10.11.1, 10.9.5, 7.2-R5/R6/R7, 7.2-R3: TransferWillNotSend frees at once and answers the
    waiting pull at once with FINISH err_reqs and "Prefill will not send KV for this request.";
    a later pull for the transfer is answered at once too. The code WILL_NOT_SEND goes only to
    a pdwire/2 D with which will-not-send is agreed."""
    p = Driver(producer())
    p(TransferStarted("x1", "p1"))
    p(MessageReceived(b"a", d.pull({"r1": ("x1", [[5]])})), 1)
    at_once = p(TransferWillNotSend("x1", "p1", "stop"), 2)
    assert frees(at_once) == [("p1", FreeReason.WILL_NOT_SEND)]
    assert p.session.state_of("x1") is TransferState.NOT_SENT
    later = p(MessageReceived(b"b", d.pull({"r1": ("x1", [[5]])})), 3)
    for identity, out in ((b"a", at_once), (b"b", later)):
        reply = only_reply(out, identity)
        assert (reply.status, reply.ok_reqs, reply.err_reqs) == (FINISH, None, ["r1"])
        assert reply.err_msg == "Prefill will not send KV for this request."
        if "will-not-send" in d.caps and d.v2:
            expect_code(d, reply, ErrorCode.WILL_NOT_SEND, per_request=True)
        else:
            assert not reply.err_code and not reply.err_codes
    assert p.session.open_pulls == 0 and len(frees(p.log)) == 1


@BOTH
def test_placeholder_expires_and_is_forgotten(d: DPeer) -> None:
    """10.11.4, §6.2 placeholder expiry, 6.3-R9: a pull for a transfer P never records is
    answered at 480 s; a second pull at 100 s is answered at 480 s too (the placeholder's timer
    is not restarted) with EXPIRED; the tombstone is forgotten after the retention timer."""
    p = Driver(producer())
    p(MessageReceived(b"a", d.pull({"r1": ("x1", [[5]])})), 0)
    assert p.session.state_of("x1") is TransferState.PLACEHOLDER
    p(MessageReceived(b"b", d.pull({"r1": ("x1", [[5]])})), 100)
    out = p.advance(T)
    first, second = only_reply(out, b"a"), only_reply(out, b"b")
    for reply in (first, second):
        assert (reply.status, reply.ok_reqs, reply.err_reqs) == (FINISH, None, ["r1"])
    assert second.err_msg == "KV expired on P side before the pull."
    expect_code(d, second, ErrorCode.EXPIRED, per_request=True)
    assert p.session.open_pulls == 0
    assert p.session.state_of("x1") is TransferState.EXPIRED
    p.advance(3 * T)
    assert p.session.state_of("x1") is None and p.session.next_deadline() is None


def test_duplicate_transfer_started_is_rejected() -> None:
    """10.11.6-10.11.8: a second request with a taken transfer_id is rejected (RejectRequest);
    the first keeps the transfer."""
    p = Driver(producer())
    assert p(TransferStarted("x1", "p1")) == []
    out = p(TransferStarted("x1", "p2"))
    assert out == [
        RejectRequest("p2", "x1", ErrorCode.DUPLICATE_TRANSFER_ID, "Duplicate transfer_id x1.")
    ]
    p(TransferFinished("x1", "p1", [[1]]))
    serve(p, b"i", V2.pull({"r1": ("x1", [[5]])}), 1)
    assert frees(p.log) == [("p1", FreeReason.SERVED)]


@BOTH
def test_duplicate_transfer_id_across_and_within_pulls(d: DPeer) -> None:
    """10.11.9/10.11.10: a transfer_id binds to the d_req_id of the first pull naming it; a pull
    naming it with another d_req_id, or twice in one pull, gets DUPLICATE_TRANSFER_ID."""
    p = Driver(producer())
    p(TransferStarted("x1", "p1"))
    p(MessageReceived(b"a", d.pull({"r1": ("x1", [[5]])})))
    reply = only_reply(p(MessageReceived(b"b", d.pull({"r2": ("x1", [[5]])}))), b"b")
    assert (reply.status, reply.ok_reqs, reply.err_reqs) == (FINISH, None, ["r2"])
    assert reply.err_msg == "Duplicate transfer_id x1."
    expect_code(d, reply, ErrorCode.DUPLICATE_TRANSFER_ID, per_request=True)

    p(TransferStarted("x2", "p2"))
    out = p(MessageReceived(b"c", d.pull({"s1": ("x2", [[5]]), "s2": ("x2", [[6]])})))
    reply = only_reply(out, b"c")
    assert (reply.status, reply.err_reqs) == (CONTINUE, ["s2"])
    assert reply.err_msg == "Duplicate transfer_id x2."
    # The first binding is intact: r1 is still served.
    out = p(TransferFinished("x1", "p1", [[1]]), 1)
    out += p(WriteCompleted(of_type(out, StartWrite)[0].write_id))
    assert only_reply(out, b"a").ok_reqs == ["r1"]


# -- §10.9 freeing, §6 retention ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("d_tp", "reason"), [(1, FreeReason.SERVED), (2, FreeReason.EXPIRED)], ids=["served", "expired"]
)
def test_no_expiry_while_a_write_is_in_flight(d_tp: int, reason: FreeReason) -> None:
    """10.9.2, 6.3-R1: the retention timer passes while a write is in flight; P frees only after
    WriteCompleted (served when that was the last pull, else expired right then)."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]), 0)
    d = DPeer(side=d_side(d_tp, 0))
    (write,) = of_type(p(MessageReceived(b"i", d.pull({"r1": ("x1", [[2]])})), 10), StartWrite)
    assert frees(p.advance(T + 100)) == [] and p.session.blocks_held == 1
    out = p(WriteCompleted(write.write_id))
    assert only_reply(out, b"i").ok_reqs == ["r1"]
    assert frees(out) == [("p1", reason)] and p.session.blocks_held == 0


@BOTH
def test_ready_transfer_expires_without_pulls(d: DPeer) -> None:
    """10.9.1, §6.1 retention, 10.5.7/10.11.5: a READY transfer no one pulls is freed
    (expired) at 480 s; a later pull gets EXPIRED at once."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]), 5)
    assert frees(p.advance(5 + T - 0.01)) == []
    assert frees(p.advance(5 + T)) == [("p1", FreeReason.EXPIRED)]
    assert p.session.blocks_held == 0
    reply = only_reply(p(MessageReceived(b"i", d.pull({"r1": ("x1", [[2]])}))), b"i")
    assert (reply.status, reply.err_reqs) == (FINISH, ["r1"])
    assert reply.err_msg == "KV expired on P side before the pull."
    expect_code(d, reply, ErrorCode.EXPIRED, per_request=True)


# -- §3.5 cancel (pdwire/2) --------------------------------------------------------------------


def test_cancel_withdraws_a_waiting_pull() -> None:
    """3.5-R7/R8/R9/R12/R13: a cancel ends the waiting pull with FINISH err_reqs CANCELLED and
    is answered FINISH ok_reqs; the withdrawn pull counts as settled, so P frees as soon as the
    request finishes (3.5-R14/R15)."""
    p = Driver(producer())
    p(TransferStarted("x1", "p1"))
    p(MessageReceived(b"pull", V2.pull({"r1": ("x1", [[5]])})), 1)
    out = p(MessageReceived(b"cancel", V2.cancel({"r1": "x1"})), 2)
    withdrawn, answer = only_reply(out, b"pull"), only_reply(out, b"cancel")
    assert (withdrawn.status, withdrawn.ok_reqs, withdrawn.err_reqs) == (FINISH, None, ["r1"])
    assert withdrawn.err_msg == "Request cancelled by the consumer."
    assert withdrawn.err_codes == {"r1": ErrorCode.CANCELLED}
    assert (answer.status, answer.ok_reqs, answer.err_reqs) == (FINISH, ["r1"], None)
    assert p.session.open_pulls == 0
    out = p(TransferFinished("x1", "p1", [[1]]), 3)
    assert of_type(out, StartWrite) == [] and len(frees(out)) == 1
    assert p.session.blocks_held == 0


@pytest.mark.parametrize("other_pulled", [True, False])
def test_cancel_of_a_ready_transfer_frees_when_nothing_else_is_due(other_pulled: bool) -> None:
    """3.5-R14/R15, 10.3.5: P TP1, D TP2 (need_send 2). D rank 1 cancels: P frees at once when
    rank 0 has already pulled, and otherwise only after rank 0's pull."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    d0, d1 = DPeer(side=d_side(2, 0)), DPeer(side=d_side(2, 1), port=2)
    if other_pulled:
        serve(p, b"p0", d0.pull({"r1": ("x1", [[5]])}), 1)
    out = p(MessageReceived(b"c1", d1.cancel({"r1": "x1"})), 2)
    assert only_reply(out, b"c1").ok_reqs == ["r1"]
    assert bool(frees(out)) is other_pulled
    if not other_pulled:
        serve(p, b"p0", d0.pull({"r1": ("x1", [[5]])}), 3)
    assert len(frees(p.log)) == 1 and p.session.blocks_held == 0


def test_cancel_during_a_write_is_answered_after_it() -> None:
    """3.5-R10/R11: a cancel that names a request being written is answered only after
    WriteCompleted, with exactly one FINISH reply; no new write starts for it."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    (write,) = of_type(p(MessageReceived(b"pull", V2.pull({"r1": ("x1", [[5]])}))), StartWrite)
    assert p(MessageReceived(b"cancel", V2.cancel({"r1": "x1"})), 1) == []
    out = p(WriteCompleted(write.write_id), 2)
    assert only_reply(out, b"pull").ok_reqs == ["r1"]
    answer = only_reply(out, b"cancel")
    assert answer.status is FINISH and not answer.err_reqs
    assert of_type(out, StartWrite) == [] and len(frees(p.log)) == 1


def test_cancel_before_p_records_frees_at_transfer_finished() -> None:
    """3.5-R9/R16: a cancel for a transfer P holds nothing for lists nothing, is remembered, and
    P frees the blocks as soon as the request finishes, without any write."""
    p = Driver(producer())
    answer = only_reply(p(MessageReceived(b"c", V2.cancel({"r1": "x1"}))), b"c")
    assert (answer.status, answer.ok_reqs) == (FINISH, None)
    assert p.session.state_of("x1") is TransferState.CANCELLED
    assert p(TransferStarted("x1", "p1"), 1) == []
    out = p(TransferFinished("x1", "p1", [[1]]), 2)
    assert frees(out) == [("p1", FreeReason.CANCELLED)] and of_type(out, StartWrite) == []
    assert p.session.blocks_held == 0


def test_cancel_refused_without_the_capability() -> None:
    """10.11.2, 8.5: a P that does not announce 'cancel' answers a cancel with ERROR and acts on
    nothing: the waiting pull still waits."""
    p = Driver(producer(caps=ALL_CAPS - {"cancel"}))
    p(TransferStarted("x1", "p1"))
    p(MessageReceived(b"pull", V2.pull({"r1": ("x1", [[5]])})))
    out = p(MessageReceived(b"c", V2.cancel({"r1": "x1"})))
    assert [o.identity for o in of_type(out, SendReply)] == [b"c"]
    answer = only_reply(out, b"c")
    assert answer.status is ERROR and not answer.ok_reqs
    assert p.session.open_pulls == 1
    assert "cancel" not in answer.pdwire_caps


# -- checks before the wait: fingerprint, remote_pp_size, auth, decoding -------------------------


def test_fingerprint_mismatch_names_the_fields() -> None:
    """3.6-R3/R4/R5, 10.11.14: a differing fingerprint is an ERROR FINGERPRINT_MISMATCH naming
    every differing field in declaration order; an equal or absent one is served (3.6-R7)."""
    p = Driver(producer(fingerprint=FP))
    p(TransferFinished("x1", "p1", [[1]]))
    other = dataclasses.replace(FP, model="other", block_size=32)
    bad = DPeer(fingerprint=other)
    reply = only_reply(p(MessageReceived(b"i", bad.pull({"r1": ("x1", [[5]])}))), b"i")
    assert reply.status is ERROR
    assert reply.err_msg == "Compatibility fingerprint mismatch in model, block_size."
    assert reply.err_code == ErrorCode.FINGERPRINT_MISMATCH
    assert p.session.blocks_held == 1 and p.session.state_of("x1") is TransferState.READY
    assert serve(p, b"j", DPeer(fingerprint=FP).pull({"r1": ("x1", [[5]])}), 1).ok_reqs == ["r1"]
    p(TransferFinished("x2", "p2", [[1]]))
    assert serve(p, b"k", V2.pull({"r2": ("x2", [[5]])}), 2).ok_reqs == ["r2"]


@BOTH
@pytest.mark.parametrize(("p_pp", "fingerprint"), [(1, None), (2, FP)], ids=["pp1", "fp"])
def test_missing_remote_pp_size(d: DPeer, p_pp: int, fingerprint: object) -> None:
    """10.11.11/10.11.12/10.11.15: a D stage holding 2 of 4 layers that sends remote_pp_size 1
    gets ERROR and MISSING_REMOTE_PP_SIZE (no code for a legacy D), before any alignment."""
    p = Driver(producer(pp=p_pp, fingerprint=fingerprint))
    d = dataclasses.replace(d, side=d_side(pp=2, pp_rank=0))
    out = p(MessageReceived(b"i", d.pull({"r1": ("x1", [[5]])}, remote_pp_size=1)))
    reply = only_reply(out, b"i")
    assert reply.status is ERROR
    assert reply.err_msg == "Consumer registered 2 of 4 layers but sent no remote_pp_size."
    expect_code(d, reply, ErrorCode.MISSING_REMOTE_PP_SIZE, per_request=False)
    assert p.session.state_of("x1") is None


def test_an_opaque_packed_row_is_not_a_missing_remote_pp_size() -> None:
    """10.11.11: a D of one stage whose single region is an opaque packed row names only its
    first layer; P does not take that for a stage that sent no remote_pp_size."""
    p = Driver(producer(fingerprint=FP))
    p(TransferFinished("x1", "p1", [[1]]))
    first = d_side().regions[0]
    whole = dataclasses.replace(first, kv_block_len=first.block_len, row_offset=0)
    d = DPeer(side=dataclasses.replace(d_side(), regions=(whole,)), fingerprint=FP)
    reply = only_reply(p(MessageReceived(b"i", d.pull({"r1": ("x1", [[5]])}))), b"i")
    assert reply.err_code == ErrorCode.LAYER_ALIGNMENT, reply  # its regions are not P's


def _packed(side: Side) -> Side:
    """``side`` with its first region an opaque packed row (row offset 0, a whole row)."""
    first = dataclasses.replace(side.regions[0], row_offset=0)
    return dataclasses.replace(side, regions=(first, *side.regions[1:]))


@BOTH
@pytest.mark.parametrize("packed", ["D", "P"])
def test_packed_rows_across_pp_sizes(d: DPeer, packed: str) -> None:
    """10.2.8: with an opaque packed row on either side, a D of another PP size gets ERROR and
    PP_PACKED_ROWS (message #2) before any wait; a D of P's PP size is served."""
    p_worker = _packed(p_side()) if packed == "P" else p_side()
    p = Driver(ProducerSession(ProducerConfig(side=p_worker)))
    p(TransferFinished("x1", "p1", [[1]]))
    stage = d_side(pp=2, pp_rank=0)
    peer = dataclasses.replace(d, side=_packed(stage) if packed == "D" else stage)
    reply = only_reply(p(MessageReceived(b"i", peer.pull({"r1": ("x1", [[5]])}))), b"i")
    assert reply.status is ERROR
    assert reply.err_msg == (
        "Mooncake non-page-contiguous packed regions keep only the first layer name, so they "
        "cannot be aligned across PP sizes 1 and 2."
    )
    expect_code(d, reply, ErrorCode.PP_PACKED_ROWS, per_request=False)
    assert p.session.open_pulls == 0 and p.session.state_of("x1") is TransferState.READY
    same_pp = dataclasses.replace(d, side=_packed(d_side()) if packed == "D" else d_side())
    assert serve(p, b"j", same_pp.pull({"r1": ("x1", [[5]])}), 1).ok_reqs == ["r1"]


def test_row_offsets_of_whole_tensors_are_not_packed() -> None:
    """3.2-R10: a region that is a tensor of its own sends row offset -1, and only a whole row
    at offset 0 is an opaque packed row."""
    assert {r.row_offset for r in p_side().regions} == {-1}
    region = p_side().regions[0]
    assert has_opaque_packed_row([dataclasses.replace(region, row_offset=0)])
    assert not has_opaque_packed_row([region])
    half = dataclasses.replace(region, row_offset=0, kv_block_len=region.block_len // 2)
    assert not has_opaque_packed_row([half])


def test_auth_rejects_unsigned_and_serves_signed() -> None:
    """8.6-R5/R6/R7: with a key, an unsigned or wrongly signed pull gets ERROR AUTH_FAILED and
    is not acted on; a signed one is served, and the replies to it are signed."""
    key = b"k" * 32
    p = Driver(producer(auth_key=key))
    p(TransferFinished("x1", "p1", [[1]]))
    refused = ((b"u", V2), (b"w", DPeer(auth_key=b"x" * 32)), (b"l", LEGACY_D))
    for identity, peer in refused:
        reply = only_reply(p(MessageReceived(identity, peer.pull({"r1": ("x1", [[5]])}))), identity)
        assert reply.status is ERROR
        assert reply.err_msg == "auth_tag missing or invalid."
        # 8.6-R14: a legacy pull is refused too, in a reply with no pdwire/2 field (3.4-R6).
        assert reply.err_code == (None if peer is LEGACY_D else ErrorCode.AUTH_FAILED)
    assert p.session.state_of("x1") is TransferState.READY and p.session.open_pulls == 0
    pull = DPeer(auth_key=key).pull({"r1": ("x1", [[5]])})
    reply = serve(p, b"s", pull, 1)
    assert reply.ok_reqs == ["r1"] and reply.auth_tag is not None
    auth.verify(reply, key, answers=decode_pull(pull).auth_tag)  # 8.6-R13
    with pytest.raises(RemoteProtocolError):
        auth.verify(reply, key)
    unsigned_cancel = only_reply(p(MessageReceived(b"c", V2.cancel({"r9": "x9"}))), b"c")
    assert unsigned_cancel.err_code == ErrorCode.AUTH_FAILED
    assert p.session.state_of("x9") is None


def test_malformed_frame_then_keeps_serving() -> None:
    """§2.4, 7.1 #10, 7.3-R3: b"\\x00garbage" gets ERROR with the decode error (BAD_MESSAGE) and
    the session goes on serving."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    reply = only_reply(p(MessageReceived(b"g", b"\x00garbage")), b"g")
    assert reply.status is ERROR and reply.err_msg and "malformed" in reply.err_msg
    assert serve(p, b"i", V2.pull({"r1": ("x1", [[5]])}), 1).ok_reqs == ["r1"]


def _truncated_pull() -> bytes:
    return V2.pull({"r1": ("x1", [[5]])})[:-3]


def _bad_type_pull() -> bytes:
    obj = msgspec.msgpack.decode(V2.pull({"r1": ("x1", [[5]])}))
    obj["remote_port"] = "nine"
    return msgspec.msgpack.encode(obj)


def _rank_above_size_pull() -> bytes:
    obj = msgspec.msgpack.decode(V2.pull({"r1": ("x1", [[5]])}))
    obj["remote_tp_rank"] = 3
    return msgspec.msgpack.encode(obj)


def _short_region_list_pull() -> bytes:
    obj = msgspec.msgpack.decode(V2.pull({"r1": ("x1", [[5]])}))
    obj["block_lens"] = obj["block_lens"][:1]
    return msgspec.msgpack.encode(obj)


def _bad_type_cancel() -> bytes:
    obj = msgspec.msgpack.decode(V2.cancel({"r1": "x1"}))
    obj["cancel_reqs"] = ["r1", "x1"]
    return msgspec.msgpack.encode(obj)


def _pp_rank_above_size_cancel() -> bytes:
    obj = msgspec.msgpack.decode(V2.cancel({"r1": "x1"}))
    obj["remote_pp_rank"] = 2
    return msgspec.msgpack.encode(obj)


BAD_FRAMES = {
    "truncated-pull": _truncated_pull,
    "truncated-cancel": lambda: V2.cancel({"r1": "x1"})[:-2],
    "pull-wrong-type": _bad_type_pull,
    "pull-rank-above-size": _rank_above_size_pull,
    "pull-short-region-list": _short_region_list_pull,
    "cancel-wrong-type": _bad_type_cancel,
    "cancel-pp-rank-above-size": _pp_rank_above_size_cancel,
    "reply-sent-to-P": lambda: msgspec.msgpack.encode({"status": 0, "ok_reqs": ["r1"]}),
    "map-without-known-keys": lambda: msgspec.msgpack.encode({"hello": 1}),
    "not-a-map": lambda: msgspec.msgpack.encode(["req_blocks"]),
    "empty": lambda: b"",
    "garbage": lambda: b"\x00garbage",
}


def _announces_v2(data: bytes) -> bool:
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return False
    return isinstance(obj, dict) and obj.get("pdwire_version", 0) >= 2


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_bad_input_is_an_error_reply_and_changes_nothing(frame: object) -> None:
    """2.4-R1/R2/R3/R5, 3.5-R6, 3.2-R3, 10.9.4, 7.3-R3: every undecodable pull or cancel is
    answered with one ERROR reply (no ok_reqs; BAD_MESSAGE when the frame announced pdwire/2),
    raises nothing, frees nothing and leaves every transfer and waiting pull as it was."""
    assert callable(frame)
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    p(TransferStarted("x2", "p2"))
    p(MessageReceived(b"wait", V2.pull({"w": ("x2", [[5]])})))
    before = (p.session.blocks_held, p.session.open_pulls, p.session.next_deadline())
    data = frame()
    out = p(MessageReceived(b"bad", data), 1)
    assert [type(o) for o in out] == [SendReply]
    reply = only_reply(out, b"bad")
    assert reply.status is ERROR and not reply.ok_reqs and reply.err_msg
    # 2.4-R2: the code goes to a sender whose frame readably announced pdwire/2, and only there.
    expected_code = ErrorCode.BAD_MESSAGE if _announces_v2(data) else None
    assert reply.err_code == expected_code
    assert (p.session.blocks_held, p.session.open_pulls, p.session.next_deadline()) == before
    assert p.session.state_of("x1") is TransferState.READY
    assert p.session.state_of("x2") is TransferState.RECORDED
    # Still serving: the waiting pull and a new one.
    out = p(TransferFinished("x2", "p2", [[2]]), 2)
    out += p(WriteCompleted(of_type(out, StartWrite)[0].write_id))
    assert only_reply(out, b"wait").ok_reqs == ["w"]
    assert serve(p, b"i", V2.pull({"r1": ("x1", [[5]])}), 3).ok_reqs == ["r1"]


def test_oversize_message_is_rejected() -> None:
    """§2.3 limits: a frame above the size limit is answered ERROR without being decoded."""
    p = Driver(producer(limits=Limits(message_bytes=64)))
    data = V2.pull({"r1": ("x1", [[5]])})
    assert len(data) > 64
    reply = only_reply(p(MessageReceived(b"i", data)), b"i")
    assert reply.status is ERROR and "exceeds the limit" in (reply.err_msg or "")
    assert p.session.state_of("x1") is None


def test_finishing_twice_is_a_local_protocol_error() -> None:
    """§10.12: (ready, request finished) is not a transition; the session raises
    LocalProtocolError and keeps its state."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    with pytest.raises(LocalProtocolError):
        p(TransferFinished("x1", "p1", [[1]]))
    assert p.session.state_of("x1") is TransferState.READY and p.session.blocks_held == 1


# -- fixed defects: each test pins the fix --------------------------------------------------------


def test_cancel_while_another_request_of_the_pull_is_written() -> None:
    """3.5-R12/R13, 3.4-R14/R17: the pull reports the cancelled request, then FINISHes only once
    the request being written is reported; the cancel itself is answered at once (3.5-R10
    concerns only the listed requests)."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    p(TransferStarted("x2", "p2"))
    out = p(MessageReceived(b"pull", V2.pull({"r1": ("x1", [[5]]), "r2": ("x2", [[6]])})))
    (write,) = of_type(out, StartWrite)
    assert write.d_req_ids == ("r1",)
    out = p(MessageReceived(b"c", V2.cancel({"r2": "x2"})), 1)
    assert only_reply(out, b"c").ok_reqs == ["r2"]
    out += p(WriteCompleted(write.write_id), 2)
    replies = decoded(out, b"pull")
    assert [r.status for r in replies][-1] is FINISH
    assert all(r.status is CONTINUE for r in replies[:-1])
    assert [d for r in replies for d in r.ok_reqs or ()] == ["r1"]
    assert [d for r in replies for d in r.err_reqs or ()] == ["r2"]


def test_no_free_while_another_write_of_the_transfer_is_in_flight() -> None:
    """10.9.2: P MUST NOT free a transfer's blocks while any write from them is in flight."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    (w1,) = of_type(p(MessageReceived(b"a", V2.pull({"r1": ("x1", [[5]])}))), StartWrite)
    (w2,) = of_type(p(MessageReceived(b"b", V2.pull({"r1": ("x1", [[5]])}))), StartWrite)
    assert frees(p(WriteCompleted(w1.write_id), 1)) == []
    assert frees(p(WriteCompleted(w2.write_id), 2)) == [("p1", FreeReason.SERVED)]


def test_will_not_send_after_the_placeholder_expired() -> None:
    """10.11.1, 10.9.5, 10.11.4: P's request is aborted while queued (no TransferStarted), after
    the placeholder a pull created for it expired: P frees at once, raises nothing, and
    remembers the transfer as will-not-send for later pulls."""
    p = Driver(producer())
    p(MessageReceived(b"a", V2.pull({"r1": ("x1", [[5]])})), 0)
    p.advance(T + 20)
    assert p.session.state_of("x1") is TransferState.EXPIRED
    out = p(TransferWillNotSend("x1", "p1", "abort"), T + 21)
    assert frees(out) == [("p1", FreeReason.WILL_NOT_SEND)]
    reply = only_reply(p(MessageReceived(b"b", V2.pull({"r1": ("x1", [[5]])})), T + 22), b"b")
    assert reply.err_msg == "Prefill will not send KV for this request."


def test_cancels_do_not_free_during_a_write() -> None:
    """10.9.2, 3.5-R10/R15: P TP1, D TP2 (need_send 2). While D rank 0's write of x1 is in
    flight, cancels from both ranks must not free x1 before WriteCompleted."""
    p = Driver(producer())
    p(TransferFinished("x1", "p1", [[1]]))
    d0, d1 = DPeer(side=d_side(2, 0)), DPeer(side=d_side(2, 1), port=2)
    (write,) = of_type(p(MessageReceived(b"a", d0.pull({"r1": ("x1", [[5]])}))), StartWrite)
    out = p(MessageReceived(b"c0", d0.cancel({"other": "x1"})), 1)
    out += p(MessageReceived(b"c1", d1.cancel({"r1": "x1"})), 2)
    assert frees(out) == []
    assert frees(p(WriteCompleted(write.write_id), 3)) == [("p1", FreeReason.SERVED)]
