"""The harness's Mooncake transfer engine: numpy buffers as registered memory, batch writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


class Engine:
    """One engine in P2P-handshake mode over TCP; peers are named ``host:rpc_port``."""

    def __init__(self, hostname: str = "127.0.0.1") -> None:
        self.hostname = hostname
        self._engine: Any = _engine_class()()
        ret = self._engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if ret != 0:
            raise EngineUnavailable(f"TransferEngine.initialize returned {ret}")
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
        """Unregister the buffers and destroy the engine now: its destructor holds the GIL for
        about a second, which left to the garbage collector would stall a later case."""
        if self._engine is None:
            return
        for addr in list(self._buffers):
            self._engine.unregister_memory(addr)
        self._buffers.clear()
        self._engine = None
