"""Optional authentication of side-channel messages with a shared key (spec §8.6)."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import TypeVar

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


def tag(msg: XferMetadataV2 | XferResponseV2 | XferCancel, key: bytes) -> bytes:
    """HMAC-SHA256 of the canonical encoding of ``msg`` without its tag."""
    return hmac.new(key, encode_canonical(msg), hashlib.sha256).digest()


def sign(msg: M, key: bytes) -> M:
    """A copy of ``msg`` carrying its authentication tag."""
    return msgspec.structs.replace(msg, auth_tag=tag(msg, key))


def verify(msg: XferMetadataV2 | XferResponseV2 | XferCancel, key: bytes) -> None:
    """Raise ``RemoteProtocolError`` unless ``msg`` carries a valid tag for ``key``."""
    if msg.auth_tag is None:
        raise RemoteProtocolError("message carries no auth_tag", section=sections.AUTHENTICATION)
    if not hmac.compare_digest(msg.auth_tag, tag(msg, key)):
        raise RemoteProtocolError("auth_tag does not match", section=sections.AUTHENTICATION)
