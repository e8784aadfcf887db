"""The harness's transfer engines (``conformance.peers.engine``): a closed one serves the next
``Engine`` of its host, since destroying one holds the GIL for about a second."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.engine")

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
