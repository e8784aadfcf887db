"""Round trips of every side-channel message under both profiles (spec §2, §3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdwire
from pdwire import (
    PDWIRE_2,
    PeerCannotDecode,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseV2,
)

from .conftest import (
    PULL_EXTENSIONS,
    RESPONSE_EXTENSIONS,
    as_v2_pull,
    as_v2_response,
    base_pull,
    base_response,
    cancels,
    non_default_fields,
    pulls,
    pulls_v2,
    responses,
    responses_v2,
    wire_keys,
)

PROFILES = ["legacy", "pdwire/2"]
SETTINGS = settings(deadline=None, max_examples=200)


def _expected_pull(msg: XferMetadata, profile: str) -> XferMetadataV2:
    if profile == PDWIRE_2 and isinstance(msg, XferMetadataV2):
        return msg
    return as_v2_pull(msg)


def _expected_response(msg: XferResponse, profile: str) -> XferResponseV2:
    if profile == PDWIRE_2 and isinstance(msg, XferResponseV2):
        return msg
    return as_v2_response(msg)


@SETTINGS
@given(msg=st.one_of(pulls(), pulls_v2()))
def test_pull_round_trips_under_both_profiles(msg: XferMetadata) -> None:
    for profile in PROFILES:
        decoded = pdwire.decode_pull(pdwire.encode_pull(msg, profile))
        assert type(decoded) is XferMetadataV2
        assert decoded == _expected_pull(msg, profile), profile


@SETTINGS
@given(msg=st.one_of(responses(), responses_v2()))
def test_response_round_trips_under_both_profiles(msg: XferResponse) -> None:
    for profile in PROFILES:
        decoded = pdwire.decode_response(pdwire.encode_response(msg, profile))
        assert type(decoded) is XferResponseV2
        assert decoded == _expected_response(msg, profile), profile


@SETTINGS
@given(msg=cancels())
def test_cancel_round_trips_under_pdwire2(msg: XferCancel) -> None:
    assert pdwire.decode_cancel(pdwire.encode_cancel(msg, PDWIRE_2)) == msg
    with pytest.raises(PeerCannotDecode) as info:
        pdwire.encode_cancel(msg, "legacy")
    assert info.value.section == "8.4"


@pytest.mark.parametrize(
    ("strategy", "encode", "base", "extensions"),
    [
        (pulls_v2(), pdwire.encode_pull, base_pull, PULL_EXTENSIONS),
        (responses_v2(), pdwire.encode_response, base_response, RESPONSE_EXTENSIONS),
    ],
    ids=["pull", "response"],
)
@settings(deadline=None, max_examples=100)
@given(data=st.data())
def test_legacy_bytes_are_those_of_the_base_projection(
    strategy: st.SearchStrategy[Any],
    encode: Callable[[Any, str], bytes],
    base: Callable[[Any], Any],
    extensions: tuple[str, ...],
    data: st.DataObject,
) -> None:
    msg = data.draw(strategy)
    legacy = encode(msg, "legacy")
    assert legacy == encode(base(msg), "legacy")
    assert legacy == encode(base(msg), PDWIRE_2)
    assert wire_keys(legacy) == non_default_fields(base(msg))
    assert not wire_keys(legacy) & set(extensions)
    assert wire_keys(encode(msg, PDWIRE_2)) == non_default_fields(msg)


@settings(deadline=None, max_examples=100)
@given(msg=st.one_of(pulls_v2(), responses_v2(), cancels()))
def test_decode_message_detects_the_kind(
    msg: XferMetadataV2 | XferResponseV2 | XferCancel,
) -> None:
    if isinstance(msg, XferMetadataV2):
        kind, data = "pull", pdwire.encode_pull(msg, PDWIRE_2)
    elif isinstance(msg, XferResponseV2):
        kind, data = "response", pdwire.encode_response(msg, PDWIRE_2)
    else:
        kind, data = "cancel", pdwire.encode_cancel(msg, PDWIRE_2)
    assert pdwire.detect_kind(data) == kind
    assert pdwire.decode_message(data) == (kind, msg)


@pytest.mark.parametrize("data_type", [bytes, bytearray, memoryview])
def test_decoders_take_every_bytes_like(data_type: type) -> None:
    msg = XferResponse(status=pdwire.XferResponseStatus.CONTINUE, ok_reqs=["a"])
    data = data_type(pdwire.encode_response(msg))
    assert pdwire.decode_response(data) == as_v2_response(msg)
    assert pdwire.detect_kind(data) == "response"


def test_max_size_is_inclusive() -> None:
    data = pdwire.encode_response(XferResponse(status=pdwire.XferResponseStatus.FINISH))
    assert pdwire.decode_response(data, max_size=len(data)).status == 0
    with pytest.raises(pdwire.DecodeError) as info:
        pdwire.decode_response(data, max_size=len(data) - 1)
    assert info.value.section == "2.3"


@pytest.mark.parametrize(
    ("encode", "msg", "section"),
    [
        (
            pdwire.encode_pull,
            XferMetadata("h", 1, 2, 2, {}, [], [], []),
            "3.2",
        ),
        (
            pdwire.encode_pull,
            XferMetadata("h", 1, 1, 0, {}, [1, 2], [1], []),
            "3.2",
        ),
        (
            pdwire.encode_response,
            XferResponse(status=pdwire.XferResponseStatus.ERROR, ok_reqs=["a"]),
            "3.4",
        ),
        (
            pdwire.encode_response,
            XferResponseV2(status=pdwire.XferResponseStatus.FINISH, err_codes={"a": "INTERNAL"}),
            "3.4",
        ),
        (
            pdwire.encode_cancel,
            XferCancel(2, "h", 1, 1, 0, {}, remote_pp_size=2, remote_pp_rank=2),
            "3.5",
        ),
    ],
    ids=["tp-rank", "region-lengths", "error-with-ok", "err-codes", "pp-rank"],
)
def test_encoders_refuse_invalid_messages(encode: object, msg: object, section: str) -> None:
    with pytest.raises(pdwire.LocalProtocolError) as info:
        encode(msg, PDWIRE_2)  # type: ignore[operator]
    assert info.value.section == section


@pytest.mark.parametrize(
    ("encode", "msg"),
    [
        (pdwire.encode_pull, XferResponse(status=pdwire.XferResponseStatus.FINISH)),
        (pdwire.encode_response, XferMetadata("h", 1, 1, 0, {}, [], [], [])),
        (pdwire.encode_cancel, XferResponse(status=pdwire.XferResponseStatus.FINISH)),
    ],
    ids=["pull", "response", "cancel"],
)
def test_encoders_refuse_the_wrong_message_type(encode: object, msg: object) -> None:
    with pytest.raises(pdwire.LocalProtocolError):
        encode(msg, PDWIRE_2)  # type: ignore[operator]
