"""Shared Hypothesis strategies and helpers for the codec unit tests.

The test modules import from here (``from .conftest import ...``): the strategies build only
messages that pdwire must accept, so every other property can start from them.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from pdwire import (
    ErrorCode,
    Fingerprint,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseStatus,
    XferResponseV2,
)
from pdwire.versions import ALL_CAPS

MAX_U64 = 2**64 - 1
MAX_LAYOUT_ID = 2**63 - 1

PULL_EXTENSIONS = tuple(
    f for f in XferMetadataV2.__struct_fields__ if f not in XferMetadata.__struct_fields__
)
RESPONSE_EXTENSIONS = tuple(
    f for f in XferResponseV2.__struct_fields__ if f not in XferResponse.__struct_fields__
)

ids = st.text(max_size=10)
ports = st.integers(1, 65535)
caps = st.lists(st.sampled_from(sorted(ALL_CAPS)) | st.text(max_size=8), max_size=4)
auth_tags = st.none() | st.binary(min_size=32, max_size=32)

fingerprints = st.builds(
    Fingerprint,
    model=st.text(max_size=16),
    dtype=st.sampled_from(["bfloat16", "float16", "fp8_e4m3"]),
    num_layers=st.integers(1, 128),
    num_kv_heads=st.integers(1, 64),
    head_size=st.integers(1, 512),
    block_size=st.integers(1, 1024),
    kv_layout=st.sampled_from(["NHD", "HND"]),
)


@st.composite
def _tp(draw: st.DrawFn) -> tuple[int, int]:
    size = draw(st.integers(1, 16))
    return size, draw(st.integers(0, size - 1))


def _per_region(n: int, elem: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """A per-region list: absent (empty) or exactly one entry per region."""
    return st.just([]) | st.lists(elem, min_size=n, max_size=n)


@st.composite
def pull_fields(draw: st.DrawFn, *, vllm_032: bool = False) -> dict[str, Any]:
    """Keyword arguments of a valid ``XferMetadata``.

    ``vllm_032``: ``layout_id`` stays 0, so vLLM 0.32.0 (which lacks the field) has the same bytes.
    """
    n = draw(st.integers(0, 4))
    tp_size, tp_rank = draw(_tp())
    strides = draw(_per_region(n, st.integers(0, 2**32)))
    # Each payload fits its stride (3.2-R21); with no strides sent, any payload.
    payloads = draw(
        st.tuples(*(st.integers(0, s) for s in strides)).map(list)
        if strides
        else _per_region(n, st.integers(0, 2**32))
    )
    return {
        "remote_hostname": draw(st.text(max_size=20)),
        "remote_port": draw(ports),
        "remote_tp_size": tp_size,
        "remote_tp_rank": tp_rank,
        "req_blocks": draw(
            st.dictionaries(
                ids,
                st.tuples(
                    ids,
                    st.lists(st.lists(st.integers(0, 2**32), max_size=4), max_size=3),
                ),
                max_size=4,
            )
        ),
        "kv_caches_base_addr": draw(st.lists(st.integers(0, MAX_U64), min_size=n, max_size=n)),
        "block_lens": strides,
        "kv_block_lens": payloads,
        "registered_layer_names": draw(_per_region(n, st.text(max_size=12))),
        "registered_layer_indices": draw(_per_region(n, st.integers(0, 200))),
        "registered_group_indices": draw(_per_region(n, st.integers(-1, 8))),
        "registered_shared_group_ids": draw(
            _per_region(n, st.lists(st.integers(0, 8), max_size=3))
        ),
        "registered_row_offsets": draw(_per_region(n, st.integers(-1, 2**20))),
        "remote_pp_size": draw(st.integers(1, 8)),
        "layout_id": 0 if vllm_032 else draw(st.integers(0, MAX_LAYOUT_ID)),
    }


@st.composite
def pull_extension_fields(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "pdwire_version": draw(st.integers(0, 10)),
        "pdwire_caps": draw(caps),
        "fingerprint": draw(st.none() | fingerprints),
        "deadline_ms": draw(st.integers(0, 2**40)),
        "auth_tag": draw(auth_tags),
    }


def pulls(*, vllm_032: bool = False) -> st.SearchStrategy[XferMetadata]:
    return st.builds(lambda kw: XferMetadata(**kw), pull_fields(vllm_032=vllm_032))


def pulls_v2(*, vllm_032: bool = False) -> st.SearchStrategy[XferMetadataV2]:
    return st.builds(
        lambda kw, ext: XferMetadataV2(**kw, **ext),
        pull_fields(vllm_032=vllm_032),
        pull_extension_fields(),
    )


@st.composite
def response_fields(draw: st.DrawFn, *, vllm_032: bool = False) -> dict[str, Any]:
    """Keyword arguments of a valid ``XferResponse``.

    ``vllm_032``: statuses 0-2 and ``layout_id`` 0 only, as vLLM 0.32.0 knows no more.
    """
    statuses = list(XferResponseStatus)[:3] if vllm_032 else list(XferResponseStatus)
    status = draw(st.sampled_from(statuses))
    reqs = draw(st.lists(ids, unique=True, max_size=6))
    split = draw(st.integers(0, len(reqs)))
    ok, err = reqs[:split], reqs[split:]
    # ERROR and LAYOUT_MISS carry no ok_reqs (§3.4).
    ok_reqs = None if status >= XferResponseStatus.ERROR else draw(st.none() | st.just(ok))
    return {
        "status": status,
        "ok_reqs": ok_reqs,
        "err_reqs": draw(st.none() | st.just(err)),
        "err_msg": draw(st.none() | st.text(max_size=30)),
        "layout_id": 0 if vllm_032 else draw(st.integers(0, MAX_LAYOUT_ID)),
    }


@st.composite
def responses_v2(draw: st.DrawFn, *, vllm_032: bool = False) -> XferResponseV2:
    kw = draw(response_fields(vllm_032=vllm_032))
    failed = kw["err_reqs"] or []
    codes = st.sampled_from(list(ErrorCode)) | st.text(max_size=10)
    err_codes = draw(
        (st.none() | st.dictionaries(st.sampled_from(failed), codes)) if failed else st.none()
    )
    return XferResponseV2(
        **kw,
        pdwire_version=draw(st.integers(0, 10)),
        pdwire_caps=draw(caps),
        err_code=draw(st.none() | st.sampled_from(list(ErrorCode)) | st.text(max_size=10)),
        err_codes=err_codes,
        auth_tag=draw(auth_tags),
    )


def responses(*, vllm_032: bool = False) -> st.SearchStrategy[XferResponse]:
    return st.builds(lambda kw: XferResponse(**kw), response_fields(vllm_032=vllm_032))


@st.composite
def cancels(draw: st.DrawFn) -> XferCancel:
    tp_size, tp_rank = draw(_tp())
    pp_size = draw(st.integers(1, 8))
    return XferCancel(
        pdwire_version=draw(st.integers(2, 10)),
        remote_hostname=draw(st.text(max_size=20)),
        remote_port=draw(ports),
        remote_tp_size=tp_size,
        remote_tp_rank=tp_rank,
        cancel_reqs=draw(st.dictionaries(ids, ids, max_size=4)),
        remote_pp_size=pp_size,
        remote_pp_rank=draw(st.integers(0, pp_size - 1)),
        reason=draw(st.text(max_size=20)),
        auth_tag=draw(auth_tags),
    )


def as_v2_pull(msg: XferMetadata) -> XferMetadataV2:
    """What decoding returns for the legacy fields of ``msg``: extensions at their defaults."""
    return XferMetadataV2(*msgspec.structs.astuple(msg)[: len(XferMetadata.__struct_fields__)])


def as_v2_response(msg: XferResponse) -> XferResponseV2:
    """What decoding returns for the legacy fields of ``msg``: extensions at their defaults."""
    return XferResponseV2(*msgspec.structs.astuple(msg)[: len(XferResponse.__struct_fields__)])


def base_pull(msg: XferMetadata) -> XferMetadata:
    """The legacy projection of a pull."""
    return XferMetadata(*msgspec.structs.astuple(msg)[: len(XferMetadata.__struct_fields__)])


def base_response(msg: XferResponse) -> XferResponse:
    """The legacy projection of a reply."""
    return XferResponse(*msgspec.structs.astuple(msg)[: len(XferResponse.__struct_fields__)])


def non_default_fields(msg: msgspec.Struct) -> set[str]:
    """Names of the fields of ``msg`` that an ``omit_defaults`` encoding must write."""
    present = set()
    for field in msgspec.structs.fields(msg):
        value = getattr(msg, field.name)
        if field.required:
            present.add(field.name)
        elif field.default is not msgspec.NODEFAULT:
            if value != field.default:
                present.add(field.name)
        elif value != field.default_factory():
            present.add(field.name)
    return present


def wire_keys(data: bytes) -> set[str]:
    """The top-level keys of an encoded message, read generically."""
    obj = msgspec.msgpack.decode(data)
    assert isinstance(obj, dict)
    return set(obj)
