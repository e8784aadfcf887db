"""The side-channel messages (spec §3) as msgspec structs.

``XferMetadata`` and ``XferResponse`` hold exactly vLLM 0.34's fields (0.33's are the same), in
its order, with its names, types and defaults, so their encoding is byte-identical to vLLM's
(the map header too: msgspec writes a fixmap only for structs of at most 15 fields). The
``...V2`` subclasses append the pdwire/2 extension fields; every one has a default, so it is
omitted unless set, and a legacy peer (msgspec ignores unknown map keys) never sees it.
``auth_tag`` is always the last field (§8.6). ``LeaseHeartbeat`` is vLLM 0.34's renewal.

Each field's ``Meta`` carries its description, the version that introduced it (``x-since``) and
its sender; the JSON schemas and the spec's field tables are generated from them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta
from pydantic import Field

# Version labels used in ``x-since``: the vLLM release whose wheel first has the field. 0.16 is
# the first with these messages; 0.14 and 0.15 spoke another one (§3.8).
V016: Final = "legacy (vLLM 0.16)"
V019: Final = "legacy (vLLM 0.19)"
V024: Final = "legacy (vLLM 0.24)"
V025: Final = "legacy (vLLM 0.25)"
V030: Final = "legacy (vLLM 0.30)"
V032: Final = "legacy (vLLM 0.32)"
V033: Final = "legacy (vLLM 0.33)"
V034: Final = "legacy (vLLM 0.34)"
V2: Final = "pdwire/2"


def _doc(description: str, since: str, **extra: Any) -> Meta:
    return Meta(description=description, extra_json_schema={"x-since": since, **extra})


NonNegInt = Annotated[int, Meta(ge=0)]
BlockIds = list[list[NonNegInt]]


_FP_MODEL: Final = "Model name or path, as served."
_FP_DTYPE: Final = "KV-cache dtype, e.g. bfloat16."
_FP_LAYERS: Final = "Attention layers in the whole model."
_FP_HEADS: Final = "KV heads in the whole model, before TP sharding."
_FP_HEAD: Final = "Channels per head."
_FP_BLOCK: Final = "Tokens per KV block."
_FP_LAYOUT: Final = "Axis order of a region's KV block, as §3.6.1 registers it, e.g. LBHNC."

#: The registered values of ``Fingerprint.kv_layout`` (§3.6.1), by the name of the layout
#: (``--kv-layout``): the order of the axes of one region's block. L layer, B block, H KV head,
#: N token, 2 K and V, C channel.
KV_LAYOUT_NAMES: Final = {"apart": "LBHNC", "together": "LBHN2C", "mla": "LBNC"}


def layout_named(kv_layout: str) -> str | None:
    """The layout (``--kv-layout``) a fingerprint's ``kv_layout`` names; None if unregistered."""
    return next((k for k, v in KV_LAYOUT_NAMES.items() if v == kv_layout), None)


# A dataclass, not a Struct, so that both msgspec (side channel) and pydantic (bootstrap) use it;
# each field carries its description and bounds for both.
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """What must match between P and D for KV bytes to mean the same thing (§3.6, §9)."""

    model: Annotated[str, Meta(description=_FP_MODEL), Field(description=_FP_MODEL)]
    dtype: Annotated[str, Meta(description=_FP_DTYPE), Field(description=_FP_DTYPE)]
    num_layers: Annotated[
        int, Meta(ge=1, description=_FP_LAYERS), Field(ge=1, description=_FP_LAYERS)
    ]
    num_kv_heads: Annotated[
        int, Meta(ge=1, description=_FP_HEADS), Field(ge=1, description=_FP_HEADS)
    ]
    head_size: Annotated[int, Meta(ge=1, description=_FP_HEAD), Field(ge=1, description=_FP_HEAD)]
    block_size: Annotated[
        int, Meta(ge=1, description=_FP_BLOCK), Field(ge=1, description=_FP_BLOCK)
    ]
    kv_layout: Annotated[str, Meta(description=_FP_LAYOUT), Field(description=_FP_LAYOUT)]

    def differing_fields(self, other: Fingerprint) -> list[str]:
        """Names of the fields whose values differ, in declaration order."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


class XferResponseStatus(enum.IntEnum):
    """Status of one reply on a pull (§3.3). Travels as a plain integer."""

    FINISH = 0
    CONTINUE = 1
    ERROR = 2
    LAYOUT_MISS = 3


class ErrorCode(enum.StrEnum):
    """Machine-readable error codes (pdwire/2, §7.2). Receivers treat unknown codes as INTERNAL."""

    TP_RANK_NOT_PAIRED = "TP_RANK_NOT_PAIRED"
    PP_PACKED_ROWS = "PP_PACKED_ROWS"
    LAYOUT_MISS = "LAYOUT_MISS"
    LAYER_ALIGNMENT = "LAYER_ALIGNMENT"
    HEAD_RESHARDING = "HEAD_RESHARDING"
    REGION_LENGTH = "REGION_LENGTH"
    READY_TIMEOUT = "READY_TIMEOUT"
    KV_GROUP_COUNT_MISMATCH = "KV_GROUP_COUNT_MISMATCH"
    P_BLOCKS_LESS_THAN_D = "P_BLOCKS_LESS_THAN_D"
    ENGINE_ERROR = "ENGINE_ERROR"
    BAD_MESSAGE = "BAD_MESSAGE"
    WILL_NOT_SEND = "WILL_NOT_SEND"
    CANCELLED = "CANCELLED"
    DUPLICATE_TRANSFER_ID = "DUPLICATE_TRANSFER_ID"
    FINGERPRINT_MISMATCH = "FINGERPRINT_MISMATCH"
    MISSING_REMOTE_PP_SIZE = "MISSING_REMOTE_PP_SIZE"
    AUTH_FAILED = "AUTH_FAILED"
    EXPIRED = "EXPIRED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    INTERNAL = "INTERNAL"


class XferMetadata(msgspec.Struct, omit_defaults=True):
    """The pull: one per (D worker, P worker) pair and batch of requests, D -> P (§3.2).

    Exactly vLLM 0.33's fields; ``remote_*`` fields describe the sender, D, to P.
    """

    remote_hostname: Annotated[str, _doc("D's IP address or host name.", V016)]
    remote_port: Annotated[int, Meta(ge=1, le=65535), _doc("D's transfer-engine RPC port.", V016)]
    remote_tp_size: Annotated[int, Meta(ge=1), _doc("D's tensor-parallel world size.", V016)]
    remote_tp_rank: Annotated[int, Meta(ge=0), _doc("The sending D worker's TP rank.", V016)]
    req_blocks: Annotated[
        dict[str, tuple[str, BlockIds]],
        _doc(
            "Per D request id: (transfer_id, D's destination block ids per KV-cache group). "
            "Empty block lists mean 'nothing to load, release P'. One flat list before vLLM 0.20.",
            V016,
        ),
    ]
    kv_caches_base_addr: Annotated[
        list[NonNegInt],
        _doc("Per registered region: D's base address. Empty when the layout is omitted.", V016),
    ]
    block_lens: Annotated[
        list[NonNegInt], _doc("Per region: byte stride between consecutive blocks.", V019)
    ]
    kv_block_lens: Annotated[
        list[NonNegInt], _doc("Per region: payload bytes per block (<= stride).", V025)
    ]
    registered_layer_names: Annotated[
        list[str], _doc("Per region: layer name; names may repeat.", V024)
    ] = msgspec.field(default_factory=list)
    registered_layer_indices: Annotated[list[NonNegInt], _doc("Per region: layer index.", V024)] = (
        msgspec.field(default_factory=list)
    )
    registered_group_indices: Annotated[
        list[Annotated[int, Meta(ge=-1)]],
        _doc("Per region: KV-cache group index; -1 = packed region shared by groups.", V025),
    ] = msgspec.field(default_factory=list)
    registered_shared_group_ids: Annotated[
        list[list[NonNegInt]],
        _doc("Per region: the groups sharing it. Empty = not sent.", V032),
    ] = msgspec.field(default_factory=list)
    registered_row_offsets: Annotated[
        list[Annotated[int, Meta(ge=-1)]],
        _doc("Per region: byte offset inside its block row; -1 = not a packed-row view.", V032),
    ] = msgspec.field(default_factory=list)
    remote_pp_size: Annotated[int, Meta(ge=1), _doc("D's pipeline-parallel size.", V030)] = 1
    layout_id: Annotated[
        int,
        Meta(ge=0, le=2**63 - 1),
        _doc("D's layout id (odd 63-bit); 0 = the layout is sent on every pull.", V033),
    ] = 0


class XferMetadataV2(XferMetadata, omit_defaults=True):
    """A pull with the pdwire/2 extension fields (§3.2.2). Decoders always return this type; a
    legacy peer ignores the extra keys."""

    pdwire_version: Annotated[
        int, Meta(ge=0), _doc("Highest wire version D speaks; 0 = not announced.", V2)
    ] = 0
    pdwire_caps: Annotated[list[str], _doc("Capabilities D announces (§8.5).", V2)] = msgspec.field(
        default_factory=list
    )
    fingerprint: Annotated[
        Fingerprint | None, _doc("D's compatibility fingerprint (§3.6).", V2)
    ] = None
    deadline_ms: Annotated[
        int, Meta(ge=0), _doc("D's remaining wait budget for this pull in ms; 0 = none.", V2)
    ] = 0
    auth_key_id: Annotated[
        str | None, _doc("Id of the key auth_tag was made with (8.6-R15).", V2)
    ] = None
    auth_tag: Annotated[
        bytes | None, _doc("HMAC-SHA256 over the canonical encoding without this field.", V2)
    ] = None


class XferResponse(msgspec.Struct, omit_defaults=True):
    """One reply on a pull, P -> D (§3.4): zero or more CONTINUE then FINISH, or one ERROR or
    LAYOUT_MISS. Exactly vLLM 0.33's fields."""

    status: Annotated[XferResponseStatus, _doc("Status of this reply (§3.3).", V016)]
    ok_reqs: Annotated[
        list[str] | None, _doc("D request ids written successfully in this round.", V016)
    ] = None
    err_reqs: Annotated[list[str] | None, _doc("D request ids failed in this round.", V016)] = None
    err_msg: Annotated[str | None, _doc("Human-readable error; several joined by '; '.", V016)] = (
        None
    )
    layout_id: Annotated[
        int, Meta(ge=0, le=2**63 - 1), _doc("Echo of the pull's layout_id once P holds it.", V033)
    ] = 0


class XferResponseV2(XferResponse, omit_defaults=True):
    """A reply with the pdwire/2 extension fields (§3.4.2), sent only to a D that announced."""

    pdwire_version: Annotated[
        int, Meta(ge=0), _doc("P's wire version; only sent to a D that announced.", V2)
    ] = 0
    pdwire_caps: Annotated[list[str], _doc("Capabilities P announces (§8.5).", V2)] = msgspec.field(
        default_factory=list
    )
    err_code: Annotated[str | None, _doc("Machine-readable code of the status (§7.2).", V2)] = None
    err_codes: Annotated[
        dict[str, str] | None, _doc("Per failed D request id: its error code (§7.2).", V2)
    ] = None
    auth_key_id: Annotated[
        str | None, _doc("Id of the key auth_tag was made with (8.6-R15).", V2)
    ] = None
    auth_tag: Annotated[
        bytes | None,
        _doc(
            "HMAC-SHA256 over the canonical encoding without this field, then the auth_tag of "
            "the message answered (8.6-R13).",
            V2,
        ),
    ] = None


class XferCancel(msgspec.Struct, omit_defaults=True):
    """pdwire/2 only: D withdraws pulls, so P can stop waiting and free at once (§3.5)."""

    pdwire_version: Annotated[int, Meta(ge=2), _doc("D's wire version.", V2)]
    remote_hostname: Annotated[str, _doc("D's IP address or host name.", V2)]
    remote_port: Annotated[int, Meta(ge=1, le=65535), _doc("D's transfer-engine RPC port.", V2)]
    remote_tp_size: Annotated[int, Meta(ge=1), _doc("D's tensor-parallel world size.", V2)]
    remote_tp_rank: Annotated[int, Meta(ge=0), _doc("The sending D worker's TP rank.", V2)]
    cancel_reqs: Annotated[
        dict[str, str], _doc("Per D request id: its transfer_id, withdrawn.", V2)
    ]
    remote_pp_size: Annotated[int, Meta(ge=1), _doc("D's pipeline-parallel size.", V2)] = 1
    remote_pp_rank: Annotated[int, Meta(ge=0), _doc("The sending D worker's PP rank.", V2)] = 0
    reason: Annotated[str, _doc("Why, for logs (abort, stage will not pull, ...).", V2)] = ""
    auth_key_id: Annotated[
        str | None, _doc("Id of the key auth_tag was made with (8.6-R15).", V2)
    ] = None
    auth_tag: Annotated[
        bytes | None, _doc("HMAC-SHA256 over the canonical encoding without this field.", V2)
    ] = None


class LeaseHeartbeat(msgspec.Struct, omit_defaults=True):
    """D renews P's lease on transfers it has not pulled yet, D -> P (§3.9). Exactly vLLM 0.34's
    ``MooncakeLeaseHeartbeat``; P answers with one ``XferResponse``."""

    lease_transfer_ids: Annotated[
        list[str],
        _doc("The transfer_ids whose lease D renews; never empty on the wire.", V034),
    ] = msgspec.field(default_factory=list)


Message = XferMetadata | XferResponse | XferCancel | LeaseHeartbeat
