"""Side-channel messages out of a packet capture: pcap records, TCP streams, ZMTP 3 frames.

``messages(source)`` reads a capture in the pcap format (``tcpdump -w``; Ethernet, Linux cooked
v1 and v2, BSD loopback or raw IP link types; IPv4 and IPv6), puts each TCP connection's two
byte streams back in order, and cuts each stream that opens with a ZMTP 3 greeting into
messages (its commands, such as READY, are skipped). It yields them as ``Seen``, in the order
their last segment was captured: ``conn`` numbers the connections in the order they were
opened, ``to_p`` is the direction from the side that opened it (D's DEALER connects to P's
ROUTER, §3.1), and ``p_worker`` is the address of the side that accepted it. Streams of
anything else (HTTP, the transfer engine's own traffic) are left as soon as their first bytes
show it, so a capture of every port costs no memory for them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import struct
from collections.abc import Iterator
from typing import BinaryIO, Final

from .observer import Seen

#: The first and tenth bytes of every ZMTP 3 greeting (RFC 23/ZMTP).
_SIGNATURE_FIRST, _SIGNATURE_LAST = 0xFF, 0x7F
_GREETING: Final = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_PCAP_MAGIC: Final = {
    b"\xd4\xc3\xb2\xa1": ("<", 1e-6),
    b"\xa1\xb2\xc3\xd4": (">", 1e-6),
    b"\x4d\x3c\xb2\xa1": ("<", 1e-9),
    b"\xa1\xb2\x3c\x4d": (">", 1e-9),
}
_PCAPNG: Final = b"\x0a\x0d\x0d\x0a"
_SYN, _ACK = 0x02, 0x10


class CaptureError(ValueError):
    """The file is not a capture this reader understands (no spec section is broken)."""


Endpoint = tuple[str, int]


@dataclasses.dataclass
class _Stream:
    """One direction of a TCP connection: bytes in order, then ZMTP frames."""

    next_seq: int | None = None
    pending: dict[int, bytes] = dataclasses.field(default_factory=dict)
    buffer: bytearray = dataclasses.field(default_factory=bytearray)
    greeted: bool = False
    ignored: bool = False
    frames: list[bytes] = dataclasses.field(default_factory=list)

    def add(self, seq: int, data: bytes) -> None:
        if self.ignored or not data:
            return
        if self.next_seq is None:  # the connection began before the capture did
            self.ignored = True
            return
        self.pending[seq] = data
        while True:
            offset = self._next_offset()
            if offset is None:
                return
            seg_seq, chunk = offset
            del self.pending[seg_seq]
            skip = (self.next_seq - seg_seq) % 2**32
            if skip < len(chunk):  # else a retransmission of what the stream already has
                self.buffer += chunk[skip:]
                self.next_seq = (self.next_seq + len(chunk) - skip) % 2**32

    def _next_offset(self) -> tuple[int, bytes] | None:
        assert self.next_seq is not None
        for seq, chunk in self.pending.items():
            behind = (self.next_seq - seq) % 2**32
            if behind < 2**31:  # starts at or before the next byte wanted
                return seq, chunk
        return None

    def messages(self) -> Iterator[list[bytes]]:
        """The whole messages the bytes so far complete."""
        if self.ignored:
            return
        if not self.greeted:
            if len(self.buffer) >= 1 and self.buffer[0] != _SIGNATURE_FIRST:
                self._ignore()
                return
            if len(self.buffer) < _GREETING:
                return
            if self.buffer[9] != _SIGNATURE_LAST or self.buffer[10] < 3:
                self._ignore()
                return
            del self.buffer[:_GREETING]
            self.greeted = True
        while True:
            frame = self._frame()
            if frame is None:
                return
            flags, body = frame
            if flags & _COMMAND:
                continue
            self.frames.append(body)
            if not flags & _MORE:
                message, self.frames = self.frames, []
                yield message

    def _frame(self) -> tuple[int, bytes] | None:
        if len(self.buffer) < 2:
            return None
        flags = self.buffer[0]
        head = 9 if flags & _LONG else 2
        if len(self.buffer) < head:
            return None
        size = struct.unpack(">Q", self.buffer[1:9])[0] if flags & _LONG else self.buffer[1]
        if len(self.buffer) < head + size:
            return None
        body = bytes(self.buffer[head : head + size])
        del self.buffer[: head + size]
        return flags, body

    def _ignore(self) -> None:
        self.ignored = True
        self.buffer.clear()
        self.pending.clear()


@dataclasses.dataclass
class _Connection:
    number: int
    client: Endpoint  # the side that opened it: D
    server: Endpoint  # P's ROUTER
    streams: dict[bool, _Stream]  # to_p -> the stream


def _packets(source: BinaryIO) -> Iterator[tuple[float, int, bytes]]:
    """(time, link type, frame) of each record of a pcap file, read as it goes."""
    data = source.read(24)
    if data[:4] == _PCAPNG:
        raise CaptureError(
            "a pcapng file: write the capture as pcap (tcpdump -w FILE, without --pcapng), "
            "or convert it (editcap -F pcap IN OUT)"
        )
    if len(data) < 24 or data[:4] not in _PCAP_MAGIC:
        raise CaptureError("not a pcap file (no pcap magic number in its first 4 bytes)")
    order, unit = _PCAP_MAGIC[data[:4]]
    link = struct.unpack(order + "I", data[20:24])[0]
    while len(head := source.read(16)) == 16:
        sec, frac, incl, _ = struct.unpack(order + "IIII", head)
        yield sec + frac * unit, link, source.read(incl)


def _ip_payload(link: int, frame: bytes) -> bytes | None:
    """The IP packet inside a link-layer frame, or None for anything else."""
    if len(frame) < 20:
        return None
    if link == 1:  # Ethernet
        ethertype, start = struct.unpack(">H", frame[12:14])[0], 14
        if ethertype == 0x8100:  # one VLAN tag
            ethertype, start = struct.unpack(">H", frame[16:18])[0], 18
    elif link == 113:  # Linux cooked v1
        ethertype, start = struct.unpack(">H", frame[14:16])[0], 16
    elif link == 276:  # Linux cooked v2
        ethertype, start = struct.unpack(">H", frame[0:2])[0], 20
    elif link == 0:  # BSD loopback: the address family in host order
        family = int.from_bytes(frame[:4], "little") or int.from_bytes(frame[:4], "big")
        return frame[4:] if family in (2, 10, 24, 28, 30) else None
    elif link == 101:  # raw IP
        return frame
    else:
        raise CaptureError(f"link type {link} is not read here (Ethernet, Linux cooked, raw IP)")
    return frame[start:] if ethertype in (0x0800, 0x86DD) else None


def _tcp(packet: bytes) -> tuple[Endpoint, Endpoint, int, int, bytes] | None:
    """(source, destination, flags, seq, payload) of a TCP segment in an IP packet."""
    if len(packet) < 40:  # shorter than any IP header and TCP header together
        return None
    version = packet[0] >> 4
    if version == 4:
        header = (packet[0] & 0x0F) * 4
        if packet[9] != 6:
            return None
        total = struct.unpack(">H", packet[2:4])[0]
        src, dst = (
            str(ipaddress.IPv4Address(packet[12:16])),
            str(ipaddress.IPv4Address(packet[16:20])),
        )
        segment = packet[header:total]
    elif version == 6:
        if packet[6] != 6:
            return None
        length = struct.unpack(">H", packet[4:6])[0]
        src, dst = (
            str(ipaddress.IPv6Address(packet[8:24])),
            str(ipaddress.IPv6Address(packet[24:40])),
        )
        segment = packet[40 : 40 + length]
    else:
        return None
    if len(segment) < 20:
        return None
    sport, dport, seq = struct.unpack(">HHI", segment[:8])
    offset = (segment[12] >> 4) * 4
    return (str(src), sport), (str(dst), dport), segment[13], seq, segment[offset:]


def messages(source: BinaryIO) -> Iterator[Seen]:
    """Every ZMTP message of the pcap capture ``source`` reads (module docstring). Raises
    ``CaptureError`` for a file that is not a pcap capture."""
    connections: dict[frozenset[Endpoint], _Connection] = {}
    numbers = itertools.count(1)
    for at, link, frame in _packets(source):
        packet = _ip_payload(link, frame)
        tcp = None if packet is None else _tcp(packet)
        if tcp is None:
            continue
        src, dst, flags, seq, payload = tcp
        key = frozenset((src, dst))
        conn = connections.get(key)
        if flags & _SYN and not flags & _ACK:  # opens a connection (or reopens its ports)
            conn = _Connection(next(numbers), src, dst, {True: _Stream(), False: _Stream()})
            connections[key] = conn
        if conn is None:
            continue
        to_p = src == conn.client
        stream = conn.streams[to_p]
        if flags & _SYN:
            stream.next_seq = (seq + 1) % 2**32
            continue
        stream.add(seq, payload)
        for message in stream.messages():
            yield Seen(at, conn.number, to_p, f"{conn.server[0]}:{conn.server[1]}", message)
