"""The harness's Mooncake transfer engine: numpy buffers as registered memory, batch writes.

A transfer engine's destructor holds the GIL for about a second, which stalls every suite the
process runs. So a closed ``Engine`` keeps its transfer engine, with no memory registered, for
the next ``Engine`` of the same host in this process (the suites of ``pdwire conformance self``
and of the mutant check open and close one per run); the idle ones are destroyed at exit.
"""

from __future__ import annotations

import atexit
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
_idle: dict[str, list[Any]] = {}


def _started(hostname: str) -> Any:
    engine = _engine_class()()
    ret = engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
    if ret != 0:
        raise EngineUnavailable(f"TransferEngine.initialize returned {ret}")
    return engine


@atexit.register
def _destroy_idle() -> None:
    """Before the interpreter tears its modules down, under which a destructor may fail."""
    _idle.clear()


class Engine:
    """One engine in P2P-handshake mode over TCP; peers are named ``host:rpc_port``."""

    def __init__(self, hostname: str = "127.0.0.1") -> None:
        self.hostname = hostname
        idle = _idle.get(hostname)
        self._engine: Any = idle.pop() if idle else _started(hostname)
        self.port: int = self._engine.get_rpc_port()
        self._buffers: dict[int, npt.NDArray[np.uint8]] = {}

    @property
    def session(self) -> str:
        return f"{self.hostname}:{self.port}"

    def allocate(self, nbytes: int, fill: int) -> tuple[npt.NDArray[np.uint8], int]:
        """A registered buffer of ``nbytes`` filled with ``fill``, and its address."""
        buf = np.full(nbytes, fill, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        ret = self._engine.register_memory(addr, nbytes)
        if ret != 0:
            raise EngineUnavailable(f"register_memory of {nbytes} bytes returned {ret}")
        self._buffers[addr] = buf
        return buf, addr

    def write(
        self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
    ) -> int:
        """One batch write into ``peer``'s memory; 0 on success."""
        if not src:
            return 0
        try:
            ret: int = self._engine.batch_transfer_sync_write(
                peer, list(map(int, src)), list(map(int, dst)), list(map(int, lengths))
            )
        except Exception:  # the engine raises on some failures instead of returning a status
            return -1
        return ret

    def close(self) -> None:
        """Unregister the buffers, and keep the transfer engine for the next ``Engine`` of this
        host (at most IDLE_KEPT idle; beyond, it is destroyed now)."""
        if self._engine is None:
            return
        for addr in list(self._buffers):
            self._engine.unregister_memory(addr)
        self._buffers.clear()
        idle = _idle.setdefault(self.hostname, [])
        if len(idle) < IDLE_KEPT:
            idle.append(self._engine)
        self._engine = None
