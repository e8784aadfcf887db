"""Hypothesis over every decoder, beyond tests/unit/test_malformed.py: the fuzz targets on
arbitrary bytes (a value that decodes must re-encode to itself under both profiles), structural
mutations of valid messages and HTTP documents (a field dropped, replaced by a value of any
type, or the whole document nested), and round trips of valid HTTP documents."""

from __future__ import annotations

import json
from typing import Any, Final

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fuzz import seeds
from fuzz.targets import TARGETS
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
    decode_cancel,
    decode_json,
    decode_pull,
    decode_response,
)
from pdwire.http_models import HTTP_SECTIONS

FAST: Final = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DECODER_TARGETS: Final = ("pull", "response", "cancel", "message", "register", "query", "kv_params")
SIDE_CHANNEL: Final = {"pull": decode_pull, "response": decode_response, "cancel": decode_cancel}
#: The sections a side-channel decoder may name: encoding, limits, its message, status, fingerprint.
SECTIONS: Final = {"2", "2.3", "3.2", "3.3", "3.4", "3.5", "3.6"}
HTTP_TARGET: Final[dict[type[BaseModel], str]] = {
    RegisterWorkerPayload: "register",
    RegisterReply: "register",
    QueryResponse: "query",
    EngineEntry: "query",
    PrefillParams: "kv_params",
    DecodeParams: "kv_params",
    DecodeResultParams: "kv_params",
}

SEEDS: Final = seeds.seeds()

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
)
wire_values = st.recursive(
    scalars | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def mutated_doc(draw: st.DrawFn, doc: Any, values: st.SearchStrategy[Any]) -> Any:
    """``doc`` with one structural change somewhere in it."""
    if not isinstance(doc, dict | list) or not doc or draw(st.integers(0, 4)) == 0:
        return draw(st.one_of(values, st.just([doc]), st.just({"x": doc})))
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = draw(st.sampled_from(keys))
    out: Any = dict(doc) if isinstance(doc, dict) else list(doc)
    op = draw(st.sampled_from(["drop", "replace", "descend", "add"]))
    if op == "drop":
        del out[key]
    elif op == "replace":
        out[key] = draw(values)
    elif op == "add" and isinstance(out, dict):
        out[draw(st.text(max_size=6))] = draw(values)
    else:
        out[key] = draw(mutated_doc(doc[key], values))
    return out


@pytest.mark.parametrize("target", DECODER_TARGETS)
@settings(FAST, max_examples=100)
@given(data=st.binary(max_size=128))
def test_decoder_target_on_arbitrary_bytes(target: str, data: bytes) -> None:
    TARGETS[target](data)


@pytest.mark.parametrize("kind", sorted(SIDE_CHANNEL))
@FAST
@given(data=st.data())
def test_structurally_mutated_message_decodes_or_names_its_section(
    kind: str, data: st.DataObject
) -> None:
    doc = data.draw(mutated_doc(data.draw(st.sampled_from(VALID[kind])), wire_values))
    encoded = msgspec.msgpack.encode(doc)
    try:
        SIDE_CHANNEL[kind](encoded)
    except DecodeError as e:
        assert e.section in SECTIONS and e.path.startswith("$") and e.kind == kind, e
    TARGETS[kind](encoded)  # and a value that decodes survives both profiles' encoders


def _decodes(kind: str, data: bytes) -> bool:
    try:
        SIDE_CHANNEL[kind](data)
    except DecodeError:
        return False
    return True


#: The golden vectors that decode, as generic MessagePack documents to mutate.
VALID: Final = {
    kind: [msgspec.msgpack.decode(b) for b in SEEDS[kind] if _decodes(kind, b)]
    for kind in SIDE_CHANNEL
}


@pytest.mark.parametrize("model", list(HTTP_TARGET), ids=lambda m: m.__name__)
@FAST
@given(data=st.data())
def test_structurally_mutated_http_document(model: type[BaseModel], data: st.DataObject) -> None:
    docs = [json.loads(b) for b in SEEDS[HTTP_TARGET[model]]]
    doc = data.draw(mutated_doc(data.draw(st.sampled_from(docs)), json_values))
    body = json.dumps(doc)
    try:
        decode_json(model, body)
    except DecodeError as e:
        assert e.section == HTTP_SECTIONS[model] and e.path.startswith("$"), e
    TARGETS[HTTP_TARGET[model]](body.encode())


names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
versions = st.none() | st.integers(1, 10)
caps = st.none() | st.lists(st.text(max_size=8), max_size=3)
fingerprints = st.none() | st.builds(
    Fingerprint,
    model=names,
    dtype=names,
    num_layers=st.integers(1, 200),
    num_kv_heads=st.integers(1, 64),
    head_size=st.integers(1, 512),
    block_size=st.integers(1, 1024),
    kv_layout=names,
)
addrs = st.builds(
    "tcp://{}:{}".format,
    st.sampled_from(["10.0.0.5", "host-1.local", "[::1]"]),
    st.integers(1, 65535),
)
entries = st.builds(
    EngineEntry,
    engine_id=names,
    worker_addr=st.dictionaries(
        st.integers(0, 7), st.dictionaries(st.integers(0, 3), addrs, max_size=2), max_size=3
    ),
    pdwire_version=versions,
    pdwire_caps=caps,
    tp_size=versions,
    pp_size=versions,
    fingerprint=fingerprints,
)
DOCUMENTS: Final[dict[type[BaseModel], st.SearchStrategy[Any]]] = {
    RegisterWorkerPayload: st.builds(
        RegisterWorkerPayload,
        engine_id=names,
        dp_rank=st.integers(0, 8),
        tp_rank=st.integers(0, 8),
        pp_rank=st.integers(0, 8),
        addr=addrs,
        pdwire_version=versions,
        pdwire_caps=caps,
        tp_size=versions,
        pp_size=versions,
        fingerprint=fingerprints,
        auth_tag=st.none() | st.text(max_size=64),
    ),
    QueryResponse: st.builds(
        QueryResponse, st.dictionaries(st.integers(0, 4), entries, max_size=3)
    ),
    PrefillParams: st.builds(PrefillParams, transfer_id=names, pdwire_version=versions),
    DecodeParams: st.builds(
        DecodeParams,
        remote_bootstrap_addr=names,
        remote_engine_id=names,
        transfer_id=names,
        pdwire_version=versions,
        deadline_ms=versions,
    ),
    DecodeResultParams: st.builds(
        DecodeResultParams,
        do_remote_decode=st.none() | st.booleans(),
        do_remote_prefill=st.none() | st.booleans(),
        remote_prefill_cached_tokens=st.none() | st.integers(0, 10**6),
        pdwire_version=versions,
    ),
}


@pytest.mark.parametrize("model", list(DOCUMENTS), ids=lambda m: m.__name__)
@FAST
@given(data=st.data())
def test_valid_http_document_round_trips(model: type[BaseModel], data: st.DataObject) -> None:
    value = data.draw(DOCUMENTS[model])
    assert decode_json(model, json.dumps(value.dump())) == value
