"""What goes into and comes out of the sans-IO sessions.

Inputs are facts that happened (past tense): a message arrived, a transfer finished, a write
completed. Outputs are what the driver must do: send these bytes, start this write, free these
blocks, report this request. The sessions never read a clock: every input comes with ``now``.
"""

from __future__ import annotations

import dataclasses
import enum

from .http_models import EngineEntry
from .messages import ErrorCode, LeaseHeartbeat, XferCancel, XferMetadata, XferResponse
from .planning import Descriptors

# -- producer (P worker) inputs --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class MessageReceived:
    """A frame arrived on P's ROUTER from ``identity``: a pull or a cancel, still encoded."""

    identity: bytes
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class TransferStarted:
    """P's scheduler admitted the request that will produce ``transfer_id`` (no blocks yet)."""

    transfer_id: str
    p_req_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class TransferFinished:
    """P's prefill reached its length cap: the KV of ``blocks`` (per KV-cache group) is ready."""

    transfer_id: str
    p_req_id: str
    blocks: list[list[int]]


@dataclasses.dataclass(frozen=True, slots=True)
class TransferWillNotSend:
    """P's request ended otherwise (a stop token as its only token, an abort, an error)."""

    transfer_id: str
    p_req_id: str
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class WriteCompleted:
    """The batch write ``write_id`` returned ``status`` (0 = every byte written)."""

    write_id: int
    status: int = 0


# -- consumer (D worker) inputs --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class LoadRequest:
    """One D request whose KV P will write; empty ``blocks`` = release-only (§3.2-R5)."""

    d_req_id: str
    transfer_id: str
    engine_id: str
    bootstrap_addr: str
    blocks: list[list[int]]
    deadline_ms: int = 0  # pdwire/2: the D leg's budget left for this load (5.2-R4); 0 = none


@dataclasses.dataclass(frozen=True, slots=True)
class RequestQueued:
    """D received a request whose KV a P holds for it: from now until its load settles, D renews
    P's lease on it (§6.4), also while the request still waits in D's queue."""

    d_req_id: str
    transfer_id: str
    engine_id: str
    bootstrap_addr: str


@dataclasses.dataclass(frozen=True, slots=True)
class LoadsRequested:
    """D's scheduler asks to load these requests (one engine step's batch)."""

    requests: tuple[LoadRequest, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineResolved:
    """The bootstrap query for ``engine_id`` answered (``entry``) or failed (``error``)."""

    engine_id: str
    entry: EngineEntry | None
    error: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyReceived:
    """A frame arrived on the DEALER of pull (or cancel) ``pull_id``."""

    pull_id: int
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class AbortRequested:
    """D's request was aborted (client gone, rejected)."""

    d_req_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class TimePassed:
    """Nothing happened but the clock moved; fires due timers."""


ProducerInput = (
    MessageReceived
    | TransferStarted
    | TransferFinished
    | TransferWillNotSend
    | WriteCompleted
    | TimePassed
)
ConsumerInput = (
    RequestQueued | LoadsRequested | EngineResolved | ReplyReceived | AbortRequested | TimePassed
)

# -- outputs ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SendReply:
    """P: send ``data`` (the encoding of ``reply``) as ``[identity, data]`` on the ROUTER."""

    identity: bytes
    reply: XferResponse
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class StartWrite:
    """P: one batch write of ``descriptors`` into the D at ``peer`` ("host:port"); report it
    back with ``WriteCompleted(write_id, status)``."""

    write_id: int
    peer: str
    descriptors: Descriptors
    d_req_ids: tuple[str, ...] = ()


class FreeReason(enum.StrEnum):
    SERVED = "served"
    EXPIRED = "expired"
    WILL_NOT_SEND = "will-not-send"
    CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True, slots=True)
class FreeBlocks:
    """P: the blocks of ``p_req_id`` may be freed now."""

    p_req_id: str
    transfer_id: str
    reason: FreeReason


@dataclasses.dataclass(frozen=True, slots=True)
class RejectRequest:
    """P: this request's transfer_id is taken; fail its HTTP leg (§10.11.8)."""

    p_req_id: str
    transfer_id: str
    code: ErrorCode
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class QueryBootstrap:
    """D: ask ``bootstrap_addr``/query where ``engine_id``'s workers are."""

    engine_id: str
    bootstrap_addr: str


@dataclasses.dataclass(frozen=True, slots=True)
class SendPull:
    """D: open a new DEALER to ``addr`` and send ``data`` (a pull, a cancel or a heartbeat) as
    one frame; deliver its replies as ``ReplyReceived(pull_id, ...)``."""

    pull_id: int
    addr: str
    message: XferMetadata | XferCancel | LeaseHeartbeat
    data: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ClosePull:
    """D: close the DEALER of ``pull_id`` (linger 0); later frames on it are not wanted."""

    pull_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLoaded:
    """D: every paired P worker wrote this request's KV; it may decode."""

    d_req_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFailed:
    """D: loading failed for good (apply the load-failure policy). ``blocks_free`` is False when
    a write may still land in its blocks: free them only on ``BlocksReleased``."""

    d_req_id: str
    code: ErrorCode
    reason: str
    blocks_free: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class BlocksReleased:
    """D: no write can land in this failed request's blocks any more."""

    d_req_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseRejected:
    """D: the P worker at ``addr`` refused a lease renewal (it has no lease, or predates vLLM
    0.34): its blocks expire on its own timer. Worth a warning: D and P should share a lease."""

    addr: str
    reason: str


ProducerOutput = SendReply | StartWrite | FreeBlocks | RejectRequest
ConsumerOutput = (
    QueryBootstrap
    | SendPull
    | ClosePull
    | RequestLoaded
    | RequestFailed
    | BlocksReleased
    | LeaseRejected
)
