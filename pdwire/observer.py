"""What an observer of the side channel makes of the messages it sees: a tap, a capture.

Sans-IO. The observer is given each message as it travelled (``Seen``: when, on which
connection, which way, the frames) and returns the record to print: the message decoded and
named, the D worker and P worker of the connection, and for a reply the message it answers.
A message it cannot decode is recorded raw, with the decode error; nothing is dropped. A
connection is one D DEALER (§3.1): D opens one per pull, cancel or heartbeat, so a reply
answers the last message D sent on its connection.

``summary()`` gives one verdict per transfer seen (§3.3, §3.4): ``failed`` when a reply listed
it failed or a pull that carried it was answered ERROR; else ``pending`` while a pull that
carried it with blocks has no final reply yet (the state of a D that waits); else ``loaded``
when such pulls were all answered, ``released`` when its only pulls were release-only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from .codec import DEFAULT_MAX_MESSAGE_BYTES, decode_message
from .errors import PdwireError
from .messages import (
    LeaseHeartbeat,
    XferCancel,
    XferMetadata,
    XferResponse,
    XferResponseStatus,
)
from .planning import regions_of_pull
from .vectors import as_json

#: The replies of vLLM 0.14 and 0.15 (§3.8).
OLDER_REPLIES: Final = (b"trans_done", b"trans_error")
#: How many transfers the summary remembers (the oldest go first).
MAX_TRANSFERS: Final = 100_000
TO_P: Final = "D->P"
TO_D: Final = "P->D"
#: Replies after which P sends nothing more on the connection (§3.3).
FINAL: Final = frozenset(
    {XferResponseStatus.FINISH, XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS}
)


@dataclasses.dataclass(frozen=True)
class Seen:
    """One message: ``at`` (seconds, any one clock), its connection, which way it went, the P
    worker at the connection's far end (``tp0/pp0``), and its frames as they travelled."""

    at: float
    conn: int
    to_p: bool
    p_worker: str
    frames: Sequence[bytes]


@dataclasses.dataclass
class _Sent:
    """What D last sent on a connection: what its replies answer."""

    at: float
    kind: str
    d_worker: str
    requests: dict[str, str]  # D request id -> transfer_id
    loads: frozenset[str]  # the D request ids it asked blocks for


@dataclasses.dataclass
class _Transfer:
    first: float
    last: float
    pulls: int = 0
    replies: int = 0
    renewals: int = 0
    cancels: int = 0
    blocks: int = 0  # D's blocks asked for, once per D worker
    bytes: int = 0  # their payload bytes, as the pulls' layouts describe them
    waiting: int = 0  # pulls with blocks and no final reply yet
    loads: int = 0  # pulls with blocks
    failure: str | None = None
    d_workers: set[str] = dataclasses.field(default_factory=set)


def _older(frame: bytes) -> tuple[str, Any] | None:
    """The side channel of vLLM 0.14 and 0.15 (the note of §3.8), which no decoder reads: its
    pull, a map with ``request_ids`` and ``block_ids``, and its raw-byte replies."""
    if frame in OLDER_REPLIES:
        return "vllm-0.14-reply", frame.decode()
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if isinstance(obj, dict) and {"request_ids", "block_ids"} <= obj.keys():
        return "vllm-0.14-pull", as_json(obj)
    return None


def d_worker_of(msg: XferMetadata | XferCancel) -> str:
    """``host:port tpN`` of the D worker that sent ``msg``."""
    return f"{msg.remote_hostname}:{msg.remote_port} tp{msg.remote_tp_rank}"


#: Per region of a pull's layout: its payload bytes per block and its KV-cache group.
Layout = tuple[tuple[int, int], ...]


def layout_of(msg: XferMetadata) -> Layout | None:
    """The payload per block (``kv_block_len``, else ``block_len``) and group of each region
    ``msg`` describes (``planning.regions_of_pull``); None when it omits its layout (§3.7)."""
    regions = regions_of_pull(msg)
    if not regions:
        return None
    return tuple((r.kv_block_len or r.block_len, r.group_index) for r in regions)


def bytes_asked(layout: Layout, blocks: Sequence[Sequence[int]]) -> int:
    """The payload bytes of ``blocks`` (D's block ids per group) over ``layout``'s regions."""
    return sum(
        payload * len(blocks[group]) for payload, group in layout if 0 <= group < len(blocks)
    )


class Observer:
    """The records and verdicts of one tap or capture; ``follow`` keeps only the records of that
    transfer_id (the summary still counts every transfer)."""

    def __init__(self, follow: str | None = None, max_size: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.follow = follow
        self.max_size = max_size
        self._sent: dict[int, _Sent] = {}
        # (P worker, D worker, layout_id) -> the layout a pull sent: what later pulls that
        # omit it mean (§3.7)
        self._layouts: dict[tuple[str, str, int], Layout] = {}
        self._transfers: dict[str, _Transfer] = {}

    def see(self, seen: Seen) -> dict[str, Any]:
        """The record of ``seen``. Whether to show it: ``shown``."""
        record: dict[str, Any] = {
            "t": round(seen.at, 6),
            "dir": TO_P if seen.to_p else TO_D,
            "conn": seen.conn,
            "p_worker": seen.p_worker,
            "bytes": sum(len(f) for f in seen.frames),
        }
        if len(seen.frames) != 1:
            record.update(kind="raw", frames=[f.hex() for f in seen.frames])
            record["error"] = f"{len(seen.frames)} frames; a side-channel message is one (3.1-R5)"
            return self._with_request(record, self._sent.get(seen.conn))
        try:
            kind, msg = decode_message(seen.frames[0], max_size=self.max_size)
        except PdwireError as exc:
            older = _older(seen.frames[0])
            if older is None:
                record.update(kind="raw", frames=[seen.frames[0].hex()], error=str(exc))
            else:
                record.update(kind=older[0], message=older[1])
            return self._with_request(record, self._sent.get(seen.conn))
        record["kind"] = kind
        record["message"] = as_json(msg)
        if seen.to_p:
            sent = self._on_request(seen, kind, msg)
        else:
            assert isinstance(msg, XferResponse)
            sent = self._on_reply(seen, msg, record)
        return self._with_request(record, sent)

    def _with_request(self, record: dict[str, Any], sent: _Sent | None) -> dict[str, Any]:
        if sent is not None:
            if sent.d_worker:
                record["d_worker"] = sent.d_worker
            record["transfer_ids"] = sorted(set(sent.requests.values()))
        return record

    def shown(self, record: dict[str, Any]) -> bool:
        """Whether ``follow`` keeps ``record``."""
        return self.follow is None or self.follow in record.get("transfer_ids", ())

    def _transfer(self, tid: str, at: float) -> _Transfer:
        if tid not in self._transfers and len(self._transfers) >= MAX_TRANSFERS:
            del self._transfers[next(iter(self._transfers))]  # the oldest: a long tap's memory
        t = self._transfers.setdefault(tid, _Transfer(first=at, last=at))
        t.last = max(t.last, at)
        return t

    def _on_request(self, seen: Seen, kind: str, msg: Any) -> _Sent | None:
        if isinstance(msg, XferMetadata):
            requests = {d: tid for d, (tid, _) in msg.req_blocks.items()}
            loads = frozenset(d for d, (_, blocks) in msg.req_blocks.items() if any(blocks))
            sent = _Sent(seen.at, kind, d_worker_of(msg), requests, loads)
            layout = self._layout(seen.p_worker, sent.d_worker, msg)
            for d_req, (tid, blocks) in msg.req_blocks.items():
                t = self._transfer(tid, seen.at)
                t.pulls += 1
                if d_req in loads:
                    t.loads += 1
                    t.waiting += 1
                    if sent.d_worker not in t.d_workers:  # D's blocks fill once per D worker
                        t.d_workers.add(sent.d_worker)
                        t.blocks += sum(len(g) for g in blocks)
                        t.bytes += 0 if layout is None else bytes_asked(layout, blocks)
        elif isinstance(msg, XferCancel):
            sent = _Sent(seen.at, kind, d_worker_of(msg), dict(msg.cancel_reqs), frozenset())
            for tid in msg.cancel_reqs.values():
                self._transfer(tid, seen.at).cancels += 1
        elif isinstance(msg, LeaseHeartbeat):
            tids = {tid: tid for tid in msg.lease_transfer_ids}
            sent = _Sent(seen.at, kind, "", tids, frozenset())
            for tid in tids:
                self._transfer(tid, seen.at).renewals += 1
        else:  # a reply travelling D->P: recorded, answers nothing
            return None
        self._sent[seen.conn] = sent
        return sent

    def _layout(self, p_worker: str, d_worker: str, msg: XferMetadata) -> Layout | None:
        key = (p_worker, d_worker, msg.layout_id)
        layout = layout_of(msg)
        if layout is None:
            return self._layouts.get(key)
        if msg.layout_id:
            self._layouts[key] = layout
        return layout

    def _on_reply(self, seen: Seen, msg: XferResponse, record: dict[str, Any]) -> _Sent | None:
        record["status"] = msg.status.name
        sent = self._sent.get(seen.conn)
        if sent is None:
            return None
        record["answers"] = {"kind": sent.kind, "ms": round((seen.at - sent.at) * 1000, 3)}
        final = msg.status in FINAL
        failed = set(msg.err_reqs or ())
        if msg.status is XferResponseStatus.ERROR:
            failed |= set(sent.requests)
        for d_req, tid in sent.requests.items():
            t = self._transfer(tid, seen.at)
            t.replies += 1
            if d_req in failed and t.failure is None and sent.kind == "pull":
                t.failure = msg.err_msg or msg.status.name
            if final and d_req in sent.loads:
                t.waiting -= 1
        if final:  # a second final reply on the connection answers nothing
            del self._sent[seen.conn]
        return sent

    def summary(self, now: float) -> list[dict[str, Any]]:
        """One line per transfer seen, in the order they were first seen."""
        rows = []
        for tid, t in self._transfers.items():
            if t.failure is not None:
                verdict = "failed"
            elif t.waiting > 0:
                verdict = "pending"
            elif t.loads == 0:
                verdict = "released" if t.pulls else "renewed only"
            else:
                verdict = "loaded"
            end = now if verdict == "pending" else t.last
            row: dict[str, Any] = {
                "transfer_id": tid,
                "verdict": verdict,
                "pulls": t.pulls,
                "replies": t.replies,
                "blocks": t.blocks,
                "bytes": t.bytes,
                "ms": round((end - t.first) * 1000, 3),
            }
            if t.renewals:
                row["renewals"] = t.renewals
            if t.cancels:
                row["cancels"] = t.cancels
            if t.failure is not None:
                row["failure"] = t.failure
            if verdict == "pending":
                row["waiting_pulls"] = t.waiting
            rows.append(row)
        return rows


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """``summary()`` as a table, one transfer a line, and each failure after it."""
    if not rows:
        return "no transfer seen"
    head = ("transfer_id", "verdict", "pulls", "replies", "blocks", "bytes", "ms")
    cells = [[str(r[k]) for k in head] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [list(head), *cells]
    ]
    lines += [f"{r['transfer_id']}: {r['failure']}" for r in rows if "failure" in r]
    return "\n".join(lines)
