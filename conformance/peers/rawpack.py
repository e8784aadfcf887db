"""MessagePack written by hand, for bytes that msgspec never writes: map, array and string
headers of a chosen width, integers wider than they need, keys of any type, values verbatim."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Literal

import msgspec

Width = Literal[0, 16, 32]  # 0: the shortest form


@dataclasses.dataclass(frozen=True)
class Verbatim:
    """Bytes written as they are, in the place of a value."""

    data: bytes


@dataclasses.dataclass(frozen=True)
class Wide:
    """An integer written with a 64-bit header whatever its value."""

    value: int


def pack(obj: Any, *, width: Width = 0, wide_ints: bool = False) -> bytes:
    """``obj`` as MessagePack. ``width`` (16 or 32) gives every map, array, string and bin a
    header of that many bits, whatever its length; ``wide_ints`` writes every integer with a
    64-bit header."""
    out = bytearray()
    _write(out, obj, width, wide_ints)
    return bytes(out)


def _write(out: bytearray, obj: Any, width: Width, wide: bool) -> None:
    if isinstance(obj, Verbatim):
        out += obj.data
    elif obj is None:
        out.append(0xC0)
    elif obj is True or obj is False:
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, Wide):
        _int(out, obj.value, True)
    elif isinstance(obj, int):
        _int(out, obj, wide)
    elif isinstance(obj, float):
        out += b"\xcb" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        data = obj.encode()
        _header(out, len(data), width, fix=(0xA0, 31), sized={8: 0xD9, 16: 0xDA, 32: 0xDB})
        out += data
    elif isinstance(obj, bytes):
        _header(out, len(obj), width, fix=None, sized={8: 0xC4, 16: 0xC5, 32: 0xC6})
        out += obj
    elif isinstance(obj, (list, tuple)):
        _header(out, len(obj), width, fix=(0x90, 15), sized={16: 0xDC, 32: 0xDD})
        for item in obj:
            _write(out, item, width, wide)
    elif isinstance(obj, dict):
        _header(out, len(obj), width, fix=(0x80, 15), sized={16: 0xDE, 32: 0xDF})
        for key, value in obj.items():
            _write(out, key, width, wide)
            _write(out, value, width, wide)
    else:
        raise TypeError(f"cannot pack {type(obj).__name__}")


def _header(
    out: bytearray, n: int, width: Width, *, fix: tuple[int, int] | None, sized: dict[int, int]
) -> None:
    bits: int = width
    if bits == 0:
        if fix is not None and n <= fix[1]:
            out.append(fix[0] | n)
            return
        bits = next(w for w in (8, 16, 32) if w in sized and n < 2**w)
    out.append(sized[bits])
    out += n.to_bytes(bits // 8, "big")


def _int(out: bytearray, n: int, wide: bool) -> None:
    if wide:
        out += b"\xcf" if n >= 0 else b"\xd3"
        out += n.to_bytes(8, "big", signed=n < 0)
    elif 0 <= n < 128:
        out.append(n)
    elif -32 <= n < 0:
        out += n.to_bytes(1, "big", signed=True)
    elif n >= 0:
        for code, size in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
            if n < 2 ** (8 * size):
                out.append(code)
                out += n.to_bytes(size, "big")
                return
        raise OverflowError(n)
    else:
        for code, size in ((0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
            if n >= -(2 ** (8 * size - 1)):
                out.append(code)
                out += n.to_bytes(size, "big", signed=True)
                return
        raise OverflowError(n)


def map_keys(data: bytes) -> list[str]:
    """The top-level keys of a MessagePack map as sent, in order ([] when it is not a map)."""
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return []
    return [str(k) for k in obj] if isinstance(obj, dict) else []
