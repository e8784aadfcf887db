"""A byte reader that turns fuzz input into structured choices.

Pure Python rather than ``atheris.FuzzedDataProvider``, so that the same targets run under
Hypothesis and when a crash input is replayed without atheris. An exhausted reader reads zeros,
so every input is a complete program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


class Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    @property
    def remaining(self) -> int:
        return len(self._data) - self._pos

    def byte(self) -> int:
        if self._pos >= len(self._data):
            return 0
        self._pos += 1
        return self._data[self._pos - 1]

    def below(self, n: int) -> int:
        """A number in ``range(n)``; one byte for ``n <= 256``, two otherwise."""
        if n <= 1:
            return 0
        value = self.byte() if n <= 256 else self.byte() << 8 | self.byte()
        return value % n

    def flag(self) -> bool:
        return bool(self.byte() & 1)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.below(len(options))]

    def blob(self, max_len: int) -> bytes:
        """Length-prefixed bytes, at most ``max_len``."""
        n = self.below(max_len + 1)
        out = self._data[self._pos : self._pos + n]
        self._pos += len(out)
        return out

    def subset(self, options: Sequence[T]) -> list[T]:
        """A subset of up to eight ``options``, chosen by the bits of one byte."""
        bits = self.byte()
        return [o for i, o in enumerate(options[:8]) if bits >> i & 1]


def mutate(data: bytes, r: Reader) -> bytes:
    """A few byte-level edits of ``data`` (flip, set, insert, delete, truncate)."""
    out = bytearray(data)
    for _ in range(1 + r.below(4)):
        op, at = r.below(5), r.below(len(out) + 1) if out else 0
        if op == 0 and at < len(out):
            out[at] ^= 1 << r.below(8)
        elif op == 1 and at < len(out):
            out[at] = r.byte()
        elif op == 2:
            out[at:at] = r.blob(4) or b"\x00"
        elif op == 3:
            del out[at : at + 1 + r.below(4)]
        else:
            del out[at:]
    return bytes(out)
