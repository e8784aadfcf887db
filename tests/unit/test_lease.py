"""The KV lease of vLLM 0.34 (spec §3.9, §6.4): the heartbeat's codec, P's lease and its
remembered expiries, D's renewals, in virtual time."""

from __future__ import annotations

import msgspec
import pytest

from pdwire import DecodeError, LocalProtocolError, XferResponseStatus, decode_message
from pdwire.codec import decode_heartbeat, encode_heartbeat
from pdwire.consumer import ConsumerSession
from pdwire.events import (
    AbortRequested,
    ClosePull,
    EngineResolved,
    FreeBlocks,
    FreeReason,
    LeaseRejected,
    LoadRequest,
    LoadsRequested,
    MessageReceived,
    QueryBootstrap,
    ReplyReceived,
    RequestQueued,
    SendPull,
    SendReply,
    StartWrite,
    TransferFinished,
    WriteCompleted,
)
from pdwire.messages import LeaseHeartbeat
from pdwire.producer import ProducerConfig
from pdwire.transitions import TransferState

from .sessions_helpers import (
    LEGACY_REPLY_KEYS,
    DPeer,
    Driver,
    T,
    consumer,
    decoded,
    entry,
    of_type,
    producer,
    reply_bytes,
    wire_keys,
)

FINISH, CONTINUE, ERROR = (
    XferResponseStatus.FINISH,
    XferResponseStatus.CONTINUE,
    XferResponseStatus.ERROR,
)
LEASE = 60.0
BOOT = "http://p-bootstrap:8998"
D = DPeer(v2=False)


def heartbeat(*transfer_ids: str) -> bytes:
    return encode_heartbeat(LeaseHeartbeat(list(transfer_ids)))


# -- codec (§3.9) --------------------------------------------------------------------------------


def test_heartbeat_bytes_are_vllm_034s() -> None:
    """3.9-R1: one map of one key, as msgspec writes vLLM 0.34's ``MooncakeLeaseHeartbeat``."""
    assert heartbeat("t1", "t2") == b"\x81\xb2lease_transfer_ids\x92\xa2t1\xa2t2"
    assert decode_message(heartbeat("t1")) == ("heartbeat", LeaseHeartbeat(["t1"]))


@pytest.mark.parametrize(
    ("obj", "path"),
    [
        ({"lease_transfer_ids": []}, "$.lease_transfer_ids"),
        ({"lease_transfer_ids": [1]}, "$.lease_transfer_ids[0]"),
        ({"lease_transfer_ids": "t1"}, "$.lease_transfer_ids"),
    ],
)
def test_malformed_heartbeat_is_a_decode_error(obj: object, path: str) -> None:
    """3.9-R2, 3.9-R3: ids are strings, and at least one; the error names §3.9."""
    with pytest.raises(DecodeError) as info:
        decode_heartbeat(msgspec.msgpack.encode(obj))
    assert (info.value.path, info.value.section) == (path, "3.9")


def test_an_empty_heartbeat_is_not_encoded() -> None:
    """3.9-R2: with no id, the bytes (``{}``) would be taken for a pull."""
    with pytest.raises(LocalProtocolError):
        encode_heartbeat(LeaseHeartbeat([]))


# -- P: the lease (§6.4) -------------------------------------------------------------------------


def ready(lease: float | None = LEASE, at: float = 0.0) -> Driver:
    p = Driver(producer(lease=lease))
    p(TransferFinished("x1", "p1", [[3, 4]]), at)
    return p


def renew(p: Driver, *transfer_ids: str, at: float) -> object:
    out = p(MessageReceived(b"hb", heartbeat(*transfer_ids)), at)
    (reply,) = decoded(out, b"hb")
    sent = of_type(out, SendReply)
    assert wire_keys(sent[0].data) <= LEGACY_REPLY_KEYS
    return reply


def pull_reply(p: Driver, at: float) -> list:
    out = p(MessageReceived(b"i", D.pull({"r1": ("x1", [[1, 2]])})), at)
    for w in of_type(out, StartWrite):
        out += p(WriteCompleted(w.write_id, 0))
    return decoded(out, b"i")


def test_a_finished_transfer_expires_at_lease_end() -> None:
    """6.4-R2: under a lease P holds a finished transfer for the lease, not for T."""
    p = ready()
    out = p.advance(LEASE + 1)
    assert [(f.p_req_id, f.reason) for f in of_type(out, FreeBlocks)] == [
        ("p1", FreeReason.EXPIRED)
    ]


def test_renewal_moves_expiry_to_two_thirds_of_the_lease_from_now() -> None:
    """6.4-R3: a renewal at 50 s moves the end to 50 + 40 s, and one at 80 s to 120 s."""
    p = ready()
    assert renew(p, "x1", at=50.0).status is FINISH
    assert not of_type(p.advance(90.0 - 0.01), FreeBlocks)
    assert of_type(p.advance(90.0), FreeBlocks)
    p = ready()
    renew(p, "x1", at=50.0)
    renew(p, "x1", at=80.0)
    assert not of_type(p.advance(120.0 - 0.01), FreeBlocks)
    assert of_type(p.advance(120.0), FreeBlocks)


def test_renewal_never_shortens_a_lease() -> None:
    """6.4-R3: at 1 s, now + 2/3 of the lease ends before the lease does: nothing moves."""
    p = ready()
    renew(p, "x1", at=1.0)
    assert not of_type(p.advance(LEASE - 0.01), FreeBlocks)
    assert of_type(p.advance(LEASE), FreeBlocks)


@pytest.mark.parametrize("when", ["unknown", "freed"])
def test_renewal_creates_no_transfer(when: str) -> None:
    """6.4-R4: a renewal of a transfer P does not hold leaves P as it was."""
    p = Driver(producer(lease=LEASE))
    if when == "freed":
        p(TransferFinished("x1", "p1", [[3]]), 0)
        p.advance(LEASE + 1)
    before = p.session.state_of("x1")
    assert renew(p, "x1", at=LEASE + 2).status is FINISH
    assert p.session.state_of("x1") is before
    assert p.session.blocks_held == 0


def test_a_p_without_a_lease_refuses_renewals() -> None:
    """6.4-R5: ERROR with vLLM's message; the transfer keeps its own timer."""
    p = ready(lease=None)
    reply = renew(p, "x1", at=1.0)
    assert (reply.status, reply.err_msg, reply.err_code) == (
        ERROR,
        "kv_lease_duration is not set on this prefill instance.",
        None,
    )
    assert not of_type(p.advance(T - 1), FreeBlocks)


def test_a_pull_after_expiry_is_answered_at_once() -> None:
    """6.4-R6: a pull for a transfer whose lease ended is answered at once, FINISH with the
    request in err_reqs and vLLM 0.34's message, as long as P remembers the expiry (T)."""
    p = ready()
    p.advance(LEASE + 1)
    (reply,) = pull_reply(p, LEASE + 2)
    assert (reply.status, reply.err_reqs, reply.err_msg) == (
        FINISH,
        ["r1"],
        "KV expired on P side before the pull.",
    )
    assert p.session.state_of("x1") is TransferState.EXPIRED


def test_lease_must_be_positive() -> None:
    with pytest.raises(ValueError, match="kv_lease_duration must be positive, got 0"):
        ProducerConfig(side=producer().config.side, lease=0)


# -- D: renewals (§6.4) --------------------------------------------------------------------------


def queued(d_req: str = "r1", engine: str = "e0") -> RequestQueued:
    return RequestQueued(d_req, f"x-{d_req}", engine, BOOT)


def load(d_req: str = "r1", blocks: list[list[int]] | None = None) -> LoadRequest:
    return LoadRequest(d_req, f"x-{d_req}", "e0", BOOT, [[1, 2]] if blocks is None else blocks)


def heartbeats(out: list[object]) -> list[SendPull]:
    return [o for o in of_type(out, SendPull) if isinstance(o.message, LeaseHeartbeat)]


def known(tp: int = 1) -> Driver[ConsumerSession]:
    """A D with a lease that knows engine e0 (a P of ``tp`` workers)."""
    c = Driver(consumer(lease=LEASE))
    c(EngineResolved("e0", entry(tp=tp)), 0)
    return c


def test_d_renews_every_sixth_of_the_lease_while_queued() -> None:
    """6.4-R7: the first renewal goes at arrival, then one every lease/6, to every P worker D
    pulls from, naming every waiting transfer of that engine."""
    c = known(tp=2)
    first = heartbeats(c(queued("r1"), 1.0))
    c(queued("r2"), 2.0)
    assert [(h.addr, h.message.lease_transfer_ids) for h in first] == [
        ("tcp://p-e0-0-0:5000", ["x-r1"]),
        ("tcp://p-e0-1-0:5001", ["x-r1"]),
    ]
    later = heartbeats(c.advance(1.0 + 3 * LEASE / 6))
    assert [h.message.lease_transfer_ids for h in later] == [["x-r1", "x-r2"]] * 6
    assert all(h.data == heartbeat("x-r1", "x-r2") for h in later)


def test_d_queries_an_unknown_engine_to_renew() -> None:
    """6.4-R8: a queued request of an engine D does not know yet: D queries, then renews."""
    c = Driver(consumer(lease=LEASE))
    out = c(queued(), 0)
    assert of_type(out, QueryBootstrap) == [QueryBootstrap("e0", BOOT)]
    assert not heartbeats(out)
    hb = heartbeats(c(EngineResolved("e0", entry()), 0.5))
    assert [h.message.lease_transfer_ids for h in hb] == [["x-r1"]]
    # The load of the request does not query again.
    assert not of_type(c(LoadsRequested((load(),)), 1.0), QueryBootstrap)


def test_renewals_stop_when_the_load_settles() -> None:
    """6.4-R7: from the terminal reply of the pull on, nothing more is renewed."""
    c = known()
    c(queued(), 0)
    (pull,) = [p for p in of_type(c(LoadsRequested((load(),)), 1.0), SendPull) if p.pull_id]
    c(ReplyReceived(pull.pull_id, reply_bytes(0, ["r1"])), 2.0)
    assert c.session.leases == 0
    assert not heartbeats(c.advance(2 * LEASE))


@pytest.mark.parametrize("how", ["release-only", "abort"])
def test_a_release_only_pull_or_an_abort_stops_renewal(how: str) -> None:
    """6.4-R9: a release-only pull settles P's side; an aborted request is renewed no more."""
    c = known()
    c(queued(), 0)
    if how == "release-only":
        c(LoadsRequested((load(blocks=[]),)), 1.0)
    else:
        c(AbortRequested("r1"), 1.0)
    assert c.session.leases == 0
    assert not heartbeats(c.advance(2 * LEASE))


def test_a_refused_renewal_is_reported_and_ends_the_heartbeat() -> None:
    """6.4-R10: P answers ERROR (no lease, or older than 0.34): D says so and closes."""
    c = known()
    (hb,) = heartbeats(c(queued(), 0))
    out = c(ReplyReceived(hb.pull_id, reply_bytes(2, err_msg="no lease")), 0.1)
    assert of_type(out, LeaseRejected) == [LeaseRejected(hb.addr, "no lease")]
    assert c.session.open_pulls == 0


def test_an_unanswered_heartbeat_ends_at_its_receive_timeout_and_fails_nothing() -> None:
    """6.4-R7: a heartbeat waits lease/6 for its reply; no request fails for it and D keeps
    the engine (only a pull's timeout makes D query again)."""
    c = known()
    (hb,) = heartbeats(c(queued(), 0))
    c(LoadsRequested((load(),)), 0)
    out = c.advance(LEASE / 6 + 0.01)
    assert hb.pull_id in {o.pull_id for o in of_type(out, ClosePull)}
    assert c.session.loading == 1 and c.session.knows_engine("e0")
    assert c.session.open_pulls == 2  # the pull, and the next heartbeat


def test_no_lease_no_renewal() -> None:
    c = Driver(consumer())
    assert c(queued(), 0) == []
    assert c.session.leases == 0
