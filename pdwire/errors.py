"""Exceptions. Every error names the spec section whose requirement was broken."""

from __future__ import annotations


class PdwireError(Exception):
    """Base class of every error pdwire raises on purpose."""

    section: str

    def __init__(self, message: str, *, section: str) -> None:
        super().__init__(message)
        self.message = message
        self.section = section

    def __str__(self) -> str:
        return f"{self.message} (spec §{self.section})"


class DecodeError(PdwireError, ValueError):
    """Bytes that are not a valid message of the kind asked for.

    ``path`` is a JSON-path-like location of the offending field (``$`` is the message itself).
    """

    def __init__(self, message: str, *, path: str = "$", section: str, kind: str = "") -> None:
        super().__init__(message, section=section)
        self.path = path
        self.kind = kind

    def __str__(self) -> str:
        what = f"{self.kind}: " if self.kind else ""
        return f"{what}{self.message} - at `{self.path}` (spec §{self.section})"


class ProtocolError(PdwireError):
    """A rule of the protocol was broken."""


class LocalProtocolError(ProtocolError):
    """We were about to break the spec (for example, send a peer what it cannot decode)."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the spec."""


class PeerCannotDecode(LocalProtocolError):
    """The message, status or field needs a wire version the peer has not announced."""
