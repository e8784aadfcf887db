"""Optional authentication of side-channel messages with a shared key (spec §8.6)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec

from . import sections
from .codec import encode_canonical
from .errors import RemoteProtocolError
from .messages import XferCancel, XferMetadataV2, XferResponseV2

M = TypeVar("M", XferMetadataV2, XferResponseV2, XferCancel)


def read_key_file(path: str) -> bytes:
    """The shared key kept in ``path``: the file's bytes, less a trailing newline.
    ``OSError`` when it cannot be read, ``ValueError`` when it holds no key."""
    key = Path(path).read_bytes().rstrip(b"\r\n")
    if not key:
        raise ValueError(f"{path}: the auth key file is empty")
    return key


#: A side's keys: the one it signs with first, then any it still accepts (8.6-R16).
Keys = bytes | Sequence[bytes]
_KEY_ID_LABEL: Final = b"pdwire/2 key id"


def key_id(key: bytes) -> str:
    """The id signed messages and registrations carry for ``key`` (8.6-R15): the first 8 bytes
    of HMAC-SHA256 of "pdwire/2 key id" under the key, as 16 lower-case hex digits."""
    return hmac.new(key, _KEY_ID_LABEL, hashlib.sha256).digest()[:8].hex()


def key_named(keys: Keys, wanted: object) -> bytes | None:
    """The one of ``keys`` whose id is ``wanted``, if any (8.6-R16)."""
    if not isinstance(wanted, str):
        return None
    ring = (keys,) if isinstance(keys, bytes) else keys
    want = wanted.encode()  # compare_digest takes no non-ASCII str
    return next((k for k in ring if hmac.compare_digest(key_id(k).encode(), want)), None)


def canonical_json(payload: dict[str, Any]) -> bytes:
    """The canonical JSON of a registration body (8.6-R11)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii")


def register_tag(payload_without_tag: dict[str, Any], key: bytes) -> str:
    """Lower-case hex HMAC-SHA256 of a registration body without ``auth_tag`` (8.6-R10)."""
    return hmac.new(key, canonical_json(payload_without_tag), hashlib.sha256).hexdigest()


def sign_registration(body: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``body`` with the id of ``key`` and its ``auth_tag`` (8.6-R10, 8.6-R15)."""
    named = {**{k: v for k, v in body.items() if k != "auth_tag"}, "auth_key_id": key_id(key)}
    return {**named, "auth_tag": register_tag(named, key)}


def registration_is_signed(body: dict[str, Any], keys: Keys) -> bool:
    """Whether ``body`` carries a valid ``auth_tag`` under the key its ``auth_key_id`` names
    (8.6-R12, 8.6-R16)."""
    sent = body.get("auth_tag")
    key = key_named(keys, body.get("auth_key_id"))
    if not isinstance(sent, str) or key is None:
        return False
    rest = {k: v for k, v in body.items() if k != "auth_tag"}
    return hmac.compare_digest(sent.encode(), register_tag(rest, key).encode())


def tag(
    msg: XferMetadataV2 | XferResponseV2 | XferCancel, key: bytes, answers: bytes | None = None
) -> bytes:
    """HMAC-SHA256 of the canonical encoding of ``msg`` without its tag, followed, for a reply,
    by the tag of the pull or cancel it ``answers`` (8.6-R13)."""
    return hmac.new(key, encode_canonical(msg) + (answers or b""), hashlib.sha256).digest()


def sign(msg: M, key: bytes, answers: bytes | None = None) -> M:
    """A copy of ``msg`` naming ``key`` by its id and carrying its authentication tag."""
    named = msgspec.structs.replace(msg, auth_key_id=key_id(key))
    return msgspec.structs.replace(named, auth_tag=tag(named, key, answers))


def verify(
    msg: XferMetadataV2 | XferResponseV2 | XferCancel, keys: Keys, answers: bytes | None = None
) -> None:
    """Raise ``RemoteProtocolError`` unless ``msg`` carries a valid tag under the one of
    ``keys`` its ``auth_key_id`` names (and, for a reply, for the tag of the message it
    ``answers``)."""
    if msg.auth_tag is None:
        raise RemoteProtocolError("message carries no auth_tag", section=sections.AUTHENTICATION)
    key = key_named(keys, msg.auth_key_id)
    if key is None:
        raise RemoteProtocolError(
            f"auth_key_id {msg.auth_key_id!r} names no key held", section=sections.AUTHENTICATION
        )
    if not hmac.compare_digest(msg.auth_tag, tag(msg, key, answers)):
        raise RemoteProtocolError("auth_tag does not match", section=sections.AUTHENTICATION)
