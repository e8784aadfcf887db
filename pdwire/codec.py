"""Encoding and decoding of the side-channel messages (spec §2, §3).

Decoding never raises anything but ``DecodeError``. Encoding takes a profile name or an
``Agreement``: under ``legacy`` the pdwire/2 fields are left out, so the bytes are vLLM's; a message
kind the peer cannot decode raises ``PeerCannotDecode`` (§8.4).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

from . import sections
from .errors import DecodeError, LocalProtocolError, PeerCannotDecode
from .legacy import FLAT_BLOCK_LISTS, upgrade_pull
from .messages import (
    LeaseHeartbeat,
    NonNegInt,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseStatus,
    XferResponseV2,
)
from .negotiation import Agreement
from .versions import LEGACY, PDWIRE_2, Capability, Profile, check_profile

#: Receivers reject larger messages (§2.3); every implementation accepts at least 16 MiB.
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024

_encoder: Final = msgspec.msgpack.Encoder()
#: Map keys in sorted order, struct fields in declaration order (8.6-R2).
_canonical_encoder: Final = msgspec.msgpack.Encoder(order="deterministic")
_encode: Final = _encoder.encode
_astuple: Final = msgspec.structs.astuple
_PULL_FIELDS: Final = len(XferMetadata.__struct_fields__)
_RESPONSE_FIELDS: Final = len(XferResponse.__struct_fields__)
_pull_decoder: Final = msgspec.msgpack.Decoder(XferMetadataV2)
_response_decoder: Final = msgspec.msgpack.Decoder(XferResponseV2)
_cancel_decoder: Final = msgspec.msgpack.Decoder(XferCancel)
_heartbeat_decoder: Final = msgspec.msgpack.Decoder(LeaseHeartbeat)
_any_decoder: Final = msgspec.msgpack.Decoder()

_UPGRADED_BLOCKS: Final = "$.req_blocks[...][1][0]"
_FLAT_BLOCKS: Final = "$.req_blocks[...][1]"
_BUFFERS: Final = (bytes, bytearray, memoryview)
_ERROR: Final = int(XferResponseStatus.ERROR)
#: The per-region lists of a pull (3.2-R2): one entry per registered region, or none.
REGION_LISTS: Final = (
    "block_lens",
    "kv_block_lens",
    "registered_layer_names",
    "registered_layer_indices",
    "registered_group_indices",
    "registered_shared_group_ids",
    "registered_row_offsets",
)
_region_lists: Final = operator.attrgetter(*REGION_LISTS)
_AT: Final = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING: Final = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")

KIND_SECTIONS: Final = {
    "pull": sections.PULL,
    "response": sections.RESPONSE,
    "cancel": sections.CANCEL,
    "heartbeat": sections.HEARTBEAT,
}
_FIELD_SECTIONS: Final = {"status": sections.STATUS, "fingerprint": sections.FINGERPRINT}

T = TypeVar("T")


def _is_legacy(profile: Profile | Agreement) -> bool:
    if profile == LEGACY:
        return True
    if profile == PDWIRE_2:
        return False
    if isinstance(profile, Agreement):
        return profile.profile == LEGACY
    return check_profile(profile) == LEGACY


# -- encoding ---------------------------------------------------------------------------------


def encode_pull(msg: XferMetadata, profile: Profile | Agreement = LEGACY) -> bytes:
    """Encode a pull. ``legacy`` gives vLLM 0.34's exact bytes (0.33's are the same)."""
    if not isinstance(msg, XferMetadata):
        raise _wrong_type(XferMetadata, msg, sections.PULL)
    legacy = profile is LEGACY or _is_legacy(profile)  # also refuses an unknown profile name
    problem = _check_pull(msg)
    if problem is not None:
        _raise_local(problem, sections.PULL)
    if legacy and type(msg) is not XferMetadata:
        msg = XferMetadata(*_astuple(msg)[:_PULL_FIELDS])
    return _encode(msg)


def encode_response(msg: XferResponse, profile: Profile | Agreement = LEGACY) -> bytes:
    """Encode a reply. ``legacy`` leaves out version, capabilities and error codes."""
    if not isinstance(msg, XferResponse):
        raise _wrong_type(XferResponse, msg, sections.RESPONSE)
    legacy = profile is LEGACY or _is_legacy(profile)
    problem = _check_response(msg)
    if problem is not None:
        _raise_local(problem, sections.RESPONSE)
    if legacy and type(msg) is not XferResponse:
        msg = XferResponse(*_astuple(msg)[:_RESPONSE_FIELDS])
    return _encode(msg)


def _wrong_type(expected: type, msg: object, section: str) -> LocalProtocolError:
    return LocalProtocolError(
        f"expected {expected.__name__}, got {type(msg).__name__}", section=section
    )


def encode_cancel(msg: XferCancel, profile: Profile | Agreement = PDWIRE_2) -> bytes:
    """Encode a cancel. Only a P that announced pdwire/2 with ``cancel`` may receive one."""
    if not isinstance(msg, XferCancel):
        raise LocalProtocolError(
            f"expected XferCancel, got {type(msg).__name__}", section=sections.CANCEL
        )
    if isinstance(profile, Agreement):
        profile.require(Capability.CANCEL, "XferCancel")
    elif check_profile(profile) == LEGACY:
        raise PeerCannotDecode(
            "XferCancel does not exist in the legacy profile", section=sections.DECODABILITY
        )
    _raise_local(_check_cancel(msg), sections.CANCEL)
    return _encoder.encode(msg)


def encode_heartbeat(msg: LeaseHeartbeat, profile: Profile | Agreement = LEGACY) -> bytes:
    """Encode a lease renewal: vLLM 0.34's exact bytes under either profile, as it has no pdwire/2
    field; a P older than vLLM 0.34 answers it with ERROR (§3.9)."""
    if not isinstance(msg, LeaseHeartbeat):
        raise LocalProtocolError(
            f"expected LeaseHeartbeat, got {type(msg).__name__}", section=sections.HEARTBEAT
        )
    _raise_local(_check_heartbeat(msg), sections.HEARTBEAT)
    return _encoder.encode(msg)


def encode_canonical(msg: XferMetadata | XferResponse | XferCancel) -> bytes:
    """The bytes an authentication tag covers (§8.6): the message without ``auth_tag``, fields in
    declaration order, map keys sorted, defaults omitted, every header and integer in its
    shortest form."""
    if getattr(msg, "auth_tag", None) is not None:
        msg = msgspec.structs.replace(msg, auth_tag=None)
    data = _canonical_encoder.encode(msg)
    # msgspec sizes a struct's map header by its declared field count, not by the fields it writes.
    if data[0] == 0xDE and data[1] == 0 and data[2] <= 15:
        return bytes((0x80 | data[2],)) + data[3:]
    return data


# -- decoding ---------------------------------------------------------------------------------


def decode_pull(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES
) -> XferMetadataV2:
    """Decode a pull of any profile or older variant (§3.8) into the current model."""
    if type(data) is not bytes or len(data) > max_size:
        _check_size(data, max_size, "pull")
    msg = _decode_pull_fast(data)
    if msg is None:
        try:
            msg = _pull_decoder.decode(data)
        except msgspec.ValidationError as exc:
            msg = _decode_older_pull(data, exc)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise _malformed(exc, "pull") from None
    problem = _check_pull(msg)
    if problem is not None:
        _raise_decode(problem, "pull")
    return msg


def decode_response(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES
) -> XferResponseV2:
    """Decode a reply of either profile."""
    msg = _decode(_response_decoder, data, max_size, "response")
    problem = _check_response(msg)
    if problem is not None:
        _raise_decode(problem, "response")
    return msg


def decode_cancel(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES
) -> XferCancel:
    """Decode a pdwire/2 cancel."""
    return _decode_checked(_cancel_decoder, _check_cancel, data, max_size, "cancel")


def decode_heartbeat(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES
) -> LeaseHeartbeat:
    """Decode a lease renewal (vLLM 0.34)."""
    return _decode_checked(_heartbeat_decoder, _check_heartbeat, data, max_size, "heartbeat")


#: The kinds of message D sends, by their discriminator keys (§12.3).
REQUEST_KINDS: Final = {
    "req_blocks": "pull",
    "cancel_reqs": "cancel",
    "lease_transfer_ids": "heartbeat",
}


def detect_kind(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES
) -> str:
    """Which message ``data`` holds, from its keys: ``pull``, ``cancel`` or ``heartbeat`` by the
    one discriminator key it carries (3.1-R7), else ``response`` when it has a ``status``."""
    obj = _top_level(data, max_size)
    if "status" in obj and not REQUEST_KINDS.keys() & obj.keys():
        return "response"
    return _request_kind(obj)


def _request_kind(obj: dict[Any, Any]) -> str:
    kinds = [kind for key, kind in REQUEST_KINDS.items() if key in obj]
    if len(kinds) == 1:
        return kinds[0]
    keys = ", ".join(REQUEST_KINDS)
    found = "none" if not kinds else "those of " + " and ".join(kinds)
    raise DecodeError(
        f"a message carries exactly one of the keys {keys}; this one carries {found}",
        section=sections.TRANSPORT,
        kind="message",
    )


def decode_request(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES
) -> tuple[str, XferMetadataV2 | XferCancel | LeaseHeartbeat]:
    """A message D sent, of the kind its one discriminator key names (3.1-R7), decoded."""
    kind = _request_kind(_top_level(data, max_size))
    return kind, DECODERS[kind](data, max_size=max_size)


def _top_level(data: bytes | bytearray | memoryview, max_size: int) -> dict[Any, Any]:
    obj = _decode(_any_decoder, data, max_size, "message")
    if not isinstance(obj, dict):
        raise DecodeError(
            f"expected a map, got {type(obj).__name__}", section=sections.ENCODING, kind="message"
        )
    return obj


def decode_message(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES
) -> tuple[str, XferMetadataV2 | XferResponseV2 | XferCancel | LeaseHeartbeat]:
    """Detect the kind of ``data`` and decode it: a wire inspector's entry point."""
    kind = detect_kind(data, max_size=max_size)
    return kind, DECODERS[kind](data, max_size=max_size)


#: The decoder of each message kind.
DECODERS: Final[dict[str, Callable[..., Any]]] = {
    "pull": decode_pull,
    "response": decode_response,
    "cancel": decode_cancel,
    "heartbeat": decode_heartbeat,
}


def _decode_checked(
    decoder: msgspec.msgpack.Decoder[T],
    check: Callable[[T], Problem],
    data: Any,
    max_size: int,
    kind: str,
) -> T:
    """``data`` decoded, then held to the cross-field rules of its kind."""
    msg = _decode(decoder, data, max_size, kind)
    _raise_decode(check(msg), kind)
    return msg


def _decode(decoder: msgspec.msgpack.Decoder[T], data: Any, max_size: int, kind: str) -> T:
    if type(data) is not bytes or len(data) > max_size:
        _check_size(data, max_size, kind)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, kind) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _malformed(exc, kind) from None


class _PullWithRawLens(XferMetadataV2):
    """A pull whose strides and payloads are left as their msgpack bytes."""

    block_lens: msgspec.Raw  # type: ignore[assignment]
    kv_block_lens: msgspec.Raw  # type: ignore[assignment]


_raw_lens_decoder: Final = msgspec.msgpack.Decoder(_PullWithRawLens)
#: The decoder of ``block_lens`` and of ``kv_block_lens``, both of this type.
_region_lens_decoder: Final = msgspec.msgpack.Decoder(list[NonNegInt])
_REQUIRED_PULL_FIELDS: Final = len(XferMetadataV2.__struct_fields__) - len(
    XferMetadataV2.__struct_defaults__
)


def _decode_pull_fast(data: Any) -> XferMetadataV2 | None:
    """``data``'s pull, its strides and payloads compared as bytes and, when equal (no padded
    region: the common case), decoded once; None where only the full decoder can tell (an error,
    an older variant, a key given twice)."""
    try:
        msg: Any = _raw_lens_decoder.decode(data)
        strides = _region_lens_decoder.decode(msg.block_lens)
        if msg.kv_block_lens == msg.block_lens:
            # Sharing the int objects lets _check_pull compare the two lists by identity.
            payloads = strides.copy()
        else:
            payloads = _region_lens_decoder.decode(msg.kv_block_lens)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    # The full decoder checks each value of a key given twice, where this one read only the last.
    # A map holding no more keys than the pull has fields that differ from their default has no
    # key twice (nor an unknown one).
    if _map_size(data) != _fields_set(msg):
        return None
    # _PullWithRawLens only retypes two of XferMetadataV2's slots: the object becomes a pull.
    msg.__class__ = XferMetadataV2
    pull: XferMetadataV2 = msg
    pull.block_lens, pull.kv_block_lens = strides, payloads
    return pull


def _map_size(data: Any) -> int:
    """The number of keys of the map ``data`` begins with (fixmap, map 16 or map 32)."""
    head: int = data[0]
    if head < 0x90:
        return head & 0x0F
    return int.from_bytes(data[1:3] if head == 0xDE else data[1:5], "big")


def _fields_set(m: XferMetadataV2) -> int:
    """How many of the pull's fields differ from their default. A field left out here only sends
    a pull that sets it to the full decoder; a field counted at its default would let a key given
    twice through, so the defaults here must stay XferMetadataV2's (test_malformed checks)."""
    return (
        _REQUIRED_PULL_FIELDS
        + bool(m.registered_layer_names)
        + bool(m.registered_layer_indices)
        + bool(m.registered_group_indices)
        + bool(m.registered_shared_group_ids)
        + bool(m.registered_row_offsets)
        + (m.remote_pp_size != 1)
        + (m.layout_id != 0)
        + (m.pdwire_version != 0)
        + bool(m.pdwire_caps)
        + (m.fingerprint is not None)
        + (m.deadline_ms != 0)
        + (m.auth_key_id is not None)
        + (m.auth_tag is not None)
    )


def _decode_older_pull(data: Any, first_error: msgspec.ValidationError) -> XferMetadataV2:
    try:
        obj = _any_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _malformed(exc, "pull") from None
    upgraded = upgrade_pull(obj)
    if upgraded is None:
        raise _invalid(first_error, "pull") from None
    current, traits = upgraded
    try:
        return msgspec.convert(current, XferMetadataV2)
    except msgspec.ValidationError as exc:
        error = _invalid(exc, "pull")
    if FLAT_BLOCK_LISTS in traits:
        # Name the place in the bytes received, not in the upgraded form.
        error.path = error.path.replace(_UPGRADED_BLOCKS, _FLAT_BLOCKS, 1)
    raise error


def _check_size(data: Any, max_size: int, kind: str) -> None:
    if not isinstance(data, _BUFFERS):
        raise DecodeError(
            f"expected bytes, got {type(data).__name__}", section=sections.ENCODING, kind=kind
        )
    if len(data) > max_size:
        raise DecodeError(
            f"message of {len(data)} bytes exceeds the limit of {max_size} bytes",
            section=sections.ENCODING_LIMITS,
            kind=kind,
        )


def _malformed(exc: Exception, kind: str) -> DecodeError:
    if isinstance(exc, RecursionError):
        return DecodeError("nesting too deep", section=sections.ENCODING_LIMITS, kind=kind)
    return DecodeError(str(exc), section=sections.ENCODING, kind=kind)


def _invalid(exc: msgspec.ValidationError, kind: str) -> DecodeError:
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches every string
    message, path = m["msg"], m["path"] or "$"
    missing = _MISSING.match(message)
    if missing:
        path = f"{path}.{missing['field']}"
    top = re.match(r"^\$\.(\w+)", path)
    # Kinds without a schema (``message``) fail only on the encoding: a bad timestamp extension.
    default = KIND_SECTIONS.get(kind, sections.ENCODING)
    section = _FIELD_SECTIONS.get(top[1], default) if top else default
    return DecodeError(message, path=path, section=section, kind=kind)


# -- cross-field rules that types cannot express ----------------------------------------------

Problem = tuple[str, str] | None  # (path, message)


def _check_pull(m: XferMetadata) -> Problem:
    n = len(m.kv_caches_base_addr)
    payloads, strides = m.kv_block_lens, m.block_lens
    # The common case in one expression: every per-region list has one entry per region, and
    # no region is padded (payload equal to stride, compared in C).
    if (
        m.remote_tp_rank < m.remote_tp_size
        and len(strides) == n
        and len(payloads) == n
        and len(m.registered_layer_names) == n
        and len(m.registered_layer_indices) == n
        and len(m.registered_group_indices) == n
        and len(m.registered_shared_group_ids) == n
        and len(m.registered_row_offsets) == n
    ):
        return None if payloads == strides else _payload_past_stride(m)
    if m.remote_tp_rank >= m.remote_tp_size:
        return (
            "$.remote_tp_rank",
            f"TP rank {m.remote_tp_rank} is not below TP size {m.remote_tp_size}",
        )
    for name, k in zip(REGION_LISTS, map(len, _region_lists(m)), strict=True):
        if k and k != n:
            return f"$.{name}", f"{k} entries for {n} regions (must be {n} or absent)"
    return _payload_past_stride(m)


def _payload_past_stride(m: XferMetadata) -> Problem:
    """3.2-R21: a region's payload must fit its stride, or P would write into the next block."""
    payloads, strides = m.kv_block_lens, m.block_lens
    if not payloads or not strides or not any(map(operator.gt, payloads, strides)):
        return None
    i = next(i for i, (p, s) in enumerate(zip(payloads, strides, strict=True)) if p > s)
    return (
        f"$.kv_block_lens[{i}]",
        f"{payloads[i]} payload bytes exceed the block stride {strides[i]} of region {i}",
    )


def _check_response(m: XferResponse) -> Problem:
    if m.status >= _ERROR and m.ok_reqs:
        return "$.ok_reqs", f"status {m.status.name} carries no ok_reqs"
    if m.ok_reqs and m.err_reqs and not set(m.ok_reqs).isdisjoint(m.err_reqs):
        return "$.err_reqs", "a request is both ok and failed"
    codes = getattr(m, "err_codes", None)
    if codes and not set(codes) <= set(m.err_reqs or ()):
        return "$.err_codes", "err_codes names a request that is not in err_reqs"
    return None


def _check_cancel(m: XferCancel) -> Problem:
    if m.remote_tp_rank >= m.remote_tp_size:
        return (
            "$.remote_tp_rank",
            f"TP rank {m.remote_tp_rank} is not below TP size {m.remote_tp_size}",
        )
    if m.remote_pp_rank >= m.remote_pp_size:
        return (
            "$.remote_pp_rank",
            f"PP rank {m.remote_pp_rank} is not below PP size {m.remote_pp_size}",
        )
    return None


def _check_heartbeat(m: LeaseHeartbeat) -> Problem:
    if not m.lease_transfer_ids:
        # vLLM 0.34 takes a map without ids for a pull, and fails it as one.
        return "$.lease_transfer_ids", "a heartbeat names at least one transfer_id"
    return None


def _raise_decode(problem: Problem, kind: str) -> None:
    if problem is not None:
        raise DecodeError(problem[1], path=problem[0], section=KIND_SECTIONS[kind], kind=kind)


def _raise_local(problem: Problem, section: str) -> None:
    if problem is not None:
        raise LocalProtocolError(f"{problem[1]} - at `{problem[0]}`", section=section)
