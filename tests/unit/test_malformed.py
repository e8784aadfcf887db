"""Malformed input: every decoder raises ``DecodeError`` naming a path and a spec section, and
nothing else (spec §2, §3, §4, §5)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any
from unittest.mock import patch

import msgspec
import msgspec.inspect
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdwire
from pdwire import (
    DecodeError,
    DecodeParams,
    DecodeResultParams,
    EngineEntry,
    PrefillParams,
    QueryResponse,
    RegisterReply,
    RegisterWorkerPayload,
    XferMetadataV2,
    codec,
)
from pdwire.messages import NonNegInt

from .conftest import cancels, pulls_v2, responses_v2

Decoder = Callable[..., Any]

DECODERS: dict[str, Decoder] = {
    "pull": pdwire.decode_pull,
    "response": pdwire.decode_response,
    "cancel": pdwire.decode_cancel,
    "heartbeat": pdwire.decode_heartbeat,
    "message": pdwire.detect_kind,
}
#: The section a decoder names for input that is MessagePack but not a map of its kind.
SHAPE_SECTION = {
    "pull": "3.2",
    "response": "3.4",
    "cancel": "3.5",
    "heartbeat": "3.9",
    "message": "2",
}

PULL: dict[str, Any] = {
    "remote_hostname": "10.0.0.7",
    "remote_port": 17000,
    "remote_tp_size": 2,
    "remote_tp_rank": 1,
    "req_blocks": {"d-1": ["xfer-1", [[1, 2, 3]]]},
    "kv_caches_base_addr": [4096, 8192],
    "block_lens": [64, 64],
    "kv_block_lens": [64, 64],
}
RESPONSE: dict[str, Any] = {"status": 0, "ok_reqs": ["d-1"]}
CANCEL: dict[str, Any] = {
    "pdwire_version": 2,
    "remote_hostname": "10.0.0.7",
    "remote_port": 17000,
    "remote_tp_size": 1,
    "remote_tp_rank": 0,
    "cancel_reqs": {"d-1": "xfer-1"},
}
VALID: dict[str, dict[str, Any]] = {
    "pull": PULL,
    "response": RESPONSE,
    "cancel": CANCEL,
    "heartbeat": {"lease_transfer_ids": ["xfer-1"]},
    "message": RESPONSE,
}

PER_REGION = (
    "block_lens",
    "kv_block_lens",
    "registered_layer_names",
    "registered_layer_indices",
    "registered_group_indices",
    "registered_shared_group_ids",
    "registered_row_offsets",
)
REGION_VALUE: dict[str, Any] = {
    "block_lens": 64,
    "kv_block_lens": 64,
    "registered_layer_names": "layer.0",
    "registered_layer_indices": 0,
    "registered_group_indices": 0,
    "registered_shared_group_ids": [0],
    "registered_row_offsets": 0,
}
#: Fields a pull must carry; block_lens and kv_block_lens may be absent (older variants, §3.8).
PULL_REQUIRED = (
    "remote_hostname",
    "remote_port",
    "remote_tp_size",
    "remote_tp_rank",
    "req_blocks",
    "kv_caches_base_addr",
)

enc = msgspec.msgpack.encode
BOMB = b"\x91" * 100_000
MAP_BOMB = b"\x81\xa1x" + BOMB


def _without(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != key}


Case = tuple[str, Any, str, str]  # (decoder, input, path, section)


def _every_decoder() -> list[Any]:
    out = []
    for kind in DECODERS:
        valid = enc(VALID[kind])
        cases: dict[str, tuple[Any, str, str]] = {
            "empty": (b"", "$", "2"),
            "truncated-map": (valid[:-1], "$", "2"),
            "truncated-header": (b"\xde\x00", "$", "2"),
            "trailing-bytes": (valid + b"\xc0", "$", "2"),
            "array": (enc([1, 2]), "$", SHAPE_SECTION[kind]),
            "int": (enc(7), "$", SHAPE_SECTION[kind]),
            "str": (enc("pull"), "$", SHAPE_SECTION[kind]),
            "nil": (b"\xc0", "$", SHAPE_SECTION[kind]),
            "reserved-byte": (b"\xc1", "$", "2"),
            "oversize": (valid, "$", "2.3"),
            "map-wrapped-bomb": (MAP_BOMB, "$", "2.3"),
            "python-str": (valid.decode("latin-1"), "$", "2"),
            "python-list": (list(valid), "$", "2"),
            "python-none": (None, "$", "2"),
        }
        for name, (data, path, section) in cases.items():
            options = {"max_size": len(valid) - 1} if name == "oversize" else {}
            out.append(pytest.param(kind, data, path, section, options, id=f"{kind}-{name}"))
    return out


def _bomb_cases() -> list[Any]:
    # Only decoders that descend into the nesting see the bomb; the typed response and cancel
    # decoders stop at the first byte, an array where their map belongs.
    where = {"pull": "2.3", "detect": "2.3", "response": "3.4", "cancel": "3.5", "heartbeat": "3.9"}
    return [
        pytest.param(kind, BOMB, "$", where.get(kind, "2.3"), {}, id=f"{kind}-bomb")
        for kind in DECODERS
    ]


def _pull_cases() -> list[Any]:
    cases: dict[str, tuple[dict[str, Any], str, str]] = {}
    for field in PULL_REQUIRED:
        cases[f"missing-{field}"] = (_without(PULL, field), f"$.{field}", "3.2")
    for field in XferMetadataV2.__struct_fields__:
        section = "3.6" if field == "fingerprint" else "3.2"
        cases[f"wrong-type-{field}"] = ({**PULL, field: 1.5}, f"$.{field}", section)
    cases.update(
        {
            "negative-block-id": (
                {**PULL, "req_blocks": {"d-1": ["xfer-1", [[1, -2]]]}},
                "$.req_blocks[...][1][0][1]",
                "3.2",
            ),
            "block-entry-not-a-pair": (
                {**PULL, "req_blocks": {"d-1": ["xfer-1"]}},
                "$.req_blocks[...]",
                "3.2",
            ),
            "negative-base-addr": (
                {**PULL, "kv_caches_base_addr": [4096, -1]},
                "$.kv_caches_base_addr[1]",
                "3.2",
            ),
            "port-0": ({**PULL, "remote_port": 0}, "$.remote_port", "3.2"),
            "payload-past-stride": (
                {**PULL, "kv_block_lens": [64, 65]},
                "$.kv_block_lens[1]",
                "3.2",
            ),
            "port-65536": ({**PULL, "remote_port": 65536}, "$.remote_port", "3.2"),
            "tp-size-0": (
                {**PULL, "remote_tp_size": 0, "remote_tp_rank": 0},
                "$.remote_tp_size",
                "3.2",
            ),
            "tp-rank-equals-size": ({**PULL, "remote_tp_rank": 2}, "$.remote_tp_rank", "3.2"),
            "pp-size-0": ({**PULL, "remote_pp_size": 0}, "$.remote_pp_size", "3.2"),
            "layout-id-2**63": ({**PULL, "layout_id": 2**63}, "$.layout_id", "3.2"),
            "group-index-below-minus-1": (
                {**PULL, "registered_group_indices": [0, -2]},
                "$.registered_group_indices[1]",
                "3.2",
            ),
            "fingerprint-field-missing": (
                {**PULL, "fingerprint": {"model": "m"}},
                "$.fingerprint.dtype",
                "3.6",
            ),
        }
    )
    for field in PER_REGION:
        for n in (1, 3):
            doc = {**PULL, field: [REGION_VALUE[field]] * n}
            cases[f"{field}-{n}-for-2-regions"] = (doc, f"$.{field}", "3.2")
    return [
        pytest.param("pull", enc(doc), path, section, {}, id=f"pull-{name}")
        for name, (doc, path, section) in cases.items()
    ]


def _response_cases() -> list[Any]:
    cases: dict[str, tuple[dict[str, Any], str, str]] = {
        "missing-status": ({}, "$.status", "3.3"),
        "status-4": ({"status": 4}, "$.status", "3.3"),
        "status--1": ({"status": -1}, "$.status", "3.3"),
        "status-str": ({"status": "FINISH"}, "$.status", "3.3"),
        "error-with-ok-reqs": ({"status": 2, "ok_reqs": ["a"]}, "$.ok_reqs", "3.4"),
        "layout-miss-with-ok-reqs": ({"status": 3, "ok_reqs": ["a"]}, "$.ok_reqs", "3.4"),
        "ok-and-err-overlap": (
            {"status": 0, "ok_reqs": ["a", "b"], "err_reqs": ["b"]},
            "$.err_reqs",
            "3.4",
        ),
        "err-codes-not-in-err-reqs": (
            {"status": 0, "err_reqs": ["a"], "err_codes": {"b": "INTERNAL"}},
            "$.err_codes",
            "3.4",
        ),
        "err-codes-without-err-reqs": (
            {"status": 2, "err_codes": {"a": "INTERNAL"}},
            "$.err_codes",
            "3.4",
        ),
        "ok-reqs-not-strings": ({"status": 0, "ok_reqs": [1]}, "$.ok_reqs[0]", "3.4"),
        "negative-layout-id": ({"status": 0, "layout_id": -1}, "$.layout_id", "3.4"),
    }
    return [
        pytest.param("response", enc(doc), path, section, {}, id=f"response-{name}")
        for name, (doc, path, section) in cases.items()
    ]


def _cancel_cases() -> list[Any]:
    cases: dict[str, tuple[dict[str, Any], str, str]] = {
        f"missing-{field}": (_without(CANCEL, field), f"$.{field}", "3.5") for field in CANCEL
    }
    cases.update(
        {
            "version-1": ({**CANCEL, "pdwire_version": 1}, "$.pdwire_version", "3.5"),
            "tp-rank-equals-size": ({**CANCEL, "remote_tp_rank": 1}, "$.remote_tp_rank", "3.5"),
            "pp-rank-equals-size": (
                {**CANCEL, "remote_pp_size": 2, "remote_pp_rank": 2},
                "$.remote_pp_rank",
                "3.5",
            ),
            "port-0": ({**CANCEL, "remote_port": 0}, "$.remote_port", "3.5"),
            "cancel-reqs-values-not-strings": (
                {**CANCEL, "cancel_reqs": {"d-1": 5}},
                "$.cancel_reqs[...]",
                "3.5",
            ),
        }
    )
    return [
        pytest.param("cancel", enc(doc), path, section, {}, id=f"cancel-{name}")
        for name, (doc, path, section) in cases.items()
    ]


DETECT_CASES = [
    pytest.param("message", enc({"foo": 1}), "$", "3.1", {}, id="message-no-known-key"),
    pytest.param("message", enc({}), "$", "3.1", {}, id="message-empty-map"),
    pytest.param(
        "message",
        enc({"req_blocks": {}, "cancel_reqs": {}}),
        "$",
        "3.1",
        {},
        id="message-two-kinds",
    ),
]


@pytest.mark.parametrize(
    ("kind", "data", "path", "section", "options"),
    _every_decoder()
    + _bomb_cases()
    + _pull_cases()
    + _response_cases()
    + _cancel_cases()
    + DETECT_CASES,
)
def test_malformed_input_raises_decode_error(
    kind: str, data: Any, path: str, section: str, options: dict[str, int]
) -> None:
    try:
        DECODERS[kind](data, **options)
    except DecodeError as exc:
        assert (exc.path, exc.section) == (path, section), str(exc)
        assert exc.kind == kind
        assert f"§{section}" in str(exc)
    else:
        pytest.fail(f"{kind} accepted malformed input")


@pytest.mark.parametrize("field", ["block_lens", "kv_block_lens"])
def test_block_lens_may_be_absent(field: str) -> None:
    """Not malformed: an older variant (§3.8) that decodes with the field empty."""
    assert getattr(pdwire.decode_pull(enc(_without(PULL, field))), field) == []


# -- fuzzing ------------------------------------------------------------------------------------

FUZZ_DECODERS = [*DECODERS.values(), pdwire.decode_message]


def _decodes_or_decode_error(data: bytes) -> None:
    for decode in FUZZ_DECODERS:
        try:
            decode(data)
        except DecodeError as exc:
            assert exc.section, exc
            assert exc.path.startswith("$"), exc


@st.composite
def valid_encodings(draw: st.DrawFn) -> bytes:
    which = draw(st.sampled_from(["pull", "response", "cancel", "legacy-pull"]))
    if which == "pull":
        return pdwire.encode_pull(draw(pulls_v2()), "pdwire/2")
    if which == "legacy-pull":
        return pdwire.encode_pull(draw(pulls_v2()), "legacy")
    if which == "response":
        return pdwire.encode_response(draw(responses_v2()), "pdwire/2")
    return pdwire.encode_cancel(draw(cancels()), "pdwire/2")


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(valid_encodings()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "truncate", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "truncate":
            del data[at:]
        elif data:
            del data[at : at + draw(st.integers(1, 4))]
    return bytes(data)


@settings(deadline=None, max_examples=300)
@given(data=st.binary(max_size=64))
def test_random_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    _decodes_or_decode_error(data)


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated())
def test_mutated_encodings_decode_or_raise_decode_error(data: bytes) -> None:
    _decodes_or_decode_error(data)


# -- the pull's fast path -----------------------------------------------------------------------
# decode_pull reads a pull's strides and payloads as bytes first (codec._decode_pull_fast) and
# falls back to the full decoder; both must give the same pull or the same error.


def _map(entries: list[tuple[str, bytes]], header: str = "shortest") -> bytes:
    """A MessagePack map of already encoded values, keys repeated as given."""
    n = len(entries)
    if header == "shortest" and n <= 15:
        head = bytes((0x80 | n,))
    elif header == "map32":
        head = b"\xdf" + n.to_bytes(4, "big")
    else:
        head = b"\xde" + n.to_bytes(2, "big")
    return head + b"".join(enc(key) + value for key, value in entries)


def _int_list(values: list[int], wide: bool) -> bytes:
    """``values`` as a MessagePack array; ``wide`` writes each non-negative int as a uint 64."""
    items = [b"\xcf" + v.to_bytes(8, "big") if wide and v >= 0 else enc(v) for v in values]
    return bytes((0x90 | len(values),)) + b"".join(items)


def _outcome(data: Any) -> Any:
    try:
        return pdwire.decode_pull(data)
    except DecodeError as exc:
        return exc.path, exc.section, str(exc)


def _full_decoder_outcome(data: Any) -> Any:
    with patch.object(codec, "_decode_pull_fast", return_value=None):
        return _outcome(data)


@st.composite
def pull_maps(draw: st.DrawFn) -> Any:
    """Pulls whose maps repeat keys, carry unknown keys or defaults, write ints wider than
    needed, with any map header, in any bytes-like."""
    lens = st.builds(
        _int_list, st.lists(st.sampled_from([-1, 0, 63, 64, 2**40]), max_size=3), st.booleans()
    )
    entries = [(k, enc(v)) for k, v in PULL.items() if k not in ("block_lens", "kv_block_lens")]
    strides = _int_list([64, 64], wide=False)
    entries += [("block_lens", draw(st.one_of(st.just(strides), lens)))]
    entries += [("kv_block_lens", draw(st.one_of(st.just(strides), lens)))]
    extras = {
        "remote_pp_size": [1, 2],
        "layout_id": [0, 5],
        "registered_layer_names": [[], ["a", "b"]],
        "pdwire_version": [0, 2],
        "deadline_ms": [0, 9],
        "not_a_field": [1],
    }
    for key, values in extras.items():
        if draw(st.booleans()):
            entries.append((key, enc(draw(st.sampled_from(values)))))
    for key in draw(st.lists(st.sampled_from(["block_lens", "kv_block_lens", "remote_port"]))):
        entries.append((key, draw(st.one_of(lens, st.just(enc(17000))))))
    data = _map(
        draw(st.permutations(entries)), draw(st.sampled_from(["shortest", "map16", "map32"]))
    )
    return draw(st.sampled_from([bytes, bytearray, memoryview]))(data)


@settings(deadline=None, max_examples=500)
@given(data=pull_maps())
def test_pull_fast_path_agrees_with_the_full_decoder(data: Any) -> None:
    assert _outcome(data) == _full_decoder_outcome(data)


@pytest.mark.parametrize("field", ["block_lens", "kv_block_lens"])
@pytest.mark.parametrize("bad_first", [True, False])
def test_each_value_of_a_key_given_twice_is_checked(field: str, bad_first: bool) -> None:
    good, bad = enc([64, 64]), enc([64, -1])
    first, last = (bad, good) if bad_first else (good, bad)
    entries = [(k, first if k == field else enc(v)) for k, v in PULL.items()] + [(field, last)]
    with pytest.raises(DecodeError) as info:
        pdwire.decode_pull(_map(entries))
    assert (info.value.path, info.value.section) == (f"$.{field}[1]", "3.2")


#: A value other than its default for each field a pull may leave out.
NON_DEFAULT: dict[str, Any] = {
    "registered_layer_names": ["layer.0", "layer.1"],
    "registered_layer_indices": [0, 1],
    "registered_group_indices": [0, -1],
    "registered_shared_group_ids": [[0], [0, 1]],
    "registered_row_offsets": [0, -1],
    "remote_pp_size": 2,
    "layout_id": 5,
    "pdwire_version": 2,
    "pdwire_caps": ["cancel"],
    "fingerprint": {
        "model": "m",
        "dtype": "bfloat16",
        "num_layers": 2,
        "num_kv_heads": 8,
        "head_size": 128,
        "block_size": 16,
        "kv_layout": "LBHNC",
    },
    "deadline_ms": 9,
    "auth_key_id": "0123456789abcdef",
    "auth_tag": b"tag",
}


def test_pull_fast_path_takes_pulls_with_or_without_each_field() -> None:
    assert set(PULL) | set(NON_DEFAULT) == set(XferMetadataV2.__struct_fields__)
    for doc in (PULL, {**PULL, **NON_DEFAULT}):
        data = enc(doc)
        assert codec._decode_pull_fast(data) == _full_decoder_outcome(data)


def test_pull_fast_path_shares_equal_strides_and_payloads() -> None:
    # Equal bytes are decoded once, as the type both fields share.
    types = {f.name: f.type for f in msgspec.structs.fields(XferMetadataV2)}
    for field in ("block_lens", "kv_block_lens"):
        assert msgspec.inspect.type_info(types[field]).type == msgspec.inspect.type_info(
            list[NonNegInt]
        )
    data = enc({**PULL, "block_lens": [2**40, 64], "kv_block_lens": [2**40, 64]})
    fast = codec._decode_pull_fast(data)
    assert fast is not None and type(fast) is XferMetadataV2
    assert fast == _full_decoder_outcome(data)
    assert all(map(operator.is_, fast.kv_block_lens, fast.block_lens))


# -- HTTP documents -----------------------------------------------------------------------------

REGISTER: dict[str, Any] = {
    "engine_id": "engine-0",
    "dp_rank": 0,
    "tp_rank": 1,
    "pp_rank": 0,
    "addr": "tcp://10.0.0.5:41234",
}
DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_bootstrap_addr": "http://10.0.0.5:8998",
    "remote_engine_id": "engine-0",
    "transfer_id": "xfer-1",
}
ENTRY: dict[str, Any] = {"engine_id": "engine-0", "worker_addr": {"0": {"0": "tcp://h:1"}}}


def _json(doc: Any) -> bytes:
    return msgspec.json.encode(doc)


HTTP_CASES = [
    # /register (§4.1)
    (RegisterWorkerPayload, {**REGISTER, "addr": "http://10.0.0.5:41234"}, "$.addr", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "addr": "tcp://10.0.0.5"}, "$.addr", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "addr": "tcp://10.0.0.5:0"}, "$.addr", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "addr": 5}, "$.addr", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "dp_rank": -1}, "$.dp_rank", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "tp_rank": -1}, "$.tp_rank", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "pp_rank": -3}, "$.pp_rank", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "tp_size": 0}, "$.tp_size", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "pdwire_version": 0}, "$.pdwire_version", "4.1"),
    (RegisterWorkerPayload, {**REGISTER, "engine_id": ""}, "$.engine_id", "4.1"),
    (RegisterWorkerPayload, _without(REGISTER, "engine_id"), "$.engine_id", "4.1"),
    (RegisterWorkerPayload, _without(REGISTER, "addr"), "$.addr", "4.1"),
    (RegisterWorkerPayload, _json({**REGISTER, "tp_rank": "one"}), "$.tp_rank", "4.1"),
    (RegisterWorkerPayload, b'{"engine_id": "e",', "$", "4.1"),
    (RegisterWorkerPayload, "{not json}", "$", "4.1"),
    (RegisterWorkerPayload, b"\xff\xfe", "$", "4.1"),
    (RegisterWorkerPayload, b"[]", "$", "4.1"),
    (RegisterWorkerPayload, b"", "$", "4.1"),
    (RegisterReply, {"status": "error"}, "$.status", "4.1"),
    # /query (§4.2)
    (QueryResponse, b"[]", "$", "4.2"),
    (QueryResponse, _json({"zero": ENTRY}), "$.zero[key]", "4.2"),
    (QueryResponse, _json({"0": _without(ENTRY, "engine_id")}), "$.0.engine_id", "4.2"),
    (QueryResponse, _json({"0": _without(ENTRY, "worker_addr")}), "$.0.worker_addr", "4.2"),
    (
        QueryResponse,
        _json({"0": {**ENTRY, "worker_addr": {"tp0": {"0": "tcp://h:1"}}}}),
        "$.0.worker_addr.tp0[key]",
        "4.2",
    ),
    (
        QueryResponse,
        _json({"0": {**ENTRY, "worker_addr": {"0": {"0": 17}}}}),
        "$.0.worker_addr.0.0",
        "4.2",
    ),
    (QueryResponse, _json({"0": {**ENTRY, "pp_size": 0}}), "$.0.pp_size", "4.2"),
    (QueryResponse, b'{"0": ', "$", "4.2"),
    (EngineEntry, {**ENTRY, "engine_id": ""}, "$.engine_id", "4.2"),
    # kv_transfer_params (§5)
    (PrefillParams, {"do_remote_decode": True}, "$.transfer_id", "5.1"),
    (PrefillParams, {"do_remote_decode": False, "transfer_id": "x"}, "$.do_remote_decode", "5.1"),
    (PrefillParams, {"transfer_id": ""}, "$.transfer_id", "5.1"),
    (DecodeParams, _without(DECODE_PARAMS, "remote_engine_id"), "$.remote_engine_id", "5.2"),
    (DecodeParams, _without(DECODE_PARAMS, "transfer_id"), "$.transfer_id", "5.2"),
    (
        DecodeParams,
        _without(DECODE_PARAMS, "remote_bootstrap_addr"),
        "$.remote_bootstrap_addr",
        "5.2",
    ),
    (DecodeParams, {**DECODE_PARAMS, "do_remote_prefill": False}, "$.do_remote_prefill", "5.2"),
    (DecodeParams, {**DECODE_PARAMS, "deadline_ms": 0}, "$.deadline_ms", "5.2"),
    (DecodeParams, b"null", "$", "5.2"),
    (
        DecodeResultParams,
        {"remote_prefill_cached_tokens": -1},
        "$.remote_prefill_cached_tokens",
        "5.3",
    ),
    (DecodeResultParams, {"do_remote_prefill": "maybe"}, "$.do_remote_prefill", "5.3"),
]


@pytest.mark.parametrize(
    ("model", "data", "path", "section"),
    [pytest.param(*case, id=f"{case[0].__name__}-{i}") for i, case in enumerate(HTTP_CASES)],
)
def test_bad_http_document_raises_decode_error(
    model: type[Any], data: Any, path: str, section: str
) -> None:
    with pytest.raises(DecodeError) as info:
        pdwire.decode_json(model, data)
    assert (info.value.path, info.value.section) == (path, section), str(info.value)
    assert info.value.kind == model.__name__


@pytest.mark.parametrize("addr", ["http://10.0.0.5:1", "", "tcp://10.0.0.5"])
def test_query_worker_addr_follows_the_register_addr_rule(addr: str) -> None:
    doc = _json({"0": {**ENTRY, "worker_addr": {"0": {"0": addr}}}})
    with pytest.raises(DecodeError) as info:
        pdwire.decode_json(QueryResponse, doc)
    assert (info.value.path, info.value.section) == ("$.0.worker_addr.0.0", "4.2")
