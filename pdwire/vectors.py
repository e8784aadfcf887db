"""Golden wire vectors: every message, status and profile, each older variant, and malformed
inputs with the error they must raise. They ship inside the package (``pdwire/data/vectors/``,
which ``spec/vectors`` links to), so an installed pdwire can check itself or another
implementation's copy.

Each vector is a ``NAME.msgpack`` file of exact bytes beside a ``NAME.json`` file that says which
decoder reads it and what must come out: the decoded message (as msgspec builtins; bytes in
base64) or the error's path and section. ``profile`` is set when encoding the decoded message
under that profile must give back the very same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from . import error_strings as msgs
from .auth import sign, verify
from .codec import (
    DECODERS,
    decode_pull,
    encode_cancel,
    encode_heartbeat,
    encode_pull,
    encode_response,
)
from .errors import DecodeError, RemoteProtocolError
from .legacy import older_variants
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
from .versions import LEGACY, PDWIRE_2, Capability, Profile

Decoder = Literal["pull", "response", "cancel", "heartbeat"]
ENCODERS: Final[dict[str, Callable[..., bytes]]] = {
    "pull": encode_pull,
    "response": encode_response,
    "cancel": encode_cancel,
    "heartbeat": encode_heartbeat,
}
#: The shared key of the signed vectors (§8.6).
AUTH_KEY: Final = b"pdwire-golden-vector-key"

#: The seeds' model: Qwen3-8B, 36 layers, 8 KV heads, head size 128, bf16, 16-token blocks.
SEED_FINGERPRINT: Final = Fingerprint(
    model="Qwen/Qwen3-8B",
    dtype="bfloat16",
    num_layers=36,
    num_kv_heads=8,
    head_size=128,
    block_size=16,
    kv_layout="LBHNC",
)
SEED_BLOCK_BYTES: Final = 16 * 8 * 128 * 2  # one layer's K (or V) of one block, TP=1


@dataclasses.dataclass(frozen=True)
class Vector:
    name: str
    decoder: Decoder
    description: str
    data: bytes
    profile: Profile | None = None
    message: Any = None
    error: dict[str, str] | None = None
    max_size: int | None = None
    signed: bool = False
    answers: bytes = b""  # a signed reply: the auth_tag of the message it answers (8.6-R13)

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "decoder": self.decoder,
            "description": self.description,
        }
        if self.profile:
            doc["profile"] = self.profile
        if self.max_size is not None:
            doc["max_size"] = self.max_size
        if self.signed:
            doc["auth_key_hex"] = AUTH_KEY.hex()
        if self.answers:
            doc["answers_tag_hex"] = self.answers.hex()
        if self.error is not None:
            doc["error"] = self.error
        else:
            doc["message"] = as_json(self.message)
            if self.decoder == "pull":
                doc["older_variants"] = older_variants(msgspec.msgpack.decode(self.data))
        return doc


def as_json(msg: Any) -> Any:
    """``msg`` as the JSON value the vector files hold (tuples as arrays, bytes in base64)."""
    return msgspec.json.decode(msgspec.json.encode(msg))


def seed_pull(num_requests: int = 1, blocks_per_request: int = 63, seed: int = 0) -> XferMetadata:
    """The seeds' pull (1P1D, TP=1, 36 layers x K/V = 72 regions), ``num_requests`` requests of
    ``blocks_per_request`` blocks each, block ids drawn from a 20000-block pool."""
    rng = random.Random(seed)
    layers = 36
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers) for _ in "KV"]
    pool = rng.sample(range(20_000), num_requests * blocks_per_request)
    req_blocks = {
        f"cmpl-{rng.getrandbits(64):016x}-0": (
            f"xfer-{rng.getrandbits(128):032x}",
            [pool[r * blocks_per_request : (r + 1) * blocks_per_request]],
        )
        for r in range(num_requests)
    }
    region_bytes = 20_000 * SEED_BLOCK_BYTES
    return XferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=15432,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks=req_blocks,
        kv_caches_base_addr=[0x7F00_0000_0000 + i * region_bytes for i in range(2 * layers)],
        block_lens=[SEED_BLOCK_BYTES] * (2 * layers),
        kv_block_lens=[SEED_BLOCK_BYTES] * (2 * layers),
        registered_layer_names=names,
        registered_layer_indices=[i for i in range(layers) for _ in "KV"],
        registered_group_indices=[0] * (2 * layers),
        registered_shared_group_ids=[[0]] * (2 * layers),
        registered_row_offsets=[0] * (2 * layers),
    )


def _small_pull(**changes: Any) -> XferMetadata:
    base = XferMetadata(
        remote_hostname="127.0.0.1",
        remote_port=15432,
        remote_tp_size=1,
        remote_tp_rank=0,
        req_blocks={"cmpl-1-0": ("xfer-1", [[4, 5, 6]])},
        kv_caches_base_addr=[0x7F00_0000_0000, 0x7F00_1000_0000],
        block_lens=[32768, 32768],
        kv_block_lens=[32768, 32768],
        registered_layer_names=["model.layers.0.self_attn.attn"] * 2,
        registered_layer_indices=[0, 0],
        registered_group_indices=[0, 0],
        registered_shared_group_ids=[[0], [0]],
        registered_row_offsets=[0, 0],
    )
    return msgspec.structs.replace(base, **changes)


def _v2(msg: XferMetadata, **extensions: Any) -> XferMetadataV2:
    return XferMetadataV2(*msgspec.structs.astuple(msg), **extensions)


def _announce_pull(**changes: Any) -> XferMetadataV2:
    return _v2(
        _small_pull(**changes),
        pdwire_version=2,
        pdwire_caps=sorted(c.value for c in Capability),
        fingerprint=SEED_FINGERPRINT,
        deadline_ms=30_000,
    )


def _valid(
    name: str,
    decoder: Decoder,
    description: str,
    msg: Any,
    profile: Profile,
    signed: bool = False,
    answers: bytes = b"",
) -> Vector:
    if signed:
        msg = sign(msg, AUTH_KEY, answers)
    data = ENCODERS[decoder](msg, profile)
    message = DECODERS[decoder](data)
    return Vector(
        name, decoder, description, data, profile, message, signed=signed, answers=answers
    )


def _signed_pull() -> XferMetadataV2:
    """A pull of two requests whose ids are not in sorted order on the wire: its tag covers
    them sorted (8.6-R2)."""
    two = {"cmpl-2-0": ("xfer-2", [[7, 8]]), "cmpl-1-0": ("xfer-1", [[4, 5, 6]])}
    return sign(_announce_pull(req_blocks=two), AUTH_KEY)


def _older(name: str, description: str, obj: dict[str, Any]) -> Vector:
    data = msgspec.msgpack.encode(obj)
    return Vector(name, "pull", description, data, None, decode_pull(data))


def _bad(
    name: str, decoder: Decoder, description: str, data: bytes, max_size: int | None = None
) -> Vector:
    try:
        DECODERS[decoder](data, **({} if max_size is None else {"max_size": max_size}))
    except DecodeError as exc:
        error = {"path": exc.path, "section": exc.section, "message": exc.message}
    else:  # pragma: no cover - a vector that decodes is a bug in this table
        raise AssertionError(f"malformed vector {name} decodes")
    return Vector(name, decoder, description, data, None, None, error, max_size)


def _builtins(msg: msgspec.Struct) -> dict[str, Any]:
    out = msgspec.to_builtins(msg)
    assert isinstance(out, dict)
    return out


def _pull_vectors() -> list[Vector]:
    oldest = _builtins(_small_pull())
    for key in ("block_lens", "kv_block_lens", *(k for k in oldest if "registered" in k)):
        oldest.pop(key, None)
    oldest["req_blocks"] = {"cmpl-1-0": ["xfer-1", [4, 5, 6]]}
    no_lens = _builtins(_small_pull())
    del no_lens["block_lens"], no_lens["kv_block_lens"]
    no_meta = {k: v for k, v in _builtins(_small_pull()).items() if "registered" not in k}
    return [
        _valid(
            "pull-legacy-seed",
            "pull",
            "The seeds' 1P1D Qwen3-8B pull: 63 blocks, 72 regions.",
            seed_pull(),
            LEGACY,
        ),
        _valid(
            "pull-legacy-minimal",
            "pull",
            "One request, one group, two regions.",
            _small_pull(),
            LEGACY,
        ),
        _valid(
            "pull-legacy-release-only",
            "pull",
            "D had a full prefix hit: no blocks to load, P may release.",
            _small_pull(req_blocks={"cmpl-1-0": ("xfer-1", [[]])}),
            LEGACY,
        ),
        _valid(
            "pull-legacy-layout-omitted",
            "pull",
            "vLLM 0.33: P acknowledged layout_id, so D omits its layout.",
            _small_pull(
                kv_caches_base_addr=[],
                block_lens=[],
                kv_block_lens=[],
                registered_layer_names=[],
                registered_layer_indices=[],
                registered_group_indices=[],
                registered_shared_group_ids=[],
                registered_row_offsets=[],
                layout_id=0x2F3A_51C7_0000_0001,
            ),
            LEGACY,
        ),
        _valid(
            "pull-legacy-layout-announced",
            "pull",
            "vLLM 0.33: first pull of a new layout, sent with its layout_id.",
            _small_pull(layout_id=0x2F3A_51C7_0000_0001),
            LEGACY,
        ),
        _valid(
            "pull-legacy-tp2-rank1-pp2",
            "pull",
            "D TP rank 1 of 2, PP size 2, two requests.",
            _small_pull(
                remote_tp_size=2,
                remote_tp_rank=1,
                remote_pp_size=2,
                req_blocks={"cmpl-1-0": ("xfer-1", [[4, 5]]), "cmpl-2-0": ("xfer-2", [[9]])},
            ),
            LEGACY,
        ),
        _valid(
            "pull-legacy-hma-shared-region",
            "pull",
            "Two KV-cache groups; the second region is packed and shared (-1).",
            _small_pull(
                req_blocks={"cmpl-1-0": ("xfer-1", [[4, 5], [7]])},
                registered_group_indices=[0, -1],
                registered_shared_group_ids=[[0], [0, 1]],
                registered_row_offsets=[0, -1],
            ),
            LEGACY,
        ),
        _valid(
            "pull-pdwire2-announce",
            "pull",
            "pdwire/2 D announces version, capabilities, fingerprint and deadline.",
            _announce_pull(),
            PDWIRE_2,
        ),
        _valid(
            "pull-pdwire2-signed",
            "pull",
            "pdwire/2 pull with an auth_tag (§8.6), its requests not in sorted order: the tag "
            "covers them sorted.",
            _signed_pull(),
            PDWIRE_2,
            signed=True,
        ),
        _valid(
            "pull-pdwire2-as-legacy",
            "pull",
            "A pdwire/2 pull encoded for a legacy P: every extension left out.",
            _announce_pull(),
            LEGACY,
        ),
        _older(
            "pull-older-flat-blocks",
            "vLLM 0.16 to 0.18: flat block lists, no lens, no layer metadata.",
            oldest,
        ),
        _older("pull-older-no-block-lens", "No block_lens or kv_block_lens.", no_lens),
        _valid(
            "pull-older-no-layer-metadata",
            "pull",
            "No registered_* lists.",
            XferMetadata(**no_meta),
            LEGACY,
        ),
    ]


def _response_vectors() -> list[Vector]:
    S = XferResponseStatus
    r = XferResponse
    v2 = XferResponseV2
    return [
        _valid(
            "response-legacy-finish",
            "response",
            "Every request written.",
            r(S.FINISH, ok_reqs=["cmpl-1-0"]),
            LEGACY,
        ),
        _valid(
            "response-legacy-continue",
            "response",
            "Some written, more rounds follow.",
            r(S.CONTINUE, ok_reqs=["cmpl-1-0"]),
            LEGACY,
        ),
        _valid(
            "response-legacy-finish-mixed",
            "response",
            "One written, one failed.",
            r(
                S.FINISH,
                ok_reqs=["cmpl-1-0"],
                err_reqs=["cmpl-2-0"],
                err_msg=msgs.P_BLOCKS_LESS_THAN_D,
            ),
            LEGACY,
        ),
        _valid(
            "response-legacy-ready-timeout",
            "response",
            "P's ready wait expired: FINISH with err_reqs, not ERROR.",
            r(S.FINISH, err_reqs=["cmpl-1-0"], err_msg=msgs.READY_TIMEOUT),
            LEGACY,
        ),
        _valid(
            "response-legacy-error",
            "response",
            "The whole pull failed.",
            r(
                S.ERROR,
                err_msg=msgs.TP_RANK_NOT_PAIRED.format(d_tp_rank=3, p_tp_rank=0, expected=[0, 1]),
            ),
            LEGACY,
        ),
        _valid(
            "response-legacy-layout-miss",
            "response",
            "P has no cached layout for the id.",
            r(
                S.LAYOUT_MISS,
                err_msg=msgs.LAYOUT_NOT_CACHED.format(
                    layout_id=0x2F3A_51C7_0000_0001, remote_hostname="127.0.0.1", remote_port=15432
                ),
            ),
            LEGACY,
        ),
        _valid(
            "response-legacy-layout-ack",
            "response",
            "FINISH echoing the layout_id.",
            r(S.FINISH, ok_reqs=["cmpl-1-0"], layout_id=0x2F3A_51C7_0000_0001),
            LEGACY,
        ),
        _valid(
            "response-legacy-will-not-send",
            "response",
            "P will not send (stop token as the only prefill token), told to a legacy D.",
            v2(
                S.FINISH,
                err_reqs=["cmpl-1-0"],
                err_msg=msgs.WILL_NOT_SEND,
                err_codes={"cmpl-1-0": ErrorCode.WILL_NOT_SEND},
            ),
            LEGACY,
        ),
        _valid(
            "response-pdwire2-will-not-send",
            "response",
            "The same answer to a pdwire/2 D, with its code.",
            v2(
                S.FINISH,
                err_reqs=["cmpl-1-0"],
                err_msg=msgs.WILL_NOT_SEND,
                pdwire_version=2,
                pdwire_caps=["cancel", "will-not-send"],
                err_codes={"cmpl-1-0": ErrorCode.WILL_NOT_SEND},
            ),
            PDWIRE_2,
        ),
        _valid(
            "response-pdwire2-fingerprint-mismatch",
            "response",
            "First pull with an incompatible fingerprint.",
            v2(
                S.ERROR,
                err_msg=msgs.FINGERPRINT_MISMATCH.format(fields="dtype, block_size"),
                pdwire_version=2,
                err_code=ErrorCode.FINGERPRINT_MISMATCH,
            ),
            PDWIRE_2,
        ),
        _valid(
            "response-pdwire2-cancelled",
            "response",
            "P's answer to an XferCancel.",
            v2(S.FINISH, ok_reqs=["cmpl-1-0"], pdwire_version=2),
            PDWIRE_2,
        ),
        _valid(
            "response-pdwire2-signed",
            "response",
            "pdwire/2 reply with an auth_tag, to the pull of pull-pdwire2-signed (8.6-R13).",
            v2(S.FINISH, ok_reqs=["cmpl-2-0", "cmpl-1-0"], pdwire_version=2),
            PDWIRE_2,
            signed=True,
            answers=_signed_pull().auth_tag or b"",
        ),
    ]


def _cancel_vectors() -> list[Vector]:
    cancel = XferCancel(
        pdwire_version=2,
        remote_hostname="127.0.0.1",
        remote_port=15432,
        remote_tp_size=2,
        remote_tp_rank=1,
        cancel_reqs={"cmpl-1-0": "xfer-1"},
        remote_pp_size=2,
        remote_pp_rank=1,
        reason="aborted by client",
    )
    return [
        _valid("cancel-pdwire2", "cancel", "D withdraws one pull.", cancel, PDWIRE_2),
        _valid(
            "cancel-pdwire2-signed", "cancel", "The same, signed.", cancel, PDWIRE_2, signed=True
        ),
    ]


def _heartbeat_vectors() -> list[Vector]:
    r, S = XferResponse, XferResponseStatus
    return [
        _valid(
            "heartbeat-vllm034",
            "heartbeat",
            "vLLM 0.34: D renews P's lease on two transfers it has not pulled yet.",
            LeaseHeartbeat(lease_transfer_ids=["xfer-1", "xfer-2"]),
            LEGACY,
        ),
        _valid(
            "response-legacy-lease-renewed",
            "response",
            "vLLM 0.34: P's answer to a heartbeat.",
            r(S.FINISH),
            LEGACY,
        ),
        _valid(
            "response-legacy-lease-not-set",
            "response",
            "vLLM 0.34: the answer of a P without kv_lease_duration to a heartbeat.",
            r(S.ERROR, err_msg=msgs.LEASE_NOT_SET),
            LEGACY,
        ),
        _valid(
            "response-legacy-expired",
            "response",
            "vLLM 0.34: a pull for a transfer whose lease (or retention) already ended.",
            r(
                S.FINISH,
                err_reqs=["cmpl-1-0"],
                err_msg=msgs.EXPIRED,
                layout_id=0x2F3A_51C7_0000_0001,
            ),
            LEGACY,
        ),
    ]


def _malformed_vectors() -> list[Vector]:
    enc = msgspec.msgpack.encode
    good = encode_pull(_small_pull())
    pull = _builtins(_small_pull())
    return [
        _bad("bad-empty", "pull", "No bytes at all.", b""),
        _bad("bad-truncated", "pull", "A valid pull cut in half.", good[: len(good) // 2]),
        _bad(
            "bad-trailing-bytes", "pull", "A valid pull followed by one more byte.", good + b"\x00"
        ),
        _bad("bad-not-a-map", "pull", "An array instead of a map.", enc([1, 2, 3])),
        _bad(
            "bad-missing-field",
            "pull",
            "remote_hostname missing.",
            enc({k: v for k, v in pull.items() if k != "remote_hostname"}),
        ),
        _bad(
            "bad-wrong-type",
            "pull",
            "remote_port is a string.",
            enc({**pull, "remote_port": "15432"}),
        ),
        _bad(
            "bad-negative-block",
            "pull",
            "A block id below zero.",
            enc({**pull, "req_blocks": {"cmpl-1-0": ["xfer-1", [[-1]]]}}),
        ),
        _bad(
            "bad-tp-rank",
            "pull",
            "remote_tp_rank not below remote_tp_size.",
            enc({**pull, "remote_tp_rank": 1}),
        ),
        _bad(
            "bad-region-lists",
            "pull",
            "block_lens shorter than kv_caches_base_addr.",
            enc({**pull, "block_lens": [32768]}),
        ),
        _bad("bad-nesting-bomb", "pull", "20000 nested arrays.", b"\x91" * 20_000),
        _bad("bad-oversize", "pull", "A valid pull over a 64-byte limit.", good, max_size=64),
        _bad("bad-unknown-status", "response", "Status 4 does not exist.", enc({"status": 4})),
        _bad(
            "bad-error-with-ok",
            "response",
            "ERROR carrying ok_reqs.",
            enc({"status": 2, "ok_reqs": ["cmpl-1-0"]}),
        ),
        _bad(
            "bad-codes-without-err",
            "response",
            "err_codes for a request not in err_reqs.",
            enc({"status": 0, "err_codes": {"cmpl-1-0": "WILL_NOT_SEND"}}),
        ),
        _bad(
            "bad-heartbeat-empty",
            "heartbeat",
            "A heartbeat naming no transfer (vLLM 0.34 takes it for a pull).",
            enc({"lease_transfer_ids": []}),
        ),
        _bad(
            "bad-heartbeat-id-type",
            "heartbeat",
            "A transfer_id that is not a string.",
            enc({"lease_transfer_ids": [7]}),
        ),
        _bad(
            "bad-cancel-version",
            "cancel",
            "A cancel claiming wire version 1.",
            enc(
                {
                    "pdwire_version": 1,
                    "remote_hostname": "h",
                    "remote_port": 1,
                    "remote_tp_size": 1,
                    "remote_tp_rank": 0,
                    "cancel_reqs": {},
                }
            ),
        ),
    ]


def all_vectors() -> list[Vector]:
    return [
        *_pull_vectors(),
        *_response_vectors(),
        *_cancel_vectors(),
        *_heartbeat_vectors(),
        *_malformed_vectors(),
    ]


def write(directory: Path) -> list[Path]:
    """Write every vector's two files into ``directory``; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for v in all_vectors():
        for suffix, content in ((".msgpack", v.data), (".json", _render(v.document()))):
            path = directory / f"{v.name}{suffix}"
            path.write_bytes(content)
            written.append(path)
    return written


def _render(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()


@dataclasses.dataclass(frozen=True)
class Outcome:
    name: str
    ok: bool
    detail: str
    message: Any = None  # the decoded message as JSON, when it decoded


def packaged() -> Traversable:
    """The directory of the vectors that ship with pdwire."""
    return files("pdwire") / "data" / "vectors"


def check(directory: Traversable) -> list[Outcome]:
    """Decode every vector in ``directory`` and compare with its expectation."""
    if not directory.is_dir():
        return []
    outcomes = []
    docs = [e for e in directory.iterdir() if e.name.endswith(".json")]
    for doc_path in sorted(docs, key=lambda e: e.name):
        doc = json.loads(doc_path.read_text())
        data = directory.joinpath(doc_path.name.removesuffix(".json") + ".msgpack").read_bytes()
        ok, detail, message = _check_one(doc, data)
        outcomes.append(Outcome(doc["name"], ok, detail, message))
    return outcomes


def _check_one(doc: dict[str, Any], data: bytes) -> tuple[bool, str, Any]:
    decoder = DECODERS[doc["decoder"]]
    kwargs = {"max_size": doc["max_size"]} if "max_size" in doc else {}
    try:
        msg = decoder(data, **kwargs)
    except DecodeError as exc:
        want = doc.get("error")
        if want and (exc.path, exc.section) == (want["path"], want["section"]):
            return True, f"rejected as expected: {exc}", None
        return False, f"unexpected error: {exc}", None
    got = as_json(msg)
    if "error" in doc:
        return False, "decoded, but must be rejected", got
    if got != doc["message"]:
        return False, "decoded message differs from the expected JSON", got
    if "auth_key_hex" in doc:
        try:
            answers = bytes.fromhex(doc.get("answers_tag_hex", ""))
            verify(msg, bytes.fromhex(doc["auth_key_hex"]), answers)
        except RemoteProtocolError as exc:
            return False, str(exc), got
    if "profile" in doc and ENCODERS[doc["decoder"]](msg, doc["profile"]) != data:
        return False, f"re-encoding under {doc['profile']} changes the bytes", got
    exact = ", bytes re-encode exactly" if "profile" in doc else ""
    return True, f"{doc['decoder']} decoded{exact}", got
