"""The node's allocator of block ids. Every worker of a node holds the same block ids for a
request (vLLM's scheduler allocates them once), so it lives in the node's front process, which
loads no torch."""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """The request needs more blocks than the pool has at all."""


class BlockAllocator:
    """Thread-safe allocator of a node's block ids, lowest ids first (fewer descriptors)."""

    def __init__(self, num_blocks: int, reserved: int = 0) -> None:
        """Ids ``reserved ... num_blocks - 1``; the first ``reserved`` are never handed out
        (vLLM's null block, id 0, in a model with state-space layers)."""
        self.num_blocks = num_blocks - reserved
        self._free = list(range(reserved, num_blocks))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        """``n`` block ids, or None when fewer are free now. Raises ``OutOfBlocks`` when the
        pool could never hold ``n``."""
        if n > self.num_blocks:
            raise OutOfBlocks(f"{n} blocks asked for; the pool has {self.num_blocks}")
        with self._lock:
            if n > len(self._free):
                return None
            blocks = [heapq.heappop(self._free) for _ in range(n)]
            self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        with self._lock:
            stray = [b for b in blocks if b not in self._used]
            if stray:
                raise ValueError(f"blocks {stray} are not allocated")
            for b in blocks:
                self._used.discard(b)
                heapq.heappush(self._free, b)

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._used)
