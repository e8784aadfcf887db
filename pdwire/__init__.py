"""pdwire: the wire protocol of prefill/decode disaggregated LLM serving, as code.

Codecs for every side-channel message (legacy = vLLM 0.34's bytes; pdwire/2 = negotiated
extensions), the HTTP documents, and version negotiation. No sockets, threads or clocks.
"""

from .auth import sign, verify
from .codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    decode_cancel,
    decode_heartbeat,
    decode_message,
    decode_pull,
    decode_response,
    detect_kind,
    encode_cancel,
    encode_canonical,
    encode_heartbeat,
    encode_pull,
    encode_response,
)
from .errors import (
    DecodeError,
    LocalProtocolError,
    PdwireError,
    PeerCannotDecode,
    ProtocolError,
    RemoteProtocolError,
)
from .http_models import (
    DecodeParams,
    DecodeResultParams,
    EngineEntry,
    PrefillParams,
    QueryResponse,
    RegisterReply,
    RegisterWorkerPayload,
    decode_json,
)
from .messages import (
    ErrorCode,
    Fingerprint,
    LeaseHeartbeat,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseStatus,
    XferResponseV2,
)
from .negotiation import LEGACY_PEER, NEGOTIATION_TABLE, Agreement, Offer, negotiate
from .versions import CURRENT_VERSION, LEGACY, PDWIRE_2, Capability, Profile

__version__ = "0.1.0"

__all__ = [
    "CURRENT_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "LEGACY",
    "LEGACY_PEER",
    "NEGOTIATION_TABLE",
    "PDWIRE_2",
    "Agreement",
    "Capability",
    "DecodeError",
    "DecodeParams",
    "DecodeResultParams",
    "EngineEntry",
    "ErrorCode",
    "Fingerprint",
    "LeaseHeartbeat",
    "LocalProtocolError",
    "Offer",
    "PdwireError",
    "PeerCannotDecode",
    "PrefillParams",
    "Profile",
    "ProtocolError",
    "QueryResponse",
    "RegisterReply",
    "RegisterWorkerPayload",
    "RemoteProtocolError",
    "XferCancel",
    "XferMetadata",
    "XferMetadataV2",
    "XferResponse",
    "XferResponseStatus",
    "XferResponseV2",
    "decode_cancel",
    "decode_heartbeat",
    "decode_json",
    "decode_message",
    "decode_pull",
    "decode_response",
    "detect_kind",
    "encode_cancel",
    "encode_canonical",
    "encode_heartbeat",
    "encode_pull",
    "encode_response",
    "negotiate",
    "sign",
    "verify",
]
