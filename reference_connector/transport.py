"""The Mooncake transfer engine as P's write path (spec §3.1): P writes its KV blocks straight into
D's registered memory, one batch of descriptors per pull round.

Threading: one ``MooncakeTransport`` may be shared between threads, and ``write`` may run on
several at once (the producer agent's sender pool; 512 concurrent writes from 4 threads to two
peers were checked byte for byte). ``register``, ``unregister`` and ``close`` take a lock for the
registry of tensors; ``write`` takes none, so do not unregister memory while a write that uses it
is running.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from pdwire.planning import Descriptors

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: What the engine's batch calls answer on success.
OK: Final = 0
#: What ``write`` answers when the engine raised instead of returning a status.
ENGINE_RAISED: Final = -1

_NEEDS_IBVERBS: Final = (
    "the Mooncake transfer engine needs libibverbs.so.1 even over TCP: run `make` "
    "(installs Debian's libibverbs1) or `apt-get install -y libibverbs1`"
)
_NEEDS_PACKAGE: Final = (
    "the Mooncake transfer engine is not installed: pip install 'pdwire[mooncake]'"
)


class TransportUnavailable(RuntimeError):
    """The Mooncake transfer engine cannot be loaded or started here; the message says why and
    what to do."""


def explain_import_error(exc: ImportError) -> TransportUnavailable:
    """Turn a failed ``import mooncake.engine`` into an error that says what to install."""
    if "libibverbs" in str(exc):
        return TransportUnavailable(f"{_NEEDS_IBVERBS} ({exc})")
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("mooncake"):
        return TransportUnavailable(_NEEDS_PACKAGE)
    return TransportUnavailable(f"cannot load the Mooncake transfer engine: {exc}")


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped]
    except ImportError as exc:
        raise explain_import_error(exc) from exc
    return TransferEngine


class MooncakeTransport:
    """One Mooncake ``TransferEngine`` in P2P-handshake mode: no metadata server, a peer is named
    by ``host:rpc_port`` (what D sends as ``remote_hostname``/``remote_port``)."""

    def __init__(
        self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""
    ) -> None:
        self._hostname = hostname
        self._engine: Any = _engine_class()()
        ret = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if ret != OK:
            raise TransportUnavailable(
                f"Mooncake TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) returned {ret}"
            )
        self._rpc_port: int = self._engine.get_rpc_port()
        self._lock = threading.Lock()
        # base address -> tensor: keeps every registered tensor alive while the engine may
        # read or write its memory.
        self._registered: dict[int, torch.Tensor] = {}

    @property
    def rpc_port(self) -> int:
        """The port of this engine's P2P handshake listener."""
        return self._rpc_port

    @property
    def session(self) -> str:
        """``host:port`` by which peers reach this engine."""
        return f"{self._hostname}:{self._rpc_port}"

    def register(self, tensor: torch.Tensor) -> int:
        """Register the memory of a contiguous tensor; return its base address."""
        if not tensor.is_contiguous():
            raise ValueError("only a contiguous tensor can be registered with the transfer engine")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("cannot register an empty tensor with the transfer engine")
        base = int(tensor.data_ptr())
        with self._lock:
            if self._engine is None:
                raise RuntimeError("the transport is closed")
            if base in self._registered:
                raise ValueError(f"memory at {base:#x} is already registered")
            ret = self._engine.register_memory(base, nbytes)
            if ret != OK:
                raise RuntimeError(
                    f"Mooncake register_memory({base:#x}, {nbytes}) returned {ret}"
                    + (" (overlaps registered memory)" if ret == -7 else "")
                )
            self._registered[base] = tensor
        return base

    def unregister(self, tensor: torch.Tensor) -> None:
        """Unregister a tensor registered by ``register``."""
        base = int(tensor.data_ptr())
        with self._lock:
            if base not in self._registered:
                raise ValueError(f"memory at {base:#x} is not registered")
            self._unregister(base)

    def _unregister(self, base: int) -> None:
        ret = self._engine.unregister_memory(base)
        del self._registered[base]
        if ret != OK:
            logger.warning("Mooncake unregister_memory(%#x) returned %d", base, ret)

    @property
    def registered(self) -> dict[int, int]:
        """Base address -> length in bytes of every registered tensor."""
        with self._lock:
            return {b: t.numel() * t.element_size() for b, t in self._registered.items()}

    def write(self, peer: str, descriptors: Descriptors) -> int:
        """Write every descriptor to ``peer`` (``host:rpc_port``) in one batch call.

        Returns the engine's status: 0 on success, else its nonzero return code, or -1 when the
        engine raised (logged). Never raises for a failed transfer: the producer reports the
        status to D as ``"Mooncake transfer engine returned {ret}"``.
        """
        if len(descriptors) == 0:
            return OK
        return self._batch_write(
            peer, descriptors.src.tolist(), descriptors.dst.tolist(), descriptors.length.tolist()
        )

    def raw_write(
        self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
    ) -> int:
        """``write`` for plain lists of source addresses, destination addresses and lengths."""
        if not len(src) == len(dst) == len(lengths):
            raise ValueError(
                f"src, dst and lengths differ in length: {len(src)}, {len(dst)}, {len(lengths)}"
            )
        if not lengths:
            return OK
        return self._batch_write(peer, list(src), list(dst), list(lengths))

    def _batch_write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        try:
            if self._engine is None:
                raise RuntimeError("the transport is closed")
            ret = int(self._engine.batch_transfer_sync_write(peer, src, dst, lengths))
        except Exception:
            logger.exception("Mooncake batch_transfer_sync_write to %s raised", peer)
            return ENGINE_RAISED
        if ret != OK:
            logger.warning(
                "Mooncake batch_transfer_sync_write to %s (%d descriptors) returned %d",
                peer,
                len(lengths),
                ret,
            )
        return ret

    def close(self, destroy: bool = True) -> None:
        """Unregister every tensor and, with ``destroy``, destroy the engine now.

        The engine's destructor holds the GIL for about a second: left to the garbage
        collector, it would stall every thread of the process at some later, random moment.
        ``destroy=False`` leaves it to a process that exits next without running destructors
        (``os._exit``). Once destroyed, the transport cannot be used again."""
        with self._lock:
            if self._engine is None:
                return
            for base in list(self._registered):
                self._unregister(base)
            if destroy:
                self._engine = None

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
