"""What the scheduler half tells the workers each engine step (plain data: vLLM serializes it to
every worker process)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdwire.events import RequestQueued


@dataclasses.dataclass(frozen=True)
class Load:
    """D: load ``d_req_id``'s KV from the P engine ``engine_id``; no blocks = release-only."""

    d_req_id: str
    transfer_id: str
    engine_id: str
    bootstrap_addr: str
    blocks: list[list[int]]  # per KV-cache group
    deadline: float | None = None  # time.time() when D stops waiting (pdwire/2 deadline_ms)


@dataclasses.dataclass(frozen=True)
class Send:
    """P: the request that produces ``transfer_id``; ``blocks`` once its prefill is done."""

    transfer_id: str
    p_req_id: str
    blocks: list[list[int]] | None = None  # None: admitted, not finished yet


@dataclasses.dataclass(frozen=True)
class NoSend:
    """P: the request ended without KV to send (a stop token as its only token, an abort)."""

    transfer_id: str
    p_req_id: str
    reason: str


@dataclasses.dataclass
class PdwireConnectorMetadata(KVConnectorMetadata):
    """One step's worth, applied by each worker in this order: sends, no-sends, queued, loads,
    aborts."""

    sends: list[Send] = dataclasses.field(default_factory=list)
    no_sends: list[NoSend] = dataclasses.field(default_factory=list)
    #: D, with a lease: requests that arrived, renewed until their loads settle (§6.4)
    queued: list[RequestQueued] = dataclasses.field(default_factory=list)
    loads: list[Load] = dataclasses.field(default_factory=list)
    aborts: list[str] = dataclasses.field(default_factory=list)  # D request ids

    @property
    def empty(self) -> bool:
        return not (self.sends or self.no_sends or self.queued or self.loads or self.aborts)
