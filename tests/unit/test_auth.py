"""Authentication of side-channel messages with a shared key (spec §8.6)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdwire
from pdwire import (
    PDWIRE_2,
    DecodeError,
    ErrorCode,
    Fingerprint,
    RemoteProtocolError,
    XferCancel,
    XferMetadataV2,
    XferResponseStatus,
    XferResponseV2,
    encode_canonical,
    sign,
    verify,
)
from pdwire.auth import key_id, tag

from .conftest import cancels, non_default_fields, pulls_v2, responses_v2

KEY = b"k" * 32
OTHER_KEY = b"K" * 32
SETTINGS = settings(deadline=None, max_examples=100)

Signed = XferMetadataV2 | XferResponseV2 | XferCancel

PULL = XferMetadataV2(
    "10.0.0.7",
    17000,
    2,
    1,
    {"d-1": ("xfer-1", [[1, 2, 3], [4]])},
    [4096, 8192],
    [64, 64],
    [48, 48],
    registered_layer_names=["l0", "l1"],
    registered_layer_indices=[0, 1],
    registered_group_indices=[0, -1],
    registered_shared_group_ids=[[0], [0, 1]],
    registered_row_offsets=[0, -1],
    remote_pp_size=2,
    layout_id=0x1235,
    pdwire_version=2,
    pdwire_caps=["auth", "cancel"],
    fingerprint=Fingerprint(
        model="m",
        dtype="bfloat16",
        num_layers=2,
        num_kv_heads=8,
        head_size=128,
        block_size=16,
        kv_layout="NHD",
    ),
    deadline_ms=5000,
)
RESPONSE = XferResponseV2(
    status=XferResponseStatus.CONTINUE,
    ok_reqs=["d-1"],
    err_reqs=["d-2"],
    err_msg="KV group count mismatch",
    layout_id=0x1235,
    pdwire_version=2,
    pdwire_caps=["auth"],
    err_code=ErrorCode.KV_GROUP_COUNT_MISMATCH,
    err_codes={"d-2": ErrorCode.KV_GROUP_COUNT_MISMATCH},
)
CANCEL = XferCancel(
    2, "10.0.0.7", 17000, 2, 1, {"d-1": "xfer-1"}, remote_pp_size=2, remote_pp_rank=1, reason="x"
)

MESSAGES: dict[str, tuple[Signed, Callable[[Any, str], bytes], Callable[[bytes], Signed]]] = {
    "pull": (PULL, pdwire.encode_pull, pdwire.decode_pull),
    "response": (RESPONSE, pdwire.encode_response, pdwire.decode_response),
    "cancel": (CANCEL, pdwire.encode_cancel, pdwire.decode_cancel),
}


def _changed(value: Any) -> Any:
    """A different value of the same type, as a one-byte change would give."""
    if isinstance(value, bool) or value is None:
        raise AssertionError(f"no mutation for {value!r}")
    if isinstance(value, int):
        return value ^ 1
    if isinstance(value, str):
        return value + "x" if not value else chr(ord(value[0]) ^ 1) + value[1:]
    if isinstance(value, bytes):
        return bytes([value[0] ^ 1]) + value[1:]
    if isinstance(value, tuple):
        return (_changed(value[0]), *value[1:])
    if isinstance(value, list):
        return [_changed(value[0]), *value[1:]] if value else [0]
    if isinstance(value, dict):
        key = next(iter(value))
        return {**value, key: _changed(value[key])}
    if isinstance(value, Fingerprint):
        return dataclasses.replace(value, num_layers=value.num_layers + 1)
    raise AssertionError(f"no mutation for {value!r}")


def _field_cases() -> list[Any]:
    out = []
    for kind, (msg, _, _) in MESSAGES.items():
        for field in msg.__struct_fields__:
            if field != "auth_tag" and getattr(msg, field) not in (None, 0, "", [], {}):
                out.append(pytest.param(kind, field, id=f"{kind}-{field}"))
    return out


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_sign_verify_round_trip(kind: str) -> None:
    msg, encode, decode = MESSAGES[kind]
    signed = sign(msg, KEY)
    assert signed.auth_tag is not None and len(signed.auth_tag) == 32
    verify(signed, KEY)
    received = decode(encode(signed, PDWIRE_2))
    assert received.auth_tag == signed.auth_tag
    assert received == signed
    verify(received, KEY)


@pytest.mark.parametrize(("kind", "field"), _field_cases())
def test_a_changed_field_fails_verification(kind: str, field: str) -> None:
    msg, _, _ = MESSAGES[kind]
    signed = sign(msg, KEY)
    tampered = msgspec.structs.replace(signed, **{field: _changed(getattr(signed, field))})
    assert tampered != signed
    with pytest.raises(RemoteProtocolError) as info:
        verify(tampered, KEY)
    assert info.value.section == "8.6"


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_a_flipped_byte_on_the_wire_fails_verification(kind: str) -> None:
    msg, encode, decode = MESSAGES[kind]
    data = encode(sign(msg, KEY), PDWIRE_2)
    verified = 0
    for at in range(len(data)):
        for mask in (0x01, 0xFF):
            flipped = bytearray(data)
            flipped[at] ^= mask
            try:
                received = decode(bytes(flipped))
            except DecodeError:
                continue
            verified += 1
            with pytest.raises(RemoteProtocolError) as info:
                verify(received, KEY)
            assert info.value.section == "8.6", (at, mask)
    assert verified > len(data) // 4  # most flips still decode: the check above did run


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_a_wrong_key_fails_verification(kind: str) -> None:
    msg, _, _ = MESSAGES[kind]
    with pytest.raises(RemoteProtocolError) as info:
        verify(sign(msg, KEY), OTHER_KEY)
    assert info.value.section == "8.6"


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_a_message_without_tag_fails_verification(kind: str) -> None:
    msg, _, _ = MESSAGES[kind]
    assert msg.auth_tag is None
    with pytest.raises(RemoteProtocolError) as info:
        verify(msg, KEY)
    assert info.value.section == "8.6"


@pytest.mark.parametrize("kind", list(MESSAGES))
@pytest.mark.parametrize("named", [None, "", "é" * 16, "0" * 16, 7])
def test_a_message_naming_no_held_key_fails_verification(kind: str, named: Any) -> None:
    """8.6-R16: an absent, unknown or malformed auth_key_id is refused like a wrong tag, even
    when the tag itself is right under the key."""
    msg, _, _ = MESSAGES[kind]
    unnamed = msgspec.structs.replace(msg, auth_key_id=named, auth_tag=None)
    wrongly_named = msgspec.structs.replace(unnamed, auth_tag=tag(unnamed, KEY))
    with pytest.raises(RemoteProtocolError) as info:
        verify(wrongly_named, KEY)
    assert info.value.section == "8.6"


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_keys_rotate(kind: str) -> None:
    """8.6-R15/R16: a receiver holding several keys verifies with the one the message names."""
    msg, _, _ = MESSAGES[kind]
    for signer in (KEY, OTHER_KEY):
        signed = sign(msg, signer)
        assert signed.auth_key_id == key_id(signer) and len(key_id(signer)) == 16
        verify(signed, (OTHER_KEY, KEY))
    with pytest.raises(RemoteProtocolError):
        verify(sign(msg, OTHER_KEY), (KEY,))


def test_a_reply_is_bound_to_the_message_it_answers() -> None:
    """8.6-R13: a reply signed for one pull's tag fails against another's, and without one."""
    reply = MESSAGES["response"][0]
    first, second = (sign(MESSAGES["pull"][0], k).auth_tag for k in (KEY, OTHER_KEY))
    signed = sign(reply, KEY, first)
    verify(signed, KEY, first)
    for other in (second, None):
        with pytest.raises(RemoteProtocolError):
            verify(signed, KEY, other)


def test_map_keys_are_signed_sorted() -> None:
    """8.6-R2: a message whose map keys came in another order has the same tag."""
    pull = MESSAGES["pull"][0]
    blocks = {"b": ("x-b", [[1]]), "a": ("x-a", [[2]])}
    one = msgspec.structs.replace(pull, req_blocks=blocks)
    other = msgspec.structs.replace(pull, req_blocks=dict(reversed(blocks.items())))
    assert encode_canonical(one) == encode_canonical(other)
    assert tag(one, KEY) == tag(other, KEY)


@pytest.mark.parametrize("kind", ["pull", "response"])
def test_a_tag_does_not_survive_the_legacy_profile(kind: str) -> None:
    msg, encode, decode = MESSAGES[kind]
    received = decode(encode(sign(msg, KEY), "legacy"))
    assert received.auth_tag is None
    with pytest.raises(RemoteProtocolError):
        verify(received, KEY)


def _check_canonical(msg: Signed) -> None:
    canonical = encode_canonical(msg)
    assert canonical == encode_canonical(msgspec.structs.replace(msg, auth_tag=b"\x07" * 32))
    assert canonical == encode_canonical(msgspec.structs.replace(msg, auth_tag=None))
    present = non_default_fields(msg) - {"auth_tag"}
    decoded = msgspec.msgpack.decode(canonical)
    assert set(decoded) == present
    assert list(decoded) == [f for f in msg.__struct_fields__ if f in present]
    n = len(present)
    if n <= 15:
        assert 0x80 <= canonical[0] <= 0x8F
        assert canonical[0] == 0x80 | n
    else:
        assert canonical[:3] == bytes((0xDE, 0, n))


@SETTINGS
@given(msg=st.one_of(pulls_v2(), responses_v2(), cancels()))
def test_canonical_encoding_is_shortest_and_tag_free(msg: Signed) -> None:
    _check_canonical(msg)


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_canonical_encoding_of_fixed_messages(kind: str) -> None:
    msg, _, _ = MESSAGES[kind]
    _check_canonical(msg)
    _check_canonical(sign(msg, KEY))


def test_canonical_encoding_of_more_than_15_fields_uses_map16() -> None:
    full = msgspec.structs.replace(PULL, auth_tag=b"\x00" * 32)
    assert len(non_default_fields(full) - {"auth_tag"}) == 19
    assert encode_canonical(full)[:3] == b"\xde\x00\x13"


@SETTINGS
@given(msg=st.one_of(pulls_v2(), responses_v2(), cancels()), key=st.binary(min_size=1))
def test_signed_messages_verify_after_a_pdwire2_round_trip(msg: Signed, key: bytes) -> None:
    signed = sign(msg, key)
    if isinstance(signed, XferMetadataV2):
        received: Signed = pdwire.decode_pull(pdwire.encode_pull(signed, PDWIRE_2))
    elif isinstance(signed, XferResponseV2):
        received = pdwire.decode_response(pdwire.encode_response(signed, PDWIRE_2))
    else:
        received = pdwire.decode_cancel(pdwire.encode_cancel(signed, PDWIRE_2))
    assert received.auth_tag == signed.auth_tag
    verify(received, key)
