"""P's limits (chapter 13): what one D worker can make a P worker hold, and LIMIT_EXCEEDED past
it."""

from __future__ import annotations

import dataclasses

import pytest

from pdwire import ErrorCode, XferResponseStatus
from pdwire.codec import encode_heartbeat
from pdwire.events import MessageReceived, TransferStarted
from pdwire.limits import MINIMUM, REFERENCE, exceeded
from pdwire.messages import LeaseHeartbeat
from pdwire.producer import ProducerSession
from pdwire.transitions import TransferState

from .sessions_helpers import DPeer, Driver, T, producer
from .test_producer import expect_code, only_reply

FINISH, ERROR = XferResponseStatus.FINISH, XferResponseStatus.ERROR
LIMIT = ErrorCode.LIMIT_EXCEEDED
V2, OTHER_D, LEGACY_D = DPeer(), DPeer(hostname="d1"), DPeer(v2=False)


def limited(**changes: int) -> Driver[ProducerSession]:
    return Driver(producer(limits=dataclasses.replace(REFERENCE, **changes)))


def unknown(n: int, prefix: str = "r") -> dict[str, tuple[str, list[list[int]]]]:
    """``n`` requests for transfers P holds nothing for."""
    return {f"{prefix}{i}": (f"x-{prefix}{i}", [[i]]) for i in range(n)}


def test_the_reference_supports_every_minimum() -> None:
    for name, least in MINIMUM.as_dict().items():
        assert REFERENCE.as_dict()[name] >= least, name


def test_the_message_names_the_limit() -> None:
    assert exceeded("open_pulls_per_peer", 3, 2) == (
        "Limit exceeded: open_pulls_per_peer allows 2, got 3."
    )


@pytest.mark.parametrize("d", [V2, LEGACY_D], ids=["pdwire2-D", "legacy-D"])
def test_a_pull_past_requests_per_message_is_refused_whole(d: DPeer) -> None:
    """13.2: ERROR with LIMIT_EXCEEDED (its text alone for a legacy D); nothing is held."""
    p = limited(requests_per_message=2)
    reply = only_reply(p(MessageReceived(b"i", d.pull(unknown(3))), 0), b"i")
    assert reply.status is ERROR
    assert reply.err_msg == exceeded("requests_per_message", 3, 2)
    expect_code(d, reply, LIMIT, per_request=False)
    assert p.session.state_of("x-r0") is None and p.session.open_pulls == 0
    out = p(MessageReceived(b"j", d.pull(unknown(2))), 1)
    assert out == [] and p.session.open_pulls == 1  # at the limit: accepted, waiting


def test_open_pulls_per_peer() -> None:
    """13.3: one D worker's pull past its limit is refused at once; another worker's is not,
    and a closed pull makes room again."""
    p = limited(open_pulls_per_peer=2)
    for i in range(2):
        assert (
            p(MessageReceived(b"%d" % i, V2.pull(unknown(1, f"a{i}-"), deadline_ms=1000)), 0) == []
        )
    reply = only_reply(p(MessageReceived(b"over", V2.pull(unknown(1, "b"))), 0), b"over")
    assert (reply.status, reply.err_code) == (ERROR, LIMIT)
    assert reply.err_msg == exceeded("open_pulls_per_peer", 3, 2)
    assert p(MessageReceived(b"other", OTHER_D.pull(unknown(1, "c"))), 0) == []
    p.advance(1.0)  # the deadline ends both of V2's pulls
    assert p(MessageReceived(b"again", V2.pull(unknown(1, "d"))), 2) == []


def test_placeholders_per_peer() -> None:
    """13.4: past the limit, a request is answered in err_reqs with LIMIT_EXCEEDED and no
    placeholder is made; the others of the pull wait; an expired placeholder makes room."""
    p = limited(placeholders_per_peer=2)
    first = only_reply(p(MessageReceived(b"i", V2.pull(unknown(3), deadline_ms=1000)), 0), b"i")
    assert first.status is XferResponseStatus.CONTINUE and first.err_codes == {"r2": LIMIT}
    assert first.err_msg == exceeded("placeholders_per_peer", 3, 2)
    assert p.session.state_of("x-r2") is None
    last = only_reply(p.advance(1.0), b"i")
    assert last.err_codes == dict.fromkeys(("r0", "r1"), ErrorCode.DEADLINE_EXCEEDED)
    other = p(MessageReceived(b"o", OTHER_D.pull(unknown(1, "o"))), 2)
    assert other == [] and p.session.state_of("x-o0") is TransferState.PLACEHOLDER
    p.advance(T + 3)  # the placeholders expire, and the other D's pull with its own
    assert p(MessageReceived(b"j", V2.pull(unknown(2, "s"))), T + 4) == []
    assert p.session.state_of("x-s1") is TransferState.PLACEHOLDER


def test_a_placeholder_p_records_leaves_the_count() -> None:
    p = limited(placeholders_per_peer=1)
    p(MessageReceived(b"i", V2.pull(unknown(1), deadline_ms=1000)), 0)
    p(TransferStarted("x-r0", "p0"), 0.5)
    p.advance(1.0)
    assert p(MessageReceived(b"j", V2.pull(unknown(1, "s"))), 2) == []


def test_remembered_cancels_per_peer() -> None:
    """13.4: a cancel P cannot remember lists the request in err_reqs with LIMIT_EXCEEDED; the
    request P records later then makes no remembered cancel."""
    p = limited(remembered_cancels_per_peer=1)
    reply = only_reply(p(MessageReceived(b"c", V2.cancel({"r0": "x0", "r1": "x1"})), 0), b"c")
    assert reply.status is FINISH and not reply.ok_reqs
    assert reply.err_reqs == ["r1"] and reply.err_codes == {"r1": LIMIT}
    assert reply.err_msg == exceeded("remembered_cancels_per_peer", 2, 1)
    assert p.session.state_of("x0") is TransferState.CANCELLED
    assert p.session.state_of("x1") is None
    p(TransferStarted("x0", "p0"), 1)  # recorded: no longer a remembered cancel
    again = only_reply(p(MessageReceived(b"d", V2.cancel({"r2": "x2"})), 2), b"d")
    assert not again.err_reqs and p.session.state_of("x2") is TransferState.CANCELLED


def test_a_cancel_past_requests_per_message_is_refused() -> None:
    p = limited(requests_per_message=1)
    reply = only_reply(p(MessageReceived(b"c", V2.cancel({"r0": "x0", "r1": "x1"})), 0), b"c")
    assert (reply.status, reply.err_code) == (ERROR, LIMIT)
    assert p.session.state_of("x0") is None


def test_a_renewal_past_requests_per_message_is_refused() -> None:
    p = Driver(producer(lease=30.0, limits=dataclasses.replace(REFERENCE, requests_per_message=1)))
    data = encode_heartbeat(LeaseHeartbeat(lease_transfer_ids=["x0", "x1"]))
    reply = only_reply(p(MessageReceived(b"h", data), 0), b"h")
    assert reply.status is ERROR
    assert reply.err_msg == exceeded("requests_per_message", 2, 1)


def test_cached_layouts_are_bounded() -> None:
    """13.5: the least recently used layout is dropped; a pull that omits it gets LAYOUT_MISS
    and one with its layout is served again."""
    p = limited(cached_layouts=1)
    first, second = DPeer(layout_id=1), DPeer(layout_id=2)
    for i, d in enumerate((first, second)):
        p(MessageReceived(b"%d" % i, d.pull({}, with_layout=True)), i)
    miss = only_reply(p(MessageReceived(b"m", first.pull({}, with_layout=False)), 3), b"m")
    assert miss.status is XferResponseStatus.LAYOUT_MISS
    hit = only_reply(p(MessageReceived(b"h", second.pull({}, with_layout=False)), 4), b"h")
    assert hit.status is FINISH
    assert len(p.session._plans) <= 1
