"""Targets for every decoder: the side-channel messages of both profiles (§2, §3), the bootstrap
documents (§4), ``kv_transfer_params`` (§5) and version negotiation (§8.3).

A decoder either returns a value or raises ``DecodeError`` naming a path and a section. A value
must survive a round trip through the encoder of each profile; anything else is a bug.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Final

import msgspec
from pydantic import BaseModel

from pdwire import (
    DecodeError,
    DecodeParams,
    DecodeResultParams,
    EngineEntry,
    PrefillParams,
    QueryResponse,
    RegisterReply,
    RegisterWorkerPayload,
    RemoteProtocolError,
    XferMetadata,
    XferResponse,
    decode_cancel,
    decode_json,
    decode_message,
    decode_pull,
    decode_response,
    detect_kind,
    encode_cancel,
    encode_pull,
    encode_response,
    negotiate,
    verify,
)
from pdwire.http_models import RegisterError
from pdwire.legacy import older_variants
from pdwire.negotiation import LEGACY_PEER, Offer
from pdwire.roles import Role
from pdwire.vectors import AUTH_KEY
from pdwire.versions import ALL_CAPS, LEGACY, PDWIRE_2, WIRE_VERSION

from .reader import Reader

_KINDS: Final = ("pull", "response", "cancel", "heartbeat")
_MAX_SIZE: Final = 1 << 16


def _typed(error: DecodeError) -> None:
    """What every ``DecodeError`` must carry (2.4): a section and a path into the message."""
    if not error.section or not error.path.startswith("$") or f"§{error.section}" not in str(error):
        raise AssertionError(f"DecodeError without a section or path: {error!r}")


def _check_tag(msg: Any) -> None:
    with contextlib.suppress(RemoteProtocolError):
        verify(msg, AUTH_KEY)


def _same(label: str, a: object, b: object) -> None:
    if a != b:
        raise AssertionError(f"{label}: {a!r} != {b!r}")


def pull(data: bytes) -> None:
    """A pull of either profile or an older variant (§3.2, §3.8); re-encoded under both."""
    try:
        msg = decode_pull(data, max_size=_MAX_SIZE)
    except DecodeError as e:
        _typed(e)
        return
    _same("pull pdwire/2", decode_pull(encode_pull(msg, PDWIRE_2)), msg)
    base = XferMetadata(*msgspec.structs.astuple(msg)[: len(XferMetadata.__struct_fields__)])
    again = decode_pull(encode_pull(msg, LEGACY))
    _same("pull legacy", encode_pull(again, LEGACY), encode_pull(base, LEGACY))
    _check_tag(msg)


def response(data: bytes) -> None:
    """A reply of either profile (§3.4); re-encoded under both."""
    try:
        msg = decode_response(data, max_size=_MAX_SIZE)
    except DecodeError as e:
        _typed(e)
        return
    _same("response pdwire/2", decode_response(encode_response(msg, PDWIRE_2)), msg)
    base = XferResponse(*msgspec.structs.astuple(msg)[: len(XferResponse.__struct_fields__)])
    again = decode_response(encode_response(msg, LEGACY))
    _same("response legacy", encode_response(again, LEGACY), encode_response(base, LEGACY))
    _check_tag(msg)


def cancel(data: bytes) -> None:
    """A pdwire/2 cancel (§3.5); re-encoded."""
    try:
        msg = decode_cancel(data, max_size=_MAX_SIZE)
    except DecodeError as e:
        _typed(e)
        return
    _same("cancel", decode_cancel(encode_cancel(msg, PDWIRE_2)), msg)
    _check_tag(msg)


def message(data: bytes) -> None:
    """The wire inspector's path: detect the kind, then decode it."""
    try:
        kind = detect_kind(data, max_size=_MAX_SIZE)
    except DecodeError as e:
        _typed(e)
    else:
        if kind not in _KINDS:
            raise AssertionError(f"unknown kind {kind!r}")
    try:
        kind, _ = decode_message(data, max_size=_MAX_SIZE)
    except DecodeError as e:
        _typed(e)
    try:
        obj = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return
    if not all(isinstance(v, str) for v in older_variants(obj)):
        raise AssertionError("older_variants returned a non-string")


def _http(models: tuple[type[BaseModel], ...], data: bytes) -> None:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        doc = None
    for model in models:
        for body in (data, doc) if isinstance(doc, dict) else (data,):
            try:
                value = decode_json(model, body)
            except DecodeError as e:
                _typed(e)
                continue
            dumped = value.dump()  # type: ignore[attr-defined]
            _same(model.__name__, decode_json(model, json.dumps(dumped)), value)


def register(data: bytes) -> None:
    """``POST /register``: the body P workers send, the reply and the error body (§4.1)."""
    _http((RegisterWorkerPayload, RegisterReply, RegisterError), data)


def query(data: bytes) -> None:
    """``GET /query``: the reply and one engine entry (§4.2)."""
    _http((QueryResponse, EngineEntry), data)


def kv_params(data: bytes) -> None:
    """``kv_transfer_params`` to P, to D, and in D's response (§5)."""
    _http((PrefillParams, DecodeParams, DecodeResultParams), data)


_CAP_NAMES: Final = (*sorted(ALL_CAPS), "", "x-unknown")
_VERSIONS: Final = (0, 1, 2, 3, 255, 2**31, 2**64 - 1)


def negotiation(data: bytes) -> None:
    """§8.3: the table's answer for any version and capabilities a peer may announce."""
    r = Reader(data)
    while r.remaining:
        role: Role = r.choice(("prefill", "decode"))
        local = Offer.of(r.choice((LEGACY, PDWIRE_2)), frozenset(r.subset(_CAP_NAMES)))
        version = r.choice(_VERSIONS) if r.flag() else r.below(1 << 16)
        peer = r.choice((None, LEGACY_PEER, Offer(version, frozenset(r.subset(_CAP_NAMES)))))
        agreed = negotiate(role, local, peer)
        if agreed.announce and agreed.profile != PDWIRE_2:
            raise AssertionError(f"announces under {agreed.profile}")
        if local.version == WIRE_VERSION[LEGACY] and (agreed.announce or agreed.caps):
            raise AssertionError("a legacy side announced or agreed capabilities")
        if not agreed.caps <= local.caps & (peer.caps if peer else frozenset()):
            raise AssertionError(f"agreed caps {agreed.caps} not offered by both")
        if peer is None and agreed.profile == PDWIRE_2 and role == "prefill":
            raise AssertionError("P answers pdwire/2 to a D that did not announce")
