"""Reading side-channel messages out of pcap bytes: TCP put back in order, ZMTP cut into
messages. The capture of a real run is read in tests/integration/test_capture_real.py; here the
packets are built to reach what a loopback run rarely shows (segments out of order, a
retransmission, a long frame, a stream that is no ZMTP)."""

from __future__ import annotations

import io
import struct

import pytest

from pdwire import capture

D, P, WEB = ("127.0.0.1", 40000), ("127.0.0.1", 5555), ("127.0.0.1", 8080)


def _ip(a: str) -> bytes:
    return bytes(int(x) for x in a.split("."))


def _segment(
    src: tuple[str, int], dst: tuple[str, int], seq: int, flags: int, data: bytes
) -> bytes:
    tcp = struct.pack(">HHIIBBHHH", src[1], dst[1], seq, 0, 5 << 4, flags, 65535, 0, 0) + data
    ip = struct.pack(
        ">BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0, _ip(src[0]), _ip(dst[0])
    )
    return b"\x00" * 12 + b"\x08\x00" + ip + tcp  # Ethernet, as tcpdump -i lo writes it


def _pcap(packets: list[bytes]) -> io.BytesIO:
    out = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1)
    for i, frame in enumerate(packets):
        out += struct.pack("<IIII", 1000 + i, 0, len(frame), len(frame)) + frame
    return io.BytesIO(out)


def _greeting() -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def test_messages_come_out_whole_in_order_and_each_way() -> None:
    ready = _frame(b"\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER", command=True)
    pull = b"\x81" + b"x" * 300  # a long frame
    to_p = _greeting() + ready + _frame(pull) + _frame(b"a", more=True) + _frame(b"b")
    to_d = _greeting() + ready + _frame(b"reply")
    half = len(to_p) // 2
    packets = [
        _segment(D, P, 99, 0x02, b""),  # SYN
        _segment(P, D, 499, 0x12, b""),  # SYN+ACK
        _segment(D, P, 100 + half, 0x18, to_p[half:]),  # the second half first
        _segment(D, P, 100, 0x18, to_p[:half]),
        _segment(D, P, 100, 0x18, to_p[:10]),  # a retransmission: nothing new
        _segment(P, D, 500, 0x18, to_d),
        _segment(WEB, D, 0, 0x02, b""),  # another connection, not ZMTP: skipped
        _segment(WEB, D, 1, 0x18, b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * 100),
    ]
    seen = list(capture.messages(_pcap(packets)))
    assert [(s.conn, s.to_p, list(s.frames)) for s in seen] == [
        (1, True, [pull]),
        (1, True, [b"a", b"b"]),
        (1, False, [b"reply"]),
    ]
    assert all(s.p_worker == "127.0.0.1:5555" for s in seen)
    assert [s.at for s in seen] == [1003.0, 1003.0, 1005.0]


def test_a_connection_opened_before_the_capture_is_skipped() -> None:
    packets = [_segment(D, P, 100, 0x18, _greeting() + _frame(b"lost"))]
    assert list(capture.messages(_pcap(packets))) == []


def test_what_is_no_pcap_says_so() -> None:
    with pytest.raises(capture.CaptureError, match="pcapng"):
        list(capture.messages(io.BytesIO(b"\x0a\x0d\x0d\x0a" + b"\x00" * 40)))
    with pytest.raises(capture.CaptureError, match="not a pcap file"):
        list(capture.messages(io.BytesIO(b"GET / HTTP/1.1\r\n" * 3)))
