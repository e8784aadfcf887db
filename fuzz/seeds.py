"""The seed inputs of every target: the golden vectors of spec/vectors for the side-channel
decoders, documents like those of spec §4 and §5 for the HTTP ones, and short programs for the
sessions. ``python -m fuzz --seed`` writes them into the corpus; fuzzing grows it from there."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Final

from .runner import ROOT

VECTORS: Final = ROOT / "spec" / "vectors"

_REGISTER: Final[dict[str, Any]] = {
    "engine_id": "engine-0",
    "dp_rank": 0,
    "tp_rank": 1,
    "pp_rank": 0,
    "addr": "tcp://10.0.0.5:41234",
}
_FP: Final[dict[str, Any]] = {
    "model": "Qwen/Qwen3-8B",
    "dtype": "bfloat16",
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_size": 128,
    "block_size": 16,
    "kv_layout": "LBHNC",
}
_V2: Final[dict[str, Any]] = {"pdwire_version": 2, "pdwire_caps": ["cancel", "deadline"]}
_ENTRY: Final[dict[str, Any]] = {
    "engine_id": "engine-0",
    "worker_addr": {"0": {"0": "tcp://10.0.0.5:41234"}, "1": {"0": "tcp://[::1]:41235"}},
}
_DECODE: Final[dict[str, Any]] = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_bootstrap_addr": "http://10.0.0.5:8998",
    "remote_engine_id": "engine-0",
    "transfer_id": "xfer-d080e66e552f233a8c25166a1ff39849",
}

_DOCS: Final[dict[str, list[Any]]] = {
    "register": [
        _REGISTER,
        {**_REGISTER, **_V2, "tp_size": 2, "pp_size": 1, "fingerprint": _FP, "auth_tag": "ab"},
        {"status": "ok"},
        {"status": "ok", "pdwire_version": 2},
        {"detail": "Invalid worker address"},
    ],
    "query": [
        {"0": _ENTRY},
        {"0": {**_ENTRY, **_V2, "tp_size": 2, "pp_size": 1, "fingerprint": _FP}},
        {},
        _ENTRY,
    ],
    "kv_params": [
        {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"},
        _DECODE,
        {**_DECODE, "pdwire_version": 2, "deadline_ms": 30000},
        {"do_remote_decode": False, "do_remote_prefill": False},
        {"remote_prefill_cached_tokens": 1000, "pdwire_version": 2},
    ],
}


def _vectors(decoder: str | None) -> list[bytes]:
    out = []
    for doc_path in sorted(VECTORS.glob("*.json")):
        doc = json.loads(doc_path.read_text())
        if decoder is None or doc.get("decoder") == decoder:
            out.append(doc_path.with_suffix(".msgpack").read_bytes())
    return out


def _programs(seed: int) -> list[bytes]:
    """Short programs: every op code with arbitrary operands, and random ones."""
    rng = random.Random(seed)
    out = [bytes(range(256)), bytes(64)]
    out += [bytes(rng.randrange(256) for _ in range(rng.randrange(40, 400))) for _ in range(8)]
    return out


def seeds() -> dict[str, list[bytes]]:
    out = {kind: _vectors(kind) for kind in ("pull", "response", "cancel")}
    out["message"] = _vectors(None)
    for target, docs in _DOCS.items():
        out[target] = [json.dumps(doc).encode() for doc in docs]
    out["negotiation"] = [bytes(range(64)), bytes(16), b"\x01" * 32]
    out["producer"] = _programs(1)
    out["consumer"] = _programs(2)
    return out


def write(root: Path) -> dict[str, int]:
    """Add the seeds to ``root/<target>/``, named by content; how many each target holds now."""
    counts = {}
    for target, inputs in seeds().items():
        folder = root / target
        folder.mkdir(parents=True, exist_ok=True)
        for data in inputs:
            (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)
        counts[target] = sum(1 for _ in folder.iterdir())
    return counts
