"""The fake D: D workers with real KV memory (registered with the harness's Mooncake engine) that
send pulls to a P under test over new ZMQ DEALERs and collect its replies.

Memory starts filled with a sentinel byte. After a transfer the harness checks that every block
a pull asked for was written (no region-block still all sentinel) and that nothing else was:
every byte outside the blocks handed out is still the sentinel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

from pdwire.codec import decode_response
from pdwire.errors import DecodeError
from pdwire.messages import XferMetadataV2, XferResponseStatus, XferResponseV2
from pdwire.planning import NULL_BLOCK_ID, Region, clip_window
from pdwire.sim.geometry import Geometry
from pdwire.vectors import as_json

from ..case import WireLog
from .engine import Engine
from .rawpack import map_keys

SENTINEL: Final = 0xA5
GUARD: Final = 4096  # sentinel bytes before the first region and after the last
TERMINAL: Final = frozenset(
    {XferResponseStatus.FINISH, XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS}
)


@dataclasses.dataclass
class Reply:
    """One frame received on a pull's DEALER."""

    t: float  # seconds after the pull was sent
    frames: list[bytes]
    msg: XferResponseV2 | None = None
    error: DecodeError | None = None

    @property
    def data(self) -> bytes:
        return self.frames[-1]

    @property
    def keys(self) -> list[str]:
        """The top-level map keys as sent, in order ([] when not a map)."""
        return map_keys(self.data)


@dataclasses.dataclass
class PullResult:
    replies: list[Reply]
    timed_out: bool  # no terminal reply within the wait
    elapsed: float
    sent_tag: bytes | None = None  # the auth_tag of what was sent, which signed replies cover
    started: float = 0.0  # monotonic, when the send completed; a reply's t counts from here

    @property
    def ended(self) -> float:
        """Monotonic, when the exchange ended (its terminal reply, or its wait)."""
        return self.started + self.elapsed

    @property
    def terminal(self) -> XferResponseV2 | None:
        last = self.replies[-1].msg if self.replies else None
        return last if last is not None and last.status in TERMINAL else None

    @property
    def status(self) -> XferResponseStatus | None:
        return self.terminal.status if self.terminal is not None else None

    def ok(self) -> list[str]:
        return [r for reply in self.decoded() for r in reply.ok_reqs or ()]

    def err(self) -> list[str]:
        return [r for reply in self.decoded() for r in reply.err_reqs or ()]

    def decoded(self) -> list[XferResponseV2]:
        return [r.msg for r in self.replies if r.msg is not None]

    def describe(self) -> str:
        if not self.replies:
            return f"no reply within {self.elapsed:.1f}s"
        parts = []
        for r in self.replies:
            if r.msg is None:
                parts.append(f"undecodable ({r.error})")
            else:
                m = r.msg
                parts.append(f"{m.status.name} ok={m.ok_reqs} err={m.err_reqs} msg={m.err_msg!r}")
        suffix = " (then nothing: timed out)" if self.timed_out else ""
        return "; ".join(parts) + suffix


class DWorker:
    """One fake D worker: its position, its regions in real memory and its free blocks."""

    def __init__(
        self,
        engine: Engine,
        geometry: Geometry,
        tp_size: int,
        tp_rank: int,
        pp_size: int = 1,
        pp_rank: int = 0,
    ) -> None:
        self.engine = engine
        self.geometry = geometry
        self.pp_rank = pp_rank
        simulated = geometry.side(tp_size, tp_rank, pp_size, pp_rank, 0)
        origin = simulated.regions[0].base_addr
        self.q = geometry.kernel_blocks  # rows per block (10.6.6)
        rows = geometry.num_blocks * self.q
        end = max(r.base_addr + r.block_len * rows for r in simulated.regions)
        self.memory, addr = engine.allocate(end - origin + 2 * GUARD, SENTINEL)
        base = addr + GUARD
        self.side = dataclasses.replace(
            simulated,
            regions=tuple(
                dataclasses.replace(r, base_addr=base + r.base_addr - origin)
                for r in simulated.regions
            ),
        )
        self._addr = addr
        # block 0 is the null block of a model with state-space layers (10.6.3): never held
        self._free = list(range(1 if geometry.mamba else 0, geometry.num_blocks))
        self._held: set[int] = set()

    @property
    def regions(self) -> tuple[Region, ...]:
        return self.side.regions

    # -- blocks ------------------------------------------------------------------------------

    def take(self, n: int, *, scattered: bool = False) -> list[int]:
        """``n`` free block ids (every other free one when ``scattered``: more descriptors)."""
        pool = self._free[::2] if scattered and len(self._free) >= 2 * n else self._free
        if len(pool) < n:
            raise RuntimeError(f"the fake D worker has {len(self._free)} free blocks, {n} needed")
        blocks = pool[:n]
        for b in blocks:
            self._free.remove(b)
            self._held.add(b)
        return blocks

    def give_back(self, blocks: Iterable[int]) -> None:
        """Return blocks and reset them to the sentinel."""
        for b in blocks:
            if b in self._held:
                self._held.discard(b)
                self._free.append(b)
                for i in range(len(self.regions)):
                    for row in self.rows(i, b):
                        row[:] = SENTINEL
        self._free.sort()

    def rows(self, region: int, block: int) -> list[npt.NDArray[np.uint8]]:
        """The payload bytes of each of ``block``'s rows in region ``region``: the block
        itself, or its kernel blocks (10.6.6)."""
        r = self.regions[region]
        first = self._start(r, block)
        starts = range(first, first + self.q * r.block_len, r.block_len)
        return [self.memory[start : start + r.kv_block_len] for start in starts]

    def block(self, region: int, block: int) -> npt.NDArray[np.uint8]:
        """The payload bytes of ``block`` in region ``region`` (a copy, rows in order)."""
        rows = self.rows(region, block)
        return rows[0].copy() if len(rows) == 1 else np.concatenate(rows)

    def group_lists(self, blocks: Sequence[int]) -> list[list[int]]:
        """The block lists of a pull for a request held in ``blocks``, one per KV-cache group:
        every group uses the same ids, a sliding-window group only the last ones it keeps
        (10.4.7), a state-space group only the last, after a null block for each other
        (10.6.3). Each group's regions are layers of their own, so the ids do not collide; a
        region both groups share takes the ids of each, which then must differ (its case takes
        them itself)."""
        g = self.geometry
        if g.sliding_window is not None:
            return [list(blocks), list(clip_window(blocks, g.sliding_window, g.block_size))]
        if g.mamba:
            return [list(blocks), [NULL_BLOCK_ID] * (len(blocks) - 1) + list(blocks[-1:])]
        return [list(blocks)]

    def unwritten(self, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """(region, block) pairs among the blocks of each region's group (``group_lists``,
        null blocks left out) with a row whose payload is still all sentinel."""
        lists = self.group_lists(blocks)
        nulls = self.geometry.mamba_groups
        return [
            (i, b)
            for i, r in enumerate(self.regions)
            for g in (r.shared_group_ids if r.group_index < 0 else (r.group_index,))
            for b in lists[g]
            if not (g in nulls and b == NULL_BLOCK_ID)
            and any(bool(np.all(row == SENTINEL)) for row in self.rows(i, b))
        ]

    def stray_bytes(self) -> int:
        """Bytes outside the held blocks that are no longer the sentinel."""
        mask = np.ones(self.memory.shape, dtype=bool)
        for r in self.regions:
            for b in self._held:
                start = self._start(r, b)
                for row in range(start, start + self.q * r.block_len, r.block_len):
                    mask[row : row + r.kv_block_len] = False
        return int(np.count_nonzero(self.memory[mask] != SENTINEL))

    def _start(self, region: Region, block: int) -> int:
        """Where ``block``'s first row of ``region`` lies in ``memory``."""
        return region.base_addr - self._addr + block * self.q * region.block_len

    def snapshot(self, blocks: Sequence[int]) -> list[bytes]:
        """The payload of each (region, block), in region-major order: for comparing the bytes
        two transfers of one prompt wrote."""
        return [self.block(i, b).tobytes() for i in range(len(self.regions)) for b in blocks]

    # -- pulls -------------------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """The layout fields of a pull (§3.2) describing this worker's regions."""
        rs = self.regions
        return {
            "kv_caches_base_addr": [r.base_addr for r in rs],
            "block_lens": [r.block_len for r in rs],
            "kv_block_lens": [r.kv_block_len for r in rs],
            "registered_layer_names": [r.layer_name for r in rs],
            "registered_layer_indices": [r.layer_index for r in rs],
            "registered_group_indices": [r.group_index for r in rs],
            "registered_shared_group_ids": [
                list(r.shared_group_ids) or [r.group_index] for r in rs
            ],
            "registered_row_offsets": [r.row_offset for r in rs],
        }

    def pull(
        self,
        req_blocks: dict[str, tuple[str, list[list[int]]]],
        *,
        with_layout: bool = True,
        **fields: Any,
    ) -> XferMetadataV2:
        """A pull from this worker; ``fields`` override or add (pdwire/2) fields."""
        base: dict[str, Any] = {
            "remote_hostname": self.engine.hostname,
            "remote_port": self.engine.port,
            "remote_tp_size": self.side.tp_size,
            "remote_tp_rank": self.side.tp_rank,
            "req_blocks": req_blocks,
            "remote_pp_size": self.side.pp_size,
        }
        if with_layout:
            base.update(self.layout())
        else:
            base.update(kv_caches_base_addr=[], block_lens=[], kv_block_lens=[])
        base.update(fields)
        return XferMetadataV2(**base)


async def exchange(
    ctx: zmq.asyncio.Context,
    addr: str,
    data: bytes | list[bytes],
    timeout: float,
    log: WireLog,
    *,
    linger_after: float = 0.0,
    on_reply: Callable[[Reply], None] | None = None,
) -> PullResult:
    """Send ``data`` (one frame, or several) on a new DEALER to ``addr`` and read replies until a
    terminal one or ``timeout``. With ``linger_after``, keep reading that long after the
    terminal reply, to see whether anything more arrives. ``on_reply`` sees each reply as it
    arrives."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    channel = f"zmq {addr}"
    replies: list[Reply] = []
    start = time.monotonic()
    deadline = start + timeout
    timed_out = False
    try:
        sock.connect(addr)
        frames = [data] if isinstance(data, bytes) else data
        await sock.send_multipart(frames)
        start = time.monotonic()  # replies count from the send, not from the connect
        log.sent(channel, f"{len(frames)} frame(s), {sum(map(len, frames))} bytes", _frames(frames))
        done_at: float | None = None
        while True:
            now = time.monotonic()
            until = deadline if done_at is None else min(deadline, done_at + linger_after)
            if now >= until:
                timed_out = done_at is None
                break
            try:
                got = await asyncio.wait_for(sock.recv_multipart(), until - now)
            except TimeoutError:
                timed_out = done_at is None
                break
            reply = Reply(time.monotonic() - start, [bytes(f) for f in got])
            try:
                reply.msg = decode_response(reply.data)
            except DecodeError as exc:
                reply.error = exc
            replies.append(reply)
            summary = (
                f"{reply.msg.status.name}"
                if reply.msg is not None
                else f"undecodable: {reply.error}"
            )
            log.received(
                channel, summary, as_json(reply.msg) if reply.msg else _frames(reply.frames)
            )
            if on_reply is not None:
                on_reply(reply)
            terminal = reply.msg is None or reply.msg.status in TERMINAL
            if terminal and done_at is None:
                done_at = time.monotonic()
                if linger_after <= 0:
                    break
    finally:
        sock.close(linger=0)
    if timed_out:
        log.note(f"no terminal reply within {timeout:.1f}s")
    return PullResult(replies, timed_out, time.monotonic() - start, sent_tag(frames), start)


def sent_tag(frames: list[bytes]) -> bytes | None:
    """The ``auth_tag`` of the message in ``frames``, if it is a map that carries one."""
    try:
        obj = msgspec.msgpack.decode(frames[-1])
    except (msgspec.DecodeError, RecursionError):
        return None
    tag = obj.get("auth_tag") if isinstance(obj, dict) else None
    return tag if isinstance(tag, bytes) else None


def _frames(frames: Sequence[bytes]) -> list[str]:
    return [f.hex() if len(f) <= 256 else f[:256].hex() + "..." for f in frames]
