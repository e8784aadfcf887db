"""The harness's Mooncake transfer engine: numpy buffers as registered memory, batch writes.

A transfer engine's destructor holds the GIL for about a second, which stalls every suite the
process runs. So a closed ``Engine`` keeps its transfer engine, with no memory registered, for
the next ``Engine`` of the same host in this process (the suites of ``pdwire conformance self``
and of the mutant check open and close one per run); the idle ones are destroyed at exit.

A transfer engine keeps what it learnt of each peer it wrote to (its data port, its memory) by
the peer's name, ``host:rpc_port``, and has no call to forget it. A testee started later may get
the RPC port of one that has stopped (the engines pick them from 15000-17000), and a kept engine
would then write to the old one's data port: "failed to read WRITE ack frame", status -1. So an
``Engine`` about to write to a peer whose name its transfer engine wrote to in an earlier run
takes a new transfer engine first.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt


class EngineUnavailable(RuntimeError):
    """The Mooncake transfer engine cannot be loaded or started here."""


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped]
    except ImportError as exc:
        hint = (
            "install libibverbs1 (apt-get install -y libibverbs1)"
            if "libibverbs" in str(exc)
            else "pip install 'pdwire[mooncake]'"
        )
        raise EngineUnavailable(
            f"the harness needs the Mooncake transfer engine: {hint} ({exc})"
        ) from exc
    return TransferEngine


#: Idle transfer engines kept per host: more than the runs one process has open at once.
IDLE_KEPT: Final = 8


class _Kept:
    """A transfer engine, and the names of the peers it has written to."""

    def __init__(self, hostname: str) -> None:
        self.engine: Any = _engine_class()()
        ret = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if ret != 0:
            raise EngineUnavailable(f"TransferEngine.initialize returned {ret}")
        self.written: set[str] = set()


_idle: dict[str, list[_Kept]] = {}


@atexit.register
def _destroy_idle() -> None:
    """Before the interpreter tears its modules down, under which a destructor may fail."""
    _idle.clear()


class Engine:
    """One engine in P2P-handshake mode over TCP; peers are named ``host:rpc_port``."""

    def __init__(self, hostname: str = "127.0.0.1") -> None:
        self.hostname = hostname
        idle = _idle.get(hostname)
        self._kept: _Kept | None = idle.pop() if idle else _Kept(hostname)
        self._engine: Any = self._kept.engine
        #: peers the transfer engine wrote to before this run: their names may now be others'
        self._earlier = set(self._kept.written)
        self.port: int = self._engine.get_rpc_port()
        self._buffers: dict[int, npt.NDArray[np.uint8]] = {}
        self._lock = threading.Lock()

    @property
    def session(self) -> str:
        return f"{self.hostname}:{self.port}"

    def allocate(self, nbytes: int, fill: int) -> tuple[npt.NDArray[np.uint8], int]:
        """A registered buffer of ``nbytes`` filled with ``fill``, and its address."""
        buf = np.full(nbytes, fill, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        self._register(addr, nbytes)
        self._buffers[addr] = buf
        return buf, addr

    def _register(self, addr: int, nbytes: int) -> None:
        ret = self._engine.register_memory(addr, nbytes)
        if ret != 0:
            raise EngineUnavailable(f"register_memory of {nbytes} bytes returned {ret}")

    def _renew(self) -> None:
        """Move this run's buffers to a new transfer engine, which knows no peer; the one it
        leaves goes back to the idle ones."""
        fresh = _Kept(self.hostname)
        self._release()
        self._kept, self._engine, self._earlier = fresh, fresh.engine, set()
        self.port = self._engine.get_rpc_port()
        for addr, buf in self._buffers.items():
            self._register(addr, buf.nbytes)

    def write(
        self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
    ) -> int:
        """One batch write into ``peer``'s memory; 0 on success."""
        if not src:
            return 0
        with self._lock:
            if peer in self._earlier:
                self._renew()
            assert self._kept is not None
            self._kept.written.add(peer)
            engine = self._engine
        try:
            ret: int = engine.batch_transfer_sync_write(
                peer, list(map(int, src)), list(map(int, dst)), list(map(int, lengths))
            )
        except Exception:  # the engine raises on some failures instead of returning a status
            return -1
        return ret

    def close(self) -> None:
        """Unregister the buffers, and keep the transfer engine for the next ``Engine`` of this
        host (at most IDLE_KEPT idle; beyond, it is destroyed now)."""
        if self._kept is None:
            return
        self._release()
        self._buffers.clear()
        self._kept = self._engine = None

    def _release(self) -> None:
        """Unregister the buffers from the transfer engine, and keep it idle."""
        assert self._kept is not None
        for addr in self._buffers:
            self._engine.unregister_memory(addr)
        idle = _idle.setdefault(self.hostname, [])
        if len(idle) < IDLE_KEPT:
            idle.append(self._kept)
