"""Bugs that fuzzing found, each pinned by a direct test; their fuzz inputs are kept under
fuzz/regressions/ and replayed here through the targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.runner import REGRESSIONS
from fuzz.targets import TARGETS
from fuzz.world import GEOM
from pdwire import (
    DecodeError,
    EngineEntry,
    LocalProtocolError,
    XferResponseStatus,
    decode_message,
    decode_response,
    detect_kind,
    encode_cancel,
)
from pdwire.consumer import ConsumerConfig, ConsumerSession
from pdwire.events import (
    AbortRequested,
    BlocksReleased,
    EngineResolved,
    LoadRequest,
    LoadsRequested,
    MessageReceived,
    ReplyReceived,
    RequestFailed,
    SendPull,
    SendReply,
    TimePassed,
)
from pdwire.messages import XferCancel
from pdwire.producer import ProducerConfig, ProducerSession

INPUTS = sorted(p for p in REGRESSIONS.glob("*/*") if p.is_file())


@pytest.mark.parametrize("path", INPUTS, ids=[f"{p.parent.name}-{p.name}" for p in INPUTS])
def test_regression_input_passes_its_target(path: Path) -> None:
    TARGETS[path.parent.name](path.read_bytes())


@pytest.mark.parametrize("decode", [detect_kind, decode_message])
@pytest.mark.parametrize("data", [b"\xd5\xff\x00\x00", b"\x81\xa1x\xd5\xff\x00\x00"])
def test_bad_timestamp_extension_is_an_encoding_error(decode: object, data: bytes) -> None:
    """A MessagePack timestamp of the wrong length made ``detect_kind`` raise KeyError."""
    with pytest.raises(DecodeError) as info:
        decode(data)  # type: ignore[operator]
    assert info.value.section == "2"


def _consumer() -> ConsumerSession:
    return ConsumerSession(ConsumerConfig("d0", 1, GEOM.side(1, 0, 1, 0, worker=1000)))


ENTRY = EngineEntry(
    engine_id="e0",
    worker_addr={0: {0: "tcp://p0:5000"}},
    pdwire_version=2,
    pdwire_caps=["cancel", "deadline"],
    tp_size=1,
    pp_size=1,
)


def _load(d_req: str, blocks: list[list[int]] | None = None) -> LoadRequest:
    return LoadRequest(
        d_req, f"x-{d_req}", "e0", "http://boot", [[1, 2]] if blocks is None else blocks
    )


@pytest.mark.parametrize("batch", [("d1", "d0"), ("d1", "d1")])
def test_a_refused_batch_takes_none_of_its_requests(batch: tuple[str, ...]) -> None:
    """A batch naming a request already loading (or one twice) used to keep the requests
    before it, half set up: never started, never reported."""
    c = _consumer()
    c.handle(LoadsRequested((_load("d0"),)), 0.0)
    with pytest.raises(LocalProtocolError):
        c.handle(LoadsRequested(tuple(_load(d) for d in batch)), 0.0)
    assert (c.loading, c.state_of("d1")) == (1, None)


def test_a_request_is_reported_once_when_deadline_and_receive_timeout_fire_together() -> None:
    """Time jumping past D's deadline and the pull's receive timeout in one ``handle`` reported
    the request twice, the second time promising a ``BlocksReleased`` that never came."""
    c = _consumer()
    c.handle(EngineResolved("e0", ENTRY), 0.0)
    c.handle(LoadsRequested((_load("d0"),)), 0.0)
    out = c.handle(TimePassed(), 10_000.0)
    reports = [o for o in out if isinstance(o, RequestFailed | BlocksReleased)]
    assert len(reports) == 1 and isinstance(reports[0], RequestFailed)
    assert reports[0].blocks_free
    assert (c.loading, c.open_pulls) == (0, 0)


def test_a_failed_cancel_leaves_the_withdrawn_pull_open() -> None:
    """A cancel answered with garbage settled the requests it withdrew, so D released blocks
    that P could still be writing into."""
    c = _consumer()
    c.handle(EngineResolved("e0", ENTRY), 0.0)
    (pull,) = c.handle(LoadsRequested((_load("d0"),)), 0.0)
    assert isinstance(pull, SendPull)
    out = c.handle(AbortRequested("d0"), 1.0)
    (cancel,) = [o for o in out if isinstance(o, SendPull)]
    assert isinstance(cancel.message, XferCancel)
    out = c.handle(ReplyReceived(cancel.pull_id, b"\x00garbage"), 2.0)
    assert not [o for o in out if isinstance(o, BlocksReleased)]
    assert (c.loading, c.open_pulls) == (1, 1)
    out = c.handle(ReplyReceived(pull.pull_id, b"\x82\xa6status\x00\xa7ok_reqs\x91\xa2d0"), 3.0)
    assert BlocksReleased("d0") in out and c.loading == 0


def test_a_request_aborted_while_resolving_leaves_no_stale_waiter() -> None:
    """Aborted while its engine resolved, then past its deadline, a request stayed in the
    waiting list; a new request of the same id then broke the session."""
    c = _consumer()
    c.handle(LoadsRequested((_load("d0"),)), 0.0)
    c.handle(AbortRequested("d0"), 1.0)
    c.handle(TimePassed(), 100.0)
    assert c.loading == 0
    c.handle(LoadsRequested((_load("d0"),)), 100.0)
    out = c.handle(EngineResolved("e0", ENTRY), 101.0)
    pulls = [o for o in out if isinstance(o, SendPull)]
    assert len(pulls) == 1 and list(pulls[0].message.req_blocks) == ["d0"]  # type: ignore[union-attr]


def test_a_cancel_whose_tp_size_does_not_divide_ps_is_refused() -> None:
    """A cancel naming a TP size that does not divide P's, or that P's does not divide, made
    P's session raise ValueError while it counted the D ranks paired with it; it is answered
    ERROR with vLLM's text of 10.1.1 and the code TP_RANK_NOT_PAIRED, and changes nothing."""
    p = ProducerSession(ProducerConfig(side=GEOM.side(4, 0, 1, 0, worker=0)))
    cancel = XferCancel(
        pdwire_version=2,
        remote_hostname="d",
        remote_port=1,
        remote_tp_size=127,
        remote_tp_rank=0,
        cancel_reqs={"r": "x"},
    )
    out = p.handle(MessageReceived(b"c", encode_cancel(cancel)), 0.0)
    (reply,) = [decode_response(o.data) for o in out if isinstance(o, SendReply)]
    assert reply.status is XferResponseStatus.ERROR
    assert reply.err_code == "TP_RANK_NOT_PAIRED"
    assert reply.err_msg == (
        "Remote tensor parallel size 127 is not divisible by local tensor parallel size 4."
    )
    assert p.state_of("x") is None
