"""The harness's transfer engines (``conformance.peers.engine``): a closed one serves the next
``Engine`` of its host, since destroying one holds the GIL for about a second."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.engine")

from conformance.peers import engine
from conformance.peers.engine import Engine

SIZE = 4096


def test_a_closed_engine_serves_the_next_one_and_takes_writes_into_new_memory() -> None:
    first = Engine()
    first.allocate(SIZE, 1)
    port = first.port
    first.close()
    target, source = Engine(), Engine()
    try:
        assert target.port == port and source.port != port
        received, dst = target.allocate(SIZE, 0)
        sent, src = source.allocate(SIZE, 7)
        assert source.write(target.session, [src], [dst], [SIZE]) == 0
        assert bytes(received) == bytes(sent)
    finally:
        target.close()
        source.close()


def test_a_peer_an_earlier_run_wrote_to_is_written_from_a_new_transfer_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By the next run a peer's name (``host:rpc_port``) may be another testee's, and a transfer
    engine that wrote to it would write to the old one's data port: an ``Engine`` whose kept
    transfer engine wrote to that name takes a new one first, and its write lands."""
    monkeypatch.setattr(engine, "_idle", {})  # this test's engines only
    target, first = Engine(), Engine()
    opened = [target, first]
    try:
        received, dst = target.allocate(SIZE, 0)
        _, src = first.allocate(SIZE, 7)
        assert first.write(target.session, [src], [dst], [SIZE]) == 0
        wrote_before = first.port
        first.close()
        again, other = Engine(), Engine()
        opened += [again, other]
        assert again.port == wrote_before  # the kept transfer engine that wrote to target
        sent, src = again.allocate(SIZE, 9)
        assert again.write(other.session, [src], [other.allocate(SIZE, 0)[1]], [SIZE]) == 0
        assert again.port == wrote_before  # a peer it never wrote to: the same engine
        assert again.write(target.session, [src], [dst], [SIZE]) == 0
        assert again.port != wrote_before  # a new transfer engine wrote
        assert bytes(received) == bytes(sent)
    finally:
        for e in opened:
            e.close()
