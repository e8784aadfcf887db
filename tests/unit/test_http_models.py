"""The HTTP documents (spec §4, §5): vLLM's exact keys in legacy use, JSON round trips, and the
worker address rule of /register."""

from __future__ import annotations

import json
from typing import Any

import pytest

import pdwire
from pdwire import (
    DecodeError,
    DecodeParams,
    DecodeResultParams,
    EngineEntry,
    Fingerprint,
    PrefillParams,
    QueryResponse,
    RegisterReply,
    RegisterWorkerPayload,
)
from pdwire.http_models import RegisterError, parse_prefill

FINGERPRINT = Fingerprint(
    model="Qwen/Qwen3-8B",
    dtype="bfloat16",
    num_layers=36,
    num_kv_heads=8,
    head_size=128,
    block_size=16,
    kv_layout="NHD",
)
WORKER_ADDR = {0: {0: "tcp://10.0.0.5:41234", 1: "tcp://10.0.0.5:41235"}, 1: {0: "tcp://h:1"}}

Document = (
    RegisterWorkerPayload
    | RegisterReply
    | RegisterError
    | EngineEntry
    | PrefillParams
    | DecodeParams
    | DecodeResultParams
)

#: name -> (legacy instance, vLLM's keys for it, an instance with every pdwire/2 field set)
MODELS: dict[str, tuple[Document, set[str], Document]] = {
    "register": (
        RegisterWorkerPayload(
            engine_id="engine-0", dp_rank=1, tp_rank=2, pp_rank=0, addr="tcp://10.0.0.5:41234"
        ),
        {"engine_id", "dp_rank", "tp_rank", "pp_rank", "addr"},
        RegisterWorkerPayload(
            engine_id="engine-0",
            dp_rank=1,
            tp_rank=2,
            pp_rank=0,
            addr="tcp://10.0.0.5:41234",
            pdwire_version=2,
            pdwire_caps=["cancel", "auth"],
            tp_size=4,
            pp_size=1,
            fingerprint=FINGERPRINT,
            auth_tag="ab" * 32,
        ),
    ),
    "register-reply": (RegisterReply(), {"status"}, RegisterReply(pdwire_version=2)),
    "register-error": (
        RegisterError(detail="Engine ID mismatch for dp_rank=0: expected a, got b"),
        {"detail"},
        RegisterError(detail="Engine ID mismatch for dp_rank=0: expected a, got b"),
    ),
    "engine-entry": (
        EngineEntry(engine_id="engine-0", worker_addr=WORKER_ADDR),
        {"engine_id", "worker_addr"},
        EngineEntry(
            engine_id="engine-0",
            worker_addr=WORKER_ADDR,
            pdwire_version=2,
            pdwire_caps=["cancel"],
            tp_size=2,
            pp_size=2,
            fingerprint=FINGERPRINT,
        ),
    ),
    "prefill-params": (
        PrefillParams(transfer_id="xfer-1"),
        {"do_remote_decode", "do_remote_prefill", "transfer_id"},
        PrefillParams(transfer_id="xfer-1", pdwire_version=2),
    ),
    "decode-params": (
        DecodeParams(
            remote_bootstrap_addr="http://10.0.0.5:8998",
            remote_engine_id="engine-0",
            transfer_id="xfer-1",
        ),
        {
            "do_remote_decode",
            "do_remote_prefill",
            "remote_bootstrap_addr",
            "remote_engine_id",
            "transfer_id",
        },
        DecodeParams(
            remote_bootstrap_addr="http://10.0.0.5:8998",
            remote_engine_id="engine-0",
            transfer_id="xfer-1",
            pdwire_version=2,
            deadline_ms=30_000,
        ),
    ),
    "decode-result-params": (
        DecodeResultParams(
            do_remote_decode=False, do_remote_prefill=False, remote_prefill_cached_tokens=64
        ),
        {"do_remote_decode", "do_remote_prefill", "remote_prefill_cached_tokens"},
        DecodeResultParams(
            do_remote_decode=False,
            do_remote_prefill=False,
            remote_prefill_cached_tokens=64,
            pdwire_version=2,
        ),
    ),
}


@pytest.mark.parametrize(
    ("legacy", "keys"), [(m[0], m[1]) for m in MODELS.values()], ids=list(MODELS)
)
def test_legacy_dump_has_exactly_vllm_keys(legacy: Document, keys: set[str]) -> None:
    assert set(legacy.dump()) == keys


@pytest.mark.parametrize(("legacy", "keys", "full"), list(MODELS.values()), ids=list(MODELS))
def test_pdwire2_fields_travel_when_set(legacy: Document, keys: set[str], full: Document) -> None:
    dumped = full.dump()
    assert set(dumped) >= keys
    extensions = set(dumped) - keys
    assert extensions == {name for name in type(full).model_fields if name not in keys} & {
        name for name, value in full if value is not None
    }


def test_legacy_decode_result_may_be_empty() -> None:
    """P's response carries null and D's may carry nothing of ours: no key is invented."""
    assert DecodeResultParams().dump() == {}


@pytest.mark.parametrize("which", ["legacy", "full"])
@pytest.mark.parametrize("name", list(MODELS))
def test_decode_json_round_trip(name: str, which: str) -> None:
    legacy, _, full = MODELS[name]
    model = legacy if which == "legacy" else full
    doc = model.dump()
    for data in (json.dumps(doc), json.dumps(doc).encode(), doc):
        assert pdwire.decode_json(type(model), data) == model


def _query(entries: dict[int, EngineEntry]) -> QueryResponse:
    return QueryResponse(entries)


def test_query_keys_are_strings_in_json_and_ints_in_the_model() -> None:
    legacy_entry, _, full_entry = MODELS["engine-entry"]
    assert isinstance(legacy_entry, EngineEntry)
    assert isinstance(full_entry, EngineEntry)
    query = _query({0: legacy_entry, 3: full_entry})
    doc = query.dump()
    text = json.dumps(doc)
    assert list(json.loads(text)) == ["0", "3"]
    assert list(json.loads(text)["0"]["worker_addr"]) == ["0", "1"]
    assert list(json.loads(text)["0"]["worker_addr"]["0"]) == ["0", "1"]
    assert json.loads(text)["0"] == {
        "engine_id": "engine-0",
        "worker_addr": {
            "0": {"0": "tcp://10.0.0.5:41234", "1": "tcp://10.0.0.5:41235"},
            "1": {"0": "tcp://h:1"},
        },
    }
    decoded = pdwire.decode_json(QueryResponse, text)
    assert decoded == query
    assert pdwire.decode_json(QueryResponse, doc) == query
    assert pdwire.decode_json(QueryResponse, text.encode()) == query
    assert list(decoded.root) == [0, 3]
    assert all(type(k) is int for k in decoded.root[0].worker_addr)
    assert all(type(k) is int for k in decoded.root[0].worker_addr[0])


def test_empty_query_round_trips() -> None:
    assert pdwire.decode_json(QueryResponse, b"{}") == _query({})
    assert _query({}).dump() == {}


def test_unknown_keys_are_ignored() -> None:
    legacy, _, _ = MODELS["register"]
    doc = {**legacy.dump(), "future_field": [1, 2], "pdwire_v9_thing": {"x": 1}}
    assert pdwire.decode_json(RegisterWorkerPayload, doc) == legacy


# -- the addr rule (§4.1) -----------------------------------------------------------------------

GOOD_ADDRS = [
    "tcp://10.0.0.5:41234",
    "tcp://[::1]:5555",
    "tcp://host-name:1",
    "tcp://p-0.cluster.local:65535",
    "tcp://[fe80::1:2]:80",
]
BAD_ADDRS = [
    "http://x:1",
    "tcp://x",
    "tcp://x:0",
    "tcp://x:70000",
    "tcp://x:65536",
    "",
    "tcp://:1",
    "tcp://x:",
    "tcp://x:1/path",
    " tcp://x:1",
    "tcp://x:1 ",
    "tcp://x:-1",
    "ipc:///tmp/sock",
    "tcp://[zz]:1",
]


def _register(addr: str) -> dict[str, Any]:
    return {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr}


@pytest.mark.parametrize("addr", GOOD_ADDRS)
def test_addr_rule_accepts(addr: str) -> None:
    assert pdwire.decode_json(RegisterWorkerPayload, _register(addr)).addr == addr


@pytest.mark.parametrize("addr", BAD_ADDRS)
def test_addr_rule_rejects(addr: str) -> None:
    with pytest.raises(DecodeError) as info:
        pdwire.decode_json(RegisterWorkerPayload, _register(addr))
    assert (info.value.path, info.value.section) == ("$.addr", "4.1")


def test_addr_rule_rejects_a_trailing_newline() -> None:
    with pytest.raises(DecodeError):
        pdwire.decode_json(RegisterWorkerPayload, _register("tcp://x:1\n"))


@pytest.mark.parametrize(
    ("spec", "api", "bootstrap"),
    [
        ("http://p:8100", "http://p:8100", "http://p:8998"),
        ("http://p:8100/", "http://p:8100", "http://p:8998"),
        ("http://p:8100@9000", "http://p:8100", "http://p:9000"),
        ("http://p:8100@none", "http://p:8100", "http://p:8998"),
        ("http://p:8100@b:7000", "http://p:8100", "http://b:7000"),
        ("http://p:8100@[::1]:7000", "http://p:8100", "http://[::1]:7000"),
        ("http://p:8100@https://b:7000/", "http://p:8100", "https://b:7000"),
        ("http://[::1]:8100", "http://[::1]:8100", "http://[::1]:8998"),
        # a URL with user info names its BOOTSTRAP: the last "@" separates them
        ("http://u@p:8100@none", "http://u@p:8100", "http://p:8998"),
    ],
)
def test_one_parser_reads_every_form_of_url_at_bootstrap(
    spec: str, api: str, bootstrap: str
) -> None:
    """The proxy, the conformance suites and preflight read ``URL[@BOOTSTRAP]`` alike (5.4-R16)."""
    assert parse_prefill(spec) == (api, bootstrap)


@pytest.mark.parametrize("spec", ["p:8100", "ftp://p:8100", "http://p:8100@70000"])
def test_a_prefill_that_is_no_http_url_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=r"http|range"):
        parse_prefill(spec)
