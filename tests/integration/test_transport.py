"""MooncakeTransport over loopback TCP: this process writes into a tensor of a child process.

The child (spawned, so it gets a fresh engine and address space) registers a tensor, reports its
session and base address over a Pipe, and answers commands until told to stop. Every wait on the
Pipe has a timeout; every child is joined or terminated.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from pdwire.planning import Descriptors
from reference_connector.transport import (
    ENGINE_RAISED,
    MooncakeTransport,
    TransportUnavailable,
    explain_import_error,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
PEER_BYTES = 64 * MiB
REPLY_TIMEOUT = 60.0  # spawning imports torch: slow on a loaded 2-core machine
CHILD_IDLE_EXIT = 120.0  # an orphaned child exits on its own after this long without a command
WRITE_TIMEOUT = 30.0

T = TypeVar("T")


# -- the peer process ------------------------------------------------------------------------


def _peer_main(conn: Connection, nbytes: int) -> None:
    try:
        transport = MooncakeTransport()
    except TransportUnavailable as exc:
        conn.send(("unavailable", str(exc)))
        return
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    base = transport.register(buf)
    conn.send(("ready", transport.session, base))
    view = buf.numpy()
    while conn.poll(CHILD_IDLE_EXIT):
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "zero":
            buf.zero_()
            conn.send(None)
        elif cmd == "digest":
            conn.send(hashlib.sha256(view.data).hexdigest())
        elif cmd == "read":
            offset, length = args
            conn.send(view[offset : offset + length].tobytes())
    transport.close()
    conn.send("stopped")


@dataclass
class Peer:
    proc: mp.process.BaseProcess
    conn: Connection
    session: str
    base: int

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return _recv(self.conn)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                self.conn.poll(10.0)
        except (BrokenPipeError, EOFError, OSError):
            pass
        _reap(self.proc)


def _recv(conn: Connection) -> Any:
    if not conn.poll(REPLY_TIMEOUT):
        raise TimeoutError(f"no reply from the peer process within {REPLY_TIMEOUT}s")
    return conn.recv()


def _reap(proc: mp.process.BaseProcess) -> None:
    proc.join(10.0)
    if proc.is_alive():
        proc.terminate()
        proc.join(10.0)


def _spawn_peer(nbytes: int) -> Peer:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child, nbytes), daemon=True)
    proc.start()
    child.close()
    try:
        kind, *rest = _recv(parent)
    except BaseException:
        _reap(proc)
        raise
    if kind == "unavailable":
        _reap(proc)
        pytest.skip(f"Mooncake transfer engine unavailable in the peer process: {rest[0]}")
    session, base = rest
    return Peer(proc, parent, session, base)


@pytest.fixture(scope="module")
def local() -> Iterator[MooncakeTransport]:
    try:
        transport = MooncakeTransport()
    except TransportUnavailable as exc:
        pytest.skip(f"Mooncake transfer engine unavailable: {exc}")
    try:
        yield transport
    finally:
        transport.close()


@pytest.fixture(scope="module")
def source(local: MooncakeTransport) -> Iterator[tuple[torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (PEER_BYTES,), dtype=torch.uint8, generator=gen)
    base = local.register(src)
    try:
        yield src, base
    finally:
        local.unregister(src)


@pytest.fixture(scope="module")
def peer(local: MooncakeTransport) -> Iterator[Peer]:
    p = _spawn_peer(PEER_BYTES)
    try:
        yield p
    finally:
        p.stop()


# -- helpers ---------------------------------------------------------------------------------


def _bounded(fn: Callable[[], T], timeout: float = WRITE_TIMEOUT) -> T:
    """Run ``fn`` in a daemon thread so that a hung engine call fails the test, not the run."""
    out: list[T] = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"engine call still running after {timeout}s"
    assert out, "engine call raised (see the thread's traceback above)"
    return out[0]


def _descriptors(src_base: int, dst_base: int, triples: list[tuple[int, int, int]]) -> Descriptors:
    """Descriptors from (source offset, destination offset, length) triples."""
    s, d, n = (np.array(col, dtype=np.uint64) for col in zip(*triples, strict=True))
    return Descriptors(s + np.uint64(src_base), d + np.uint64(dst_base), n)


def _expected_digest(src: torch.Tensor, triples: list[tuple[int, int, int]]) -> str:
    want = np.zeros(PEER_BYTES, dtype=np.uint8)
    data = src.numpy()
    for s, d, n in triples:
        want[d : d + n] = data[s : s + n]
    return hashlib.sha256(want.data).hexdigest()


def _write_and_verify(
    local: MooncakeTransport, peer: Peer, src: tuple[torch.Tensor, int], triples: list[Any]
) -> float:
    """Write the triples into the zeroed peer, check every byte; return the write's seconds."""
    tensor, base = src
    peer.call("zero")
    desc = _descriptors(base, peer.base, triples)
    start = time.perf_counter()
    assert _bounded(lambda: local.write(peer.session, desc)) == 0
    elapsed = time.perf_counter() - start
    assert peer.call("digest") == _expected_digest(tensor, triples)
    return elapsed


# -- writes ----------------------------------------------------------------------------------


def test_write_contiguous_and_scattered(
    local: MooncakeTransport, peer: Peer, source: tuple[torch.Tensor, int]
) -> None:
    triples = [
        (0, 0, 256 * 1024),  # one contiguous run
        (300_000, 5 * MiB + 3, 4096),  # scattered, unaligned, out of order
        (17, 2 * MiB, 1),
        (1_000_001, 3 * MiB - 12_345, 12_345),
        (4 * MiB, 7 * MiB, 65_536),
        (PEER_BYTES - 100, PEER_BYTES - 100, 100),  # up to the last byte of both tensors
    ]
    _write_and_verify(local, peer, source, triples)
    tensor, _ = source
    assert peer.call("read", 2 * MiB, 1) == tensor[17:18].numpy().tobytes()


def test_large_writes_bytes_and_throughput(
    local: MooncakeTransport, peer: Peer, source: tuple[torch.Tensor, int]
) -> None:
    _write_and_verify(local, peer, source, [(0, 0, 4096)])  # handshake out of the timing
    one = _write_and_verify(local, peer, source, [(0, 0, PEER_BYTES)])
    block = 64 * 1024
    order = np.random.default_rng(3).permutation(1000)
    scattered = [(i * block, int(j) * block, block) for i, j in enumerate(order)]
    many = _write_and_verify(local, peer, source, scattered)
    logger.info(
        "Mooncake TCP loopback: 1 x 64 MiB %.2f GB/s; 1000 x 64 KiB in one batch %.2f GB/s",
        PEER_BYTES / one / 1e9,
        1000 * block / many / 1e9,
    )


def test_empty_descriptors_do_not_call_the_engine(
    local: MooncakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "_engine", None)  # any engine call would raise AttributeError
    assert local.write("127.0.0.1:1", Descriptors.empty()) == 0
    assert local.raw_write("127.0.0.1:1", [], [], []) == 0


def test_raw_write_matches_write(
    local: MooncakeTransport, peer: Peer, source: tuple[torch.Tensor, int]
) -> None:
    tensor, base = source
    peer.call("zero")
    ret = _bounded(lambda: local.raw_write(peer.session, [base + 10], [peer.base + 20], [30]))
    assert ret == 0
    assert peer.call("read", 20, 30) == tensor[10:40].numpy().tobytes()
    with pytest.raises(ValueError, match="differ in length"):
        local.raw_write(peer.session, [base], [peer.base], [])


# -- failures are statuses, not exceptions ---------------------------------------------------


def test_write_outside_registered_destination_returns_nonzero(
    local: MooncakeTransport, peer: Peer, source: tuple[torch.Tensor, int]
) -> None:
    _, base = source
    beyond = _descriptors(base, peer.base, [(0, PEER_BYTES + MiB, 4096)])
    assert _bounded(lambda: local.write(peer.session, beyond)) != 0
    straddling = _descriptors(base, peer.base, [(0, PEER_BYTES - 100, 4096)])
    assert _bounded(lambda: local.write(peer.session, straddling)) != 0


def test_write_to_dead_peer_returns_nonzero(
    local: MooncakeTransport, source: tuple[torch.Tensor, int]
) -> None:
    _, base = source
    doomed = _spawn_peer(MiB)
    try:
        desc = _descriptors(base, doomed.base, [(0, 0, 4096)])
        assert _bounded(lambda: local.write(doomed.session, desc)) == 0
    finally:
        doomed.stop()
    assert not doomed.proc.is_alive()
    assert _bounded(lambda: local.write(doomed.session, desc)) != 0


def test_write_to_port_without_listener_returns_nonzero(
    local: MooncakeTransport, source: tuple[torch.Tensor, int]
) -> None:
    _, base = source
    desc = _descriptors(base, 0x10000, [(0, 0, 64)])
    assert _bounded(lambda: local.write("127.0.0.1:1", desc)) != 0


def test_engine_exception_becomes_minus_one(
    local: MooncakeTransport, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Raising:
        def batch_transfer_sync_write(self, *args: object) -> int:
            raise TypeError("incompatible function arguments")

    monkeypatch.setattr(local, "_engine", Raising())
    desc = _descriptors(0, 0, [(0, 0, 1)])
    with caplog.at_level(logging.ERROR, logger="reference_connector.transport"):
        assert local.write("127.0.0.1:1", desc) == ENGINE_RAISED == -1
    assert "incompatible function arguments" in caplog.text


# -- registration ----------------------------------------------------------------------------


def test_non_contiguous_and_empty_tensors_are_rejected(local: MooncakeTransport) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        local.register(torch.zeros(64, 64, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="empty"):
        local.register(torch.zeros(0, dtype=torch.uint8))


def test_register_unregister_and_close() -> None:
    """``close`` destroys the engine (its destructor holds the GIL for about a second, which
    the garbage collector would run at a random later moment); ``destroy=False`` keeps it."""
    try:
        transport = MooncakeTransport()
    except TransportUnavailable as exc:
        pytest.skip(f"Mooncake transfer engine unavailable: {exc}")
    a = torch.zeros(4096, dtype=torch.float32)
    b = torch.zeros(10, dtype=torch.uint8)
    base = transport.register(a)
    assert base == a.data_ptr()
    assert transport.registered == {base: 4096 * 4}
    with pytest.raises(ValueError, match="already registered"):
        transport.register(a)
    with pytest.raises(RuntimeError, match="overlaps"):
        transport.register(a[1:])
    with pytest.raises(ValueError, match="not registered"):
        transport.unregister(b)
    transport.register(b)
    transport.unregister(a)
    assert transport.registered == {b.data_ptr(): 10}
    transport.close(destroy=False)  # the engine stays: its memory can be registered again
    assert transport.registered == {}
    assert transport.register(a) == base
    transport.close()
    assert transport.registered == {}
    host, port = transport.session.rsplit(":", 1)
    assert (host, int(port)) == ("127.0.0.1", transport.rpc_port)
    with pytest.raises(RuntimeError, match="the transport is closed"):
        transport.register(a)
    assert transport.raw_write(transport.session, [base], [base], [8]) == ENGINE_RAISED
    transport.close()  # a second close does nothing


def test_import_errors_say_what_to_do() -> None:
    missing_lib = ImportError("libibverbs.so.1: cannot open shared object file")
    assert "apt-get install -y libibverbs1" in str(explain_import_error(missing_lib))
    assert "run `make`" in str(explain_import_error(missing_lib))
    missing_pkg = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")
    assert "pip install 'pdwire[mooncake]'" in str(explain_import_error(missing_pkg))
