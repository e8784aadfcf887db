"""Every ``err_msg`` string P sends and every bootstrap error detail (spec §4.1, §7.1, §7.2),
with the placeholders the spec names. Legacy strings are vLLM 0.34's, verbatim: deployed D's and
log scrapers match on them."""

from typing import Final

# -- legacy (§7.1) ------------------------------------------------------------------------------
TP_RANK_NOT_PAIRED: Final = (
    "This D tp_rank {d_tp_rank} is not paired with P tp_rank {p_tp_rank}; "
    "expected one of {expected}."
)
PP_PACKED_ROWS: Final = (
    "Mooncake non-page-contiguous packed regions keep only the first layer name, so they cannot "
    "be aligned across PP sizes {p_pp_size} and {d_pp_size}."
)
LAYOUT_NOT_CACHED: Final = (
    "Mooncake KV layout {layout_id:#x} from {remote_hostname}:{remote_port} is not cached."
)
NO_MATCHING_OCCURRENCE: Final = (
    "Mooncake producer registered layer has no matching consumer occurrence: "
    "{layer_name} occurrence {occurrence}."
)
LAYER_INDEX_MISMATCH: Final = (
    "Mooncake registered layer index mismatch for {layer_name}: "
    "producer={producer}, consumer={consumer}."
)
GROUP_INDEX_MISMATCH: Final = (
    "Mooncake registered group index mismatch for {layer_name}: "
    "producer={producer}, consumer={consumer}."
)
SHARED_GROUP_MISMATCH: Final = (
    "Mooncake shared-group set mismatch for {layer_name}: producer={producer}, consumer={consumer}."
)
SHARED_GROUP_METADATA: Final = (
    "Mooncake shared-group metadata does not match registered layers, so a shared packed region "
    "cannot be transferred."
)
RESHARD_PADDED: Final = (
    "Mooncake KV-head re-sharding is not supported for padded KV pages (layer {layer_name})."
)
RESHARD_NVFP4: Final = "Mooncake KV-head re-sharding is not supported for NVFP4 KV cache."
ASYMMETRIC_REGION_COUNT: Final = (
    "Mooncake asymmetric TP requires matching KV region counts between producer and consumer."
)
REGION_LENGTH_HOMOGENEOUS: Final = (
    "Mooncake KV region length mismatch for homogeneous TP at region {i}: "
    "local={local}, remote={remote}."
)
REGION_LENGTH_PRODUCER_RATIO: Final = (
    "Mooncake destination KV region length does not match the producer TP ratio at region {i}: "
    "local={local}, remote={remote}, tp_ratio={tp_ratio}."
)
REGION_LENGTH_CONSUMER_RATIO: Final = (
    "Mooncake source KV region length does not match the consumer TP ratio at region {i}: "
    "local={local}, remote={remote}, tp_ratio={tp_ratio}."
)
# vLLM's assertion texts for TP sizes that do not divide (10.1.1), from the side that checks.
TP_LOCAL_NOT_DIVISIBLE: Final = (
    "Local tensor parallel size {local_tp} is not divisible by remote tensor parallel size "
    "{remote_tp}."
)
TP_REMOTE_NOT_DIVISIBLE: Final = (
    "Remote tensor parallel size {remote_tp} is not divisible by local tensor parallel size "
    "{local_tp}."
)
READY_TIMEOUT: Final = "Timeout waiting for P side ready."
KV_GROUP_COUNT_MISMATCH: Final = "KV group count mismatch"
P_BLOCKS_LESS_THAN_D: Final = "P num blocks less than D"
ENGINE_RETURNED: Final = "Mooncake transfer engine returned {ret}"
# vLLM 0.34: a pull for a transfer P expired, and a renewal sent to a P without a lease (§3.9).
EXPIRED: Final = "KV expired on P side before the pull."
LEASE_NOT_SET: Final = "kv_lease_duration is not set on this prefill instance."
# vLLM 0.34's refusal of a lease that is not positive, at start-up (§6.4).
LEASE_NOT_POSITIVE: Final = "kv_lease_duration must be positive, got {duration}."

# -- pdwire/2 (§7.2); WILL_NOT_SEND also goes to legacy D's, with FINISH and err_reqs -----------
WILL_NOT_SEND: Final = "Prefill will not send KV for this request."
CANCELLED: Final = "Request cancelled by the consumer."
DEADLINE_EXCEEDED: Final = "Consumer deadline exceeded."
DUPLICATE_TRANSFER_ID: Final = "Duplicate transfer_id {transfer_id}."
FINGERPRINT_MISMATCH: Final = "Compatibility fingerprint mismatch in {fields}."
MISSING_REMOTE_PP_SIZE: Final = (
    "Consumer registered {registered} of {total} layers but sent no remote_pp_size."
)
AUTH_FAILED: Final = "auth_tag missing or invalid."
LIMIT_EXCEEDED: Final = "Limit exceeded: {limit} allows {maximum}, got {value}."

# -- bootstrap /register, HTTP 400 (§4.1) ---------------------------------------------------------
ENGINE_ID_MISMATCH: Final = (
    "Engine ID mismatch for dp_rank={dp_rank}: expected {registered_engine_id}, got {engine_id}"
)
WORKER_ALREADY_REGISTERED: Final = (
    "Worker with dp_rank={dp_rank}, tp_rank={tp_rank}, pp_rank={pp_rank} is already registered "
    "at {registered_addr}, but still want to register at {addr}"
)

# -- a P worker that could not register (4.4-R5) ---------------------------------------------------
REGISTRATION_FAILED: Final = (
    "Failed to register {payload} with the Mooncake bootstrap server at {url} after "
    "{attempts} attempts."
)

# -- configuration of where P workers register (4.4-R12) -------------------------------------------
BOOTSTRAP_ADDRESS_INVALID: Final = "bootstrap_server_address must specify a host and port"
