"""Optional authentication of side-channel messages with a shared key (spec §8.6)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any, TypeVar

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


def canonical_json(payload: dict[str, Any]) -> bytes:
    """The canonical JSON of a registration body (8.6-R11)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii")


def register_tag(payload_without_tag: dict[str, Any], key: bytes) -> str:
    """Lower-case hex HMAC-SHA256 of a registration body without ``auth_tag`` (8.6-R10)."""
    return hmac.new(key, canonical_json(payload_without_tag), hashlib.sha256).hexdigest()


def tag(
    msg: XferMetadataV2 | XferResponseV2 | XferCancel, key: bytes, answers: bytes | None = None
) -> bytes:
    """HMAC-SHA256 of the canonical encoding of ``msg`` without its tag, followed, for a reply,
    by the tag of the pull or cancel it ``answers`` (8.6-R13)."""
    return hmac.new(key, encode_canonical(msg) + (answers or b""), hashlib.sha256).digest()


def sign(msg: M, key: bytes, answers: bytes | None = None) -> M:
    """A copy of ``msg`` carrying its authentication tag."""
    return msgspec.structs.replace(msg, auth_tag=tag(msg, key, answers))


def verify(
    msg: XferMetadataV2 | XferResponseV2 | XferCancel, key: bytes, answers: bytes | None = None
) -> None:
    """Raise ``RemoteProtocolError`` unless ``msg`` carries a valid tag for ``key`` (and, for a
    reply, for the tag of the message it ``answers``)."""
    if msg.auth_tag is None:
        raise RemoteProtocolError("message carries no auth_tag", section=sections.AUTHENTICATION)
    if not hmac.compare_digest(msg.auth_tag, tag(msg, key, answers)):
        raise RemoteProtocolError("auth_tag does not match", section=sections.AUTHENTICATION)
