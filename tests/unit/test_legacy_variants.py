"""Older variants of the pull (spec §3.8): each decodes into the current model with the documented
defaults, ``older_variants`` names its traits, and a real error still names its path."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest

import pdwire
from pdwire import DecodeError, XferMetadataV2
from pdwire.legacy import older_variants

#: A current pull with every field away from its default; each request has one KV-cache group so
#: that its flat form is an exact older equivalent.
CURRENT: dict[str, Any] = {
    "remote_hostname": "10.0.0.7",
    "remote_port": 17000,
    "remote_tp_size": 2,
    "remote_tp_rank": 1,
    "req_blocks": {"d-1": ["xfer-1", [[1, 2, 3]]], "d-2": ["xfer-2", [[7]]]},
    "kv_caches_base_addr": [4096, 8192],
    "block_lens": [64, 64],
    "kv_block_lens": [48, 48],
    "registered_layer_names": ["model.layers.0", "model.layers.1"],
    "registered_layer_indices": [0, 1],
    "registered_group_indices": [0, 0],
    "registered_shared_group_ids": [[0], [0]],
    "registered_row_offsets": [0, 0],
    "remote_pp_size": 2,
    "layout_id": 0x1235,
}
LAYER_METADATA = (
    "registered_layer_names",
    "registered_layer_indices",
    "registered_group_indices",
    "registered_shared_group_ids",
    "registered_row_offsets",
)
#: trait -> (fields it removes, the values decoding fills in)
TRAITS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "flat-block-lists": ((), {}),
    "no-block-lens": (("block_lens",), {"block_lens": []}),
    "no-kv-block-lens": (("kv_block_lens",), {"kv_block_lens": []}),
    "no-layer-metadata": (LAYER_METADATA, {key: [] for key in LAYER_METADATA}),
    "no-remote-pp-size": (("remote_pp_size",), {"remote_pp_size": 1}),
    "no-layout-id": (("layout_id",), {"layout_id": 0}),
}
ALL_SUBSETS = [combo for n in range(len(TRAITS) + 1) for combo in itertools.combinations(TRAITS, n)]


def variant(traits: tuple[str, ...], **overrides: Any) -> dict[str, Any]:
    """The current pull as an older peer with ``traits`` would have sent it."""
    doc = dict(CURRENT)
    for trait in traits:
        for field in TRAITS[trait][0]:
            del doc[field]
    if "flat-block-lists" in traits:
        doc["req_blocks"] = {r: [t, groups[0]] for r, (t, groups) in CURRENT["req_blocks"].items()}
    doc.update(overrides)
    return doc


def expected(traits: tuple[str, ...]) -> XferMetadataV2:
    fields = {
        **CURRENT,
        "req_blocks": {r: (t, groups) for r, (t, groups) in CURRENT["req_blocks"].items()},
    }
    for trait in traits:
        fields.update(TRAITS[trait][1])
    return XferMetadataV2(**fields)


@pytest.mark.parametrize("traits", ALL_SUBSETS, ids=lambda t: "+".join(t) or "current")
def test_older_variant_decodes_with_documented_defaults(traits: tuple[str, ...]) -> None:
    data = msgspec.msgpack.encode(variant(traits))
    assert pdwire.decode_pull(data) == expected(traits)
    assert pdwire.decode_message(data) == ("pull", expected(traits))


@pytest.mark.parametrize("traits", ALL_SUBSETS, ids=lambda t: "+".join(t) or "current")
def test_older_variants_names_each_trait(traits: tuple[str, ...]) -> None:
    obj = msgspec.msgpack.decode(msgspec.msgpack.encode(variant(traits)))
    assert older_variants(obj) == [t for t in TRAITS if t in traits]


def test_oldest_variant_in_full() -> None:
    """vLLM 0.16 to 0.18: six fields, flat block lists."""
    doc = {
        "remote_hostname": "h",
        "remote_port": 1,
        "remote_tp_size": 1,
        "remote_tp_rank": 0,
        "req_blocks": {"r": ["t", [5, 6]]},
        "kv_caches_base_addr": [4096],
    }
    msg = pdwire.decode_pull(msgspec.msgpack.encode(doc))
    assert msg.req_blocks == {"r": ("t", [[5, 6]])}
    assert (msg.block_lens, msg.kv_block_lens, msg.registered_layer_names) == ([], [], [])
    assert (msg.remote_pp_size, msg.layout_id) == (1, 0)
    assert older_variants(doc) == list(TRAITS)
    # Re-encoded, it is a current legacy pull.
    assert pdwire.decode_pull(pdwire.encode_pull(msg, "legacy")) == msg
    assert older_variants(msgspec.msgpack.decode(pdwire.encode_pull(msg, "legacy"))) == [
        "no-layer-metadata",
        "no-remote-pp-size",
        "no-layout-id",
    ]


def test_empty_flat_list_means_nothing_to_load() -> None:
    msg = pdwire.decode_pull(msgspec.msgpack.encode(variant(("no-block-lens",), req_blocks={})))
    assert msg.req_blocks == {}
    doc = variant(("flat-block-lists",), req_blocks={"r": ["t", []]})
    assert pdwire.decode_pull(msgspec.msgpack.encode(doc)).req_blocks == {"r": ("t", [])}


@pytest.mark.parametrize("obj", [None, 3, [], "pull", b"\x80"])
def test_older_variants_of_a_non_map_is_empty(obj: Any) -> None:
    assert older_variants(obj) == []


OLDEST = tuple(TRAITS)

ERRORS: dict[str, tuple[dict[str, Any], str]] = {
    "port-0": (variant(OLDEST, remote_port=0), "$.remote_port"),
    "missing-hostname": (
        {k: v for k, v in variant(OLDEST).items() if k != "remote_hostname"},
        "$.remote_hostname",
    ),
    "tp-rank-equals-size": (variant(OLDEST, remote_tp_rank=2), "$.remote_tp_rank"),
    "base-addr-not-a-list": (variant(OLDEST, kv_caches_base_addr=7), "$.kv_caches_base_addr"),
    "block-entry-not-a-pair": (
        variant(OLDEST, req_blocks={"r": ["t"]}),
        "$.req_blocks[...]",
    ),
    "flat-list-of-strings": (
        variant(OLDEST, req_blocks={"r": ["t", ["1"]]}),
        "$.req_blocks[...][1][0]",
    ),
    "region-lengths": (
        variant(("no-block-lens", "no-kv-block-lens"), registered_layer_names=["x"]),
        "$.registered_layer_names",
    ),
    "kv-block-lens-wrong-length": (
        variant(("flat-block-lists", "no-block-lens"), kv_block_lens=[1, 2, 3]),
        "$.kv_block_lens",
    ),
    "pp-size-0": (
        variant(("flat-block-lists", "no-block-lens"), remote_pp_size=0),
        "$.remote_pp_size",
    ),
}


@pytest.mark.parametrize(("doc", "path"), ERRORS.values(), ids=ERRORS.keys())
def test_an_error_besides_the_older_traits_is_reported(doc: dict[str, Any], path: str) -> None:
    with pytest.raises(DecodeError) as info:
        pdwire.decode_pull(msgspec.msgpack.encode(doc))
    assert (info.value.path, info.value.section) == (path, "3.2"), str(info.value)


def test_a_negative_id_in_a_flat_list_is_reported() -> None:
    doc = variant(OLDEST, req_blocks={"r": ["t", [4, -1]]})
    with pytest.raises(DecodeError) as info:
        pdwire.decode_pull(msgspec.msgpack.encode(doc))
    assert info.value.path.startswith("$.req_blocks[...][1]")
    assert info.value.section == "3.2"


def test_a_negative_id_in_a_flat_list_is_reported_where_it_was_received() -> None:
    doc = variant(OLDEST, req_blocks={"r": ["t", [4, -1]]})
    with pytest.raises(DecodeError) as info:
        pdwire.decode_pull(msgspec.msgpack.encode(doc))
    assert info.value.path == "$.req_blocks[...][1][1]"
