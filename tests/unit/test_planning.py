"""Transfer planning (spec §10.1, §10.6-§10.8): pairing, alignment, byte placement, descriptors.

The byte-placement tests build real LBHNC KV buffers for every P and D worker, apply the planned
descriptors as memcpy between them and compare D's bytes with the head shards D must hold.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdwire import error_strings as es
from pdwire.messages import ErrorCode, XferMetadata
from pdwire.planning import (
    Descriptors,
    Plan,
    PlanError,
    Region,
    RegionPlan,
    Side,
    descriptors,
    prepare,
    regions_of_pull,
    target_ranks,
)

TP_SIZES = (1, 2, 4, 8)
Triple = tuple[int, int, int]


def plan_of(result: Plan | PlanError) -> Plan:
    assert isinstance(result, Plan), result
    return result


def descs_of(result: Descriptors | PlanError) -> Descriptors:
    assert isinstance(result, Descriptors), result
    return result


def triples(d: Descriptors) -> list[Triple]:
    return list(zip(map(int, d.src), map(int, d.dst), map(int, d.length), strict=True))


def region(
    name: str,
    index: int = 0,
    base: int = 0,
    length: int = 64,
    *,
    block_len: int | None = None,
    group_index: int = 0,
    shared_group_ids: tuple[int, ...] = (),
) -> Region:
    stride = length if block_len is None else block_len
    return Region(name, index, base, stride, length, group_index, shared_group_ids)


def side(
    regions: Sequence[Region],
    tp: int = 1,
    rank: int = 0,
    pp: int = 1,
    *,
    replicated: bool = False,
    total_kv_heads: int | None = None,
) -> Side:
    return Side(tp, rank, pp, tuple(regions), replicated, total_kv_heads)


# -- §10.1 TP pairing -------------------------------------------------------------------------


def test_target_ranks_spec_example() -> None:
    # P TP 4, D TP 2: D rank 1 pulls from P ranks 2 and 3; P rank 3 pairs with D rank 1 only.
    assert target_ranks(2, 1, 4) == [2, 3]
    assert target_ranks(4, 3, 2) == [1]


TARGET_TABLE = {
    (1, 0, 1): [0],
    (1, 0, 8): [0, 1, 2, 3, 4, 5, 6, 7],
    (2, 1, 8): [4, 5, 6, 7],
    (4, 2, 8): [4, 5],
    (8, 5, 1): [0],
    (8, 5, 2): [1],
    (8, 5, 4): [2],
    (4, 3, 4): [3],
}


@pytest.mark.parametrize(("args", "expected"), TARGET_TABLE.items())
def test_target_ranks_table(args: tuple[int, int, int], expected: list[int]) -> None:
    assert target_ranks(*args) == expected


@pytest.mark.parametrize(("p_tp", "d_tp"), list(itertools.product(TP_SIZES, TP_SIZES)))
def test_target_ranks_symmetric(p_tp: int, d_tp: int) -> None:
    for p, d in itertools.product(range(p_tp), range(d_tp)):
        assert (p in target_ranks(d_tp, d, p_tp)) == (d in target_ranks(p_tp, p, d_tp))
    for d in range(d_tp):
        assert len(target_ranks(d_tp, d, p_tp)) == max(1, p_tp // d_tp)
    pulled = sorted(p for d in range(d_tp) for p in target_ranks(d_tp, d, p_tp))
    assert pulled == sorted(list(range(p_tp)) * max(1, d_tp // p_tp))


@pytest.mark.parametrize("args", [(3, 0, 2), (2, 0, 3), (4, 4, 2), (0, 0, 1), (2, 0, 0)])
def test_target_ranks_rejects(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        target_ranks(*args)


# -- regions_of_pull --------------------------------------------------------------------------


def pull(**kw: object) -> XferMetadata:
    base: dict[str, object] = {
        "remote_hostname": "d",
        "remote_port": 1,
        "remote_tp_size": 1,
        "remote_tp_rank": 0,
        "req_blocks": {},
        "kv_caches_base_addr": [0x1000, 0x2000],
        "block_lens": [],
        "kv_block_lens": [],
    }
    return XferMetadata(**{**base, **kw})  # type: ignore[arg-type]


def test_regions_of_pull_full() -> None:
    msg = pull(
        block_lens=[128, 96],
        kv_block_lens=[64, 96],
        registered_layer_names=["a", "a"],
        registered_layer_indices=[3, 3],
        registered_group_indices=[-1, 1],
        registered_shared_group_ids=[[0, 1], []],
        registered_row_offsets=[0, -1],
    )
    assert regions_of_pull(msg) == (
        Region("a", 3, 0x1000, 128, 64, -1, (0, 1), 0),
        Region("a", 3, 0x2000, 96, 96, 1, (), -1),
    )


def test_regions_of_pull_older_variant_defaults() -> None:
    assert regions_of_pull(pull()) == (
        Region("#0", 0, 0x1000, 0, 0, 0, (), -1),
        Region("#1", 1, 0x2000, 0, 0, 0, (), -1),
    )
    assert regions_of_pull(pull(kv_caches_base_addr=[])) == ()


# -- §10.7 alignment --------------------------------------------------------------------------


def align_error(message: str) -> PlanError:
    return PlanError(ErrorCode.LAYER_ALIGNMENT, message)


def test_alignment_by_occurrence_not_position() -> None:
    p = [region(n, i, base=0x100 * k) for k, (n, i) in enumerate([("a", 0), ("b", 1)] * 2)]
    d = [region(n, i, base=0x1000 * k) for k, (n, i) in enumerate([("a", 0), ("a", 0), ("b", 1)])]
    d.append(region("b", 1, base=0x3000))
    plan = plan_of(prepare(side(p), side(d)))
    assert [(rp.src.base_addr, rp.dst.base_addr) for rp in plan.regions] == [
        (0x000, 0x0000),  # a#0
        (0x100, 0x2000),  # b#0
        (0x200, 0x1000),  # a#1
        (0x300, 0x3000),  # b#1
    ]


def test_consumer_regions_that_producer_lacks_are_unused() -> None:
    plan = plan_of(prepare(side([region("a")]), side([region("z", 5), region("a")])))
    assert [rp.dst.layer_name for rp in plan.regions] == ["a"]


def layer(i: int, base: int = 0) -> Region:
    return region(f"model.layers.{i}.self_attn", i, base=base, length=256)


def test_heterogeneous_pp_stage_without_shared_layers_is_a_noop() -> None:
    # P PP4 stage 0 holds layer 0; D PP2 stage 1 holds layer 1 only.
    producer = side([layer(0, 0x1000)], pp=4)
    plan = plan_of(prepare(producer, side([layer(1, 0x2000)], pp=2)))
    assert plan.regions == ()
    assert len(descs_of(descriptors(plan, [[1]], [[2]]))) == 0
    # D stage 0 holds layers 0 and 1: one pair.
    plan = plan_of(prepare(producer, side([layer(0, 0x2000), layer(1, 0x3000)], pp=2)))
    assert [(rp.src.base_addr, rp.dst.base_addr) for rp in plan.regions] == [(0x1000, 0x2000)]
    assert triples(descs_of(descriptors(plan, [[1]], [[2]]))) == [(0x1100, 0x2200, 256)]


def test_heterogeneous_pp_when_producer_is_not_pipelined() -> None:
    producer = side([layer(0), layer(1)], pp=1)
    plan = plan_of(prepare(producer, side([layer(1)], pp=2)))
    assert [rp.src.layer_index for rp in plan.regions] == [1]


def test_equal_pp_missing_layer_is_an_error() -> None:
    result = prepare(side([layer(0), layer(1)], pp=2), side([layer(0)], pp=2))
    assert result == align_error(
        "Mooncake producer registered layer has no matching consumer occurrence: "
        "model.layers.1.self_attn occurrence 0."
    )


def test_partial_layers_still_require_every_occurrence() -> None:
    producer = side([layer(0), layer(0)], pp=4)
    result = prepare(producer, side([layer(0)], pp=2))
    assert result == align_error(
        es.NO_MATCHING_OCCURRENCE.format(layer_name="model.layers.0.self_attn", occurrence=1)
    )


@pytest.mark.parametrize(
    ("p_kw", "d_kw", "message"),
    [
        (
            {"index": 1},
            {"index": 2},
            "Mooncake registered layer index mismatch for a: producer=1, consumer=2.",
        ),
        (
            {"group_index": 0},
            {"group_index": 1},
            "Mooncake registered group index mismatch for a: producer=0, consumer=1.",
        ),
        (
            {"group_index": -1, "shared_group_ids": (0, 1)},
            {"group_index": -1, "shared_group_ids": (0, 2)},
            "Mooncake shared-group set mismatch for a: producer=[0, 1], consumer=[0, 2].",
        ),
    ],
)
def test_alignment_mismatch_messages(
    p_kw: dict[str, Any], d_kw: dict[str, Any], message: str
) -> None:
    result = prepare(side([region("a", **p_kw)]), side([region("a", **d_kw)]))
    assert result == align_error(message)


def test_shared_group_sets_compare_as_sets_and_only_when_both_sent() -> None:
    for d_shared in [(1, 0), ()]:
        p = region("a", group_index=-1, shared_group_ids=(0, 1))
        d = region("a", group_index=-1, shared_group_ids=d_shared)
        assert isinstance(prepare(side([p]), side([d])), Plan)


def test_shared_region_without_groups_is_an_error() -> None:
    r = region("a", group_index=-1)
    assert prepare(side([r]), side([r])) == align_error(es.SHARED_GROUP_METADATA)


def test_positional_alignment_for_unnamed_pulls() -> None:
    p = [region("model.layers.0", 0, base=0x10), region("model.layers.0", 0, base=0x20)]
    d = regions_of_pull(pull(block_lens=[64, 64], kv_block_lens=[64, 64]))
    plan = plan_of(prepare(side(p), side(d)))
    assert [(rp.src.base_addr, rp.dst.base_addr) for rp in plan.regions] == [
        (0x10, 0x1000),
        (0x20, 0x2000),
    ]
    assert prepare(side(p[:1]), side(d)) == PlanError(
        ErrorCode.REGION_LENGTH, es.ASYMMETRIC_REGION_COUNT
    )


@pytest.mark.parametrize(("p_tp", "d_tp", "d_len"), [(1, 1, 64), (2, 1, 128), (1, 2, 32)])
def test_older_pull_without_lengths_takes_producers(p_tp: int, d_tp: int, d_len: int) -> None:
    d = regions_of_pull(pull(kv_caches_base_addr=[0x1000]))
    p = [region("model.layers.0", 0, length=64, block_len=80)]
    plan = plan_of(prepare(side(p, tp=p_tp), side(d, tp=d_tp)))
    (rp,) = plan.regions
    assert (rp.dst.kv_block_len, rp.dst.block_len) == (d_len, 80 * d_len // 64)


def test_unpaired_tp_rank() -> None:
    result = prepare(side([region("a")], tp=4, rank=3), side([region("a")], tp=2, rank=0))
    assert result == PlanError(
        ErrorCode.TP_RANK_NOT_PAIRED,
        "This D tp_rank 0 is not paired with P tp_rank 3; expected one of [1].",
    )


def test_asymmetric_tp_needs_matching_region_counts() -> None:
    d = [region("a", length=64), region("a", length=64, base=0x1000)]
    # Equal TP: D's second occurrence of "a" is simply not used.
    assert len(plan_of(prepare(side([region("a", length=64)]), side(d))).regions) == 1
    result = prepare(side([region("a", length=32)], tp=2), side(d, tp=1))
    assert result == PlanError(ErrorCode.REGION_LENGTH, es.ASYMMETRIC_REGION_COUNT)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_len", "d_len", "message"),
    [
        (
            2,
            2,
            64,
            32,
            "Mooncake KV region length mismatch for homogeneous TP at region 1: "
            "local=64, remote=32.",
        ),
        (
            4,
            1,
            64,
            128,
            "Mooncake destination KV region length does not match the producer TP ratio at "
            "region 1: local=64, remote=128, tp_ratio=4.",
        ),
        (
            1,
            2,
            64,
            64,
            "Mooncake source KV region length does not match the consumer TP ratio at region 1: "
            "local=64, remote=64, tp_ratio=-2.",
        ),
    ],
)
def test_region_length_messages(p_tp: int, d_tp: int, p_len: int, d_len: int, message: str) -> None:
    ok_d = p_len * p_tp // d_tp
    p = [region("a", length=p_len), region("b", length=p_len)]
    d = [region("a", length=ok_d), region("b", length=d_len)]
    result = prepare(side(p, tp=p_tp), side(d, tp=d_tp))
    assert result == PlanError(ErrorCode.REGION_LENGTH, message)


def test_tp_sizes_are_capped_at_the_kv_heads() -> None:
    # 2 KV heads: P TP 8 holds one head per rank (4 replicas each), D TP 4 one head per rank.
    p, d = [region("a", length=16)], [region("a", length=16)]
    for rank in range(8):
        producer = side(p, tp=8, rank=rank, total_kv_heads=2, replicated=True)
        consumer = side(d, tp=4, rank=rank // 2, total_kv_heads=2)
        (rp,) = plan_of(prepare(producer, consumer)).regions
        assert (rp.src_offset, rp.dst_offset, rp.length, rp.write) == (0, 0, 16, rank % 2 == 0)


@pytest.mark.parametrize(("p_replicated", "d_replicated"), [(True, False), (False, True)])
def test_replication_flag_on_either_side_means_one_shard(
    p_replicated: bool, d_replicated: bool
) -> None:
    # An MLA latent without a head count: identical on every rank of both sides.
    producer = side([region("a", length=64)], tp=1, replicated=p_replicated)
    for rank in range(4):
        consumer = side([region("a", length=64)], tp=4, rank=rank, replicated=d_replicated)
        (rp,) = plan_of(prepare(producer, consumer)).regions
        assert (rp.src_offset, rp.dst_offset, rp.length, rp.write) == (0, 0, 64, True)


def test_prepare_is_deterministic() -> None:
    p = side([layer(0), layer(1)], tp=2, rank=1)
    d = side([layer(0, 0x10), layer(1, 0x20)], tp=1)
    assert prepare(p, d) == prepare(p, d)


# -- §10.8 byte placement on real buffers -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry:
    """LBHNC KV caches: LAYERS layers x K/V, ``heads`` KV heads, 2-byte elements."""

    heads: int
    replicated_cache: bool = False  # MLA-like: one latent, identical on every rank
    pad: int = 0  # stride bytes after each block's payload
    give_heads: bool = True  # pass total_kv_heads to prepare

    LAYERS = 4
    HEAD_DIM = 4
    TOKENS = 2  # per block
    BLOCKS = 6  # per region
    MAX_TOKENS = 16

    def rank_heads(self, tp: int, rank: int) -> list[int]:
        if self.replicated_cache:
            return [0]
        if tp <= self.heads:
            per = self.heads // tp
            return list(range(rank * per, (rank + 1) * per))
        return [rank * self.heads // tp]

    def payload(self, tp: int) -> int:
        return len(self.rank_heads(tp, 0)) * self.TOKENS * self.HEAD_DIM * 2

    def stride(self, tp: int) -> int:
        return self.payload(tp) + self.pad

    def regions(self, tp: int) -> list[Region]:
        size = self.BLOCKS * self.stride(tp)
        name = "model.layers.{}.self_attn.attn".format
        stride, payload = self.stride(tp), self.payload(tp)
        return [
            Region(name(i // 2), i // 2, i * size, stride, payload) for i in range(2 * self.LAYERS)
        ]

    def side(self, tp: int, rank: int) -> Side:
        replicated = self.replicated_cache or tp > self.heads
        heads = self.heads if self.give_heads else None
        return Side(tp, rank, 1, tuple(self.regions(tp)), replicated, heads)

    def values(self, region: int, heads: list[int], first_token: int) -> npt.NDArray[np.uint16]:
        """One block's payload, (head, token, channel): values naming region, head, token
        position and channel, so any misplaced byte shows."""
        h = np.array(heads).reshape(-1, 1, 1)
        n = first_token + np.arange(self.TOKENS).reshape(1, -1, 1)
        c = np.arange(self.HEAD_DIM).reshape(1, 1, -1)
        value = ((region * self.heads + h) * self.MAX_TOKENS + n) * self.HEAD_DIM + c + 1
        return np.asarray(value, dtype=np.uint16)

    def buffer(self, tp: int, rank: int, blocks: Sequence[int], fill: int) -> npt.NDArray[np.uint8]:
        """A worker's regions in one byte buffer; ``blocks`` hold the request's tokens in order."""
        stride, payload = self.stride(tp), self.payload(tp)
        buf = np.full(2 * self.LAYERS * self.BLOCKS * stride, fill, dtype=np.uint8)
        heads = self.rank_heads(tp, rank)
        for r, i in itertools.product(range(2 * self.LAYERS), range(len(blocks))):
            start = (r * self.BLOCKS + blocks[i]) * stride
            block = self.values(r, heads, i * self.TOKENS)
            buf[start : start + payload] = np.frombuffer(block.tobytes(), dtype=np.uint8)
        return buf


Bytes = npt.NDArray[np.uint8]


def apply(d: Descriptors, src: Bytes, dst: Bytes, writes: npt.NDArray[np.int64]) -> None:
    for s, t, n in triples(d):
        dst[t : t + n] = src[s : s + n]
        writes[t : t + n] += 1


P_BLOCKS = [1, 2, 3, 5]  # a run of three, then a break
D_BLOCKS = [3, 4, 5, 0]

GEOMETRIES = {
    "8 heads": Geometry(heads=8),
    "8 heads, padded stride": Geometry(heads=8, pad=16),
    "2 heads (P replicated above TP 2)": Geometry(heads=2),
    "MLA latent, replicated, no head count": Geometry(
        heads=1, replicated_cache=True, give_heads=False
    ),
    "MLA latent, 1 KV head": Geometry(heads=1, replicated_cache=True),
}


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize(("p_tp", "d_tp"), list(itertools.product(TP_SIZES, TP_SIZES)))
def test_byte_placement(geometry: Geometry, p_tp: int, d_tp: int) -> None:
    g = geometry
    p_bufs = [g.buffer(p_tp, p, P_BLOCKS, fill=0xEE) for p in range(p_tp)]
    for d in range(d_tp):
        d_buf = g.buffer(d_tp, d, [], fill=0)
        writes = np.zeros(len(d_buf), dtype=np.int64)
        for p in target_ranks(d_tp, d, p_tp):
            assert d in target_ranks(p_tp, p, d_tp)
            plan = plan_of(prepare(g.side(p_tp, p), g.side(d_tp, d)))
            apply(descs_of(descriptors(plan, [P_BLOCKS], [D_BLOCKS])), p_bufs[p], d_buf, writes)
        expected = g.buffer(d_tp, d, D_BLOCKS, fill=0)
        assert np.array_equal(d_buf, expected), (p_tp, d_tp, d)
        assert set(np.unique(writes)) <= {0, 1}, "a byte was written twice"
        assert int(writes.sum()) == 2 * g.LAYERS * len(D_BLOCKS) * g.payload(d_tp)


def test_replicated_ranks_that_do_not_write_still_plan() -> None:
    g = GEOMETRIES["MLA latent, replicated, no head count"]
    plans = [plan_of(prepare(g.side(4, p), g.side(1, 0))) for p in range(4)]
    assert [all(rp.write for rp in plan.regions) for plan in plans] == [True, False, False, False]
    assert len(descs_of(descriptors(plans[1], [P_BLOCKS], [D_BLOCKS]))) == 0


# -- §10.6 block selection and §10.8.12-14 descriptors ----------------------------------------

PAGE = 64


def simple_plan(*regions: tuple[Region, Region], src_offset: int = 0, dst_offset: int = 0) -> Plan:
    return Plan(
        tuple(RegionPlan(s, d, src_offset, dst_offset, s.kv_block_len, True) for s, d in regions)
    )


def page_region(base: int, group: int = 0, shared: tuple[int, ...] = ()) -> Region:
    return Region("l", 0, base, PAGE, PAGE, group, shared)


ONE = simple_plan((page_region(0x10000), page_region(0x90000)))


def test_partial_prefix_hit_sends_producers_last_blocks() -> None:
    d = descs_of(descriptors(ONE, [[10, 11, 12, 20, 30]], [[7, 9, 8]]))
    assert triples(d) == [
        (0x10000 + 12 * PAGE, 0x90000 + 7 * PAGE, PAGE),
        (0x10000 + 20 * PAGE, 0x90000 + 9 * PAGE, PAGE),
        (0x10000 + 30 * PAGE, 0x90000 + 8 * PAGE, PAGE),
    ]


def test_producer_with_fewer_blocks_fails() -> None:
    result = descriptors(ONE, [[1, 2], [3]], [[1], [3, 4]])
    assert result == PlanError(ErrorCode.P_BLOCKS_LESS_THAN_D, "P num blocks less than D")


def test_group_count_mismatch_fails() -> None:
    result = descriptors(ONE, [[1, 2]], [[1], [2]])
    assert result == PlanError(ErrorCode.KV_GROUP_COUNT_MISMATCH, "KV group count mismatch")


def test_region_of_a_group_the_request_lacks() -> None:
    plan = simple_plan((page_region(0, 1), page_region(0x1000, 1)))
    result = descriptors(plan, [[1]], [[2]])
    assert result == PlanError(ErrorCode.KV_GROUP_COUNT_MISMATCH, "KV group count mismatch")
    plan = simple_plan((page_region(0, -1, (0, 1)), page_region(0x1000, -1, (0, 1))))
    assert descriptors(plan, [[1]], [[2]]) == align_error(es.SHARED_GROUP_METADATA)


@pytest.mark.parametrize("dst_blocks", [[], [[]], [[], []]])
def test_release_only_gives_nothing(dst_blocks: list[list[int]]) -> None:
    d = descs_of(descriptors(ONE, [[1, 2, 3]], dst_blocks))
    assert len(d) == 0 and d.total_bytes == 0
    assert d.src.dtype == d.dst.dtype == d.length.dtype == np.uint64


def test_empty_group_writes_nothing_for_its_regions() -> None:
    plan = simple_plan(
        (page_region(0, 0), page_region(0x1000, 0)),
        (page_region(0x2000, 1), page_region(0x3000, 1)),
    )
    d = descs_of(descriptors(plan, [[1], [4, 5]], [[], [6, 7]]))
    assert triples(d) == [(0x2000 + 4 * PAGE, 0x3000 + 6 * PAGE, 2 * PAGE)]


def test_contiguous_ids_coalesce_to_one_descriptor_per_region() -> None:
    plan = simple_plan(
        (page_region(0x10000), page_region(0x90000)), (page_region(0x20000), page_region(0xA0000))
    )
    d = descs_of(descriptors(plan, [list(range(5, 15))], [list(range(40, 50))]))
    assert triples(d) == [
        (0x10000 + 5 * PAGE, 0x90000 + 40 * PAGE, 10 * PAGE),
        (0x20000 + 5 * PAGE, 0xA0000 + 40 * PAGE, 10 * PAGE),
    ]


def test_fragmented_ids_give_one_descriptor_per_block() -> None:
    d = descs_of(descriptors(ONE, [[1, 3, 5, 7]], [[2, 3, 9, 8]]))
    assert [n for _, _, n in triples(d)] == [PAGE] * 4
    # Runs need both sides to step by +1: P runs 1..3, D does not.
    d = descs_of(descriptors(ONE, [[1, 2, 3]], [[5, 7, 8]]))
    assert triples(d) == [
        (0x10000 + 1 * PAGE, 0x90000 + 5 * PAGE, PAGE),
        (0x10000 + 2 * PAGE, 0x90000 + 7 * PAGE, 2 * PAGE),
    ]


@pytest.mark.parametrize(("src_offset", "dst_offset"), [(0, 32), (32, 0)])
def test_offsets_disable_coalescing(src_offset: int, dst_offset: int) -> None:
    s, d = page_region(0x10000), page_region(0x90000)
    half = Plan((RegionPlan(s, d, src_offset, dst_offset, PAGE // 2, True),))
    result = descs_of(descriptors(half, [[4, 5, 6]], [[0, 1, 2]]))
    assert triples(result) == [
        (0x10000 + b * PAGE + src_offset, 0x90000 + (b - 4) * PAGE + dst_offset, PAGE // 2)
        for b in (4, 5, 6)
    ]


def test_tp_ratio_plan_does_not_coalesce_contiguous_ids() -> None:
    g = Geometry(heads=8)
    plan = plan_of(prepare(g.side(2, 1), g.side(1, 0)))
    d = descs_of(descriptors(plan, [[0, 1, 2]], [[3, 4, 5]]))
    assert len(d) == 2 * g.LAYERS * 3


def test_kernel_blocks_stand_for_their_rows() -> None:
    """10.6.6: with q kernel blocks per block, block b of either side is rows b*q ... b*q+q-1;
    runs still need both sides' rows to step by +1, and P's last blocks are chosen first."""
    s, d = page_region(0x10000), page_region(0x90000)
    plan = Plan((RegionPlan(s, d, 0, 0, PAGE, True),), kernel_blocks=2)
    result = descs_of(descriptors(plan, [[9, 1, 2, 6]], [[3, 4, 7]]))
    assert triples(result) == [
        (0x10000 + 2 * PAGE, 0x90000 + 6 * PAGE, 4 * PAGE),  # rows 2-5 to rows 6-9
        (0x10000 + 12 * PAGE, 0x90000 + 14 * PAGE, 2 * PAGE),  # rows 12-13 to rows 14-15
    ]
    half = Plan((RegionPlan(s, d, 0, PAGE // 2, PAGE // 2, True),), kernel_blocks=2)
    result = descs_of(descriptors(half, [[5]], [[1]]))
    assert triples(result) == [
        (0x10000 + 10 * PAGE, 0x90000 + 2 * PAGE + PAGE // 2, PAGE // 2),
        (0x10000 + 11 * PAGE, 0x90000 + 3 * PAGE + PAGE // 2, PAGE // 2),
    ]


def test_state_space_groups_drop_null_blocks_on_both_sides() -> None:
    """10.6.3: in a group of state-space layers, block id 0 (the null block) is a placeholder on
    either side: left out before P's blocks are compared with D's, and never copied."""
    attention = (page_region(0x10000), page_region(0x90000))
    state = (page_region(0x20000, 1), page_region(0xA0000, 1))
    plan = dataclasses.replace(simple_plan(attention, state), mamba_groups=frozenset({1}))
    d = descs_of(descriptors(plan, [[1, 2], [0, 7]], [[5, 6], [0, 0, 9]]))
    assert triples(d) == [
        (0x10000 + 1 * PAGE, 0x90000 + 5 * PAGE, 2 * PAGE),
        (0x20000 + 7 * PAGE, 0xA0000 + 9 * PAGE, PAGE),
    ]
    without = descriptors(simple_plan(attention, state), [[1, 2], [0, 7]], [[5, 6], [0, 0, 9]])
    assert isinstance(without, PlanError) and without.code is ErrorCode.P_BLOCKS_LESS_THAN_D
    only_nulls = descs_of(descriptors(plan, [[1, 2], [0, 0]], [[5, 6], [0]]))
    assert triples(only_nulls) == [(0x10000 + 1 * PAGE, 0x90000 + 5 * PAGE, 2 * PAGE)]


def test_prepare_takes_the_state_space_groups_of_p() -> None:
    side = Side(1, 0, 1, (page_region(0x10000),), mamba_groups=frozenset({1}))
    plan = prepare(side, Side(1, 0, 1, (page_region(0x90000),)))
    assert isinstance(plan, Plan) and plan.mamba_groups == frozenset({1})


def test_shared_region_takes_groups_blocks_together_in_group_order() -> None:
    plan = simple_plan(
        (page_region(0x10000, -1, (2, 0)), page_region(0x90000, -1, (0, 2))),
        (page_region(0x20000, 1), page_region(0xA0000, 1)),
    )
    d = descs_of(descriptors(plan, [[1], [2], [3, 4]], [[11], [12], [20, 13]]))
    assert triples(d) == [
        (0x10000 + 1 * PAGE, 0x90000 + 11 * PAGE, PAGE),
        (0x10000 + 3 * PAGE, 0x90000 + 20 * PAGE, PAGE),
        (0x10000 + 4 * PAGE, 0x90000 + 13 * PAGE, PAGE),
        (0x20000 + 2 * PAGE, 0xA0000 + 12 * PAGE, PAGE),
    ]


def test_descriptors_keep_plan_order_across_groups_and_modes() -> None:
    half = dataclasses.replace(page_region(0x30000), kv_block_len=PAGE // 2)
    plan = Plan(
        (
            RegionPlan(page_region(0x10000, 1), page_region(0x90000, 1), 0, 0, PAGE, True),
            RegionPlan(half, page_region(0xB0000), 0, 0, PAGE // 2, True),
            RegionPlan(page_region(0x20000), page_region(0xA0000), 0, 0, PAGE, True),
            RegionPlan(page_region(0x40000, 1), page_region(0xC0000, 1), 0, 0, PAGE, True),
        )
    )
    d = descs_of(descriptors(plan, [[1, 2], [5, 6]], [[3, 4], [7, 8]]))
    assert triples(d) == [
        (0x10000 + 5 * PAGE, 0x90000 + 7 * PAGE, 2 * PAGE),
        (0x30000 + 1 * PAGE, 0xB0000 + 3 * PAGE, PAGE // 2),
        (0x30000 + 2 * PAGE, 0xB0000 + 4 * PAGE, PAGE // 2),
        (0x20000 + 1 * PAGE, 0xA0000 + 3 * PAGE, 2 * PAGE),
        (0x40000 + 5 * PAGE, 0xC0000 + 7 * PAGE, 2 * PAGE),
    ]


def test_addresses_above_2_63() -> None:
    top = 0xFFFF_0000_0000_0000
    plan = simple_plan((page_region(top), page_region(top + 0x1000_0000)))
    d = descs_of(descriptors(plan, [[1, 2]], [[5, 6]]))
    assert triples(d) == [(top + PAGE, top + 0x1000_0000 + 5 * PAGE, 2 * PAGE)]


def test_descriptors_concat_and_empty() -> None:
    a = descs_of(descriptors(ONE, [[1, 2]], [[5, 6]]))
    b = descs_of(descriptors(ONE, [[7]], [[9]]))
    joined = Descriptors.concat([a, Descriptors.empty(), b])
    assert triples(joined) == triples(a) + triples(b)
    assert joined.total_bytes == 3 * PAGE
    assert len(Descriptors.concat([])) == 0


# -- property: vectorised descriptors == per-block reference ----------------------------------


def reference(plan: Plan, src_blocks: list[list[int]], dst_blocks: list[list[int]]) -> list[Triple]:
    """The naive per-block loop of §10.6 and §10.8.12, one triple per block."""
    if all(not group for group in dst_blocks):
        return []
    chosen = [(s[len(s) - len(d) :], d) for s, d in zip(src_blocks, dst_blocks, strict=True)]
    out: list[Triple] = []
    for rp in plan.regions:
        if not rp.write:
            continue
        if rp.src.group_index >= 0:
            groups = [rp.src.group_index]
        else:
            groups = sorted(set(rp.src.shared_group_ids or rp.dst.shared_group_ids))
        for g in groups:
            for p_block, d_block in zip(*chosen[g], strict=True):
                src = rp.src.base_addr + p_block * rp.src.block_len + rp.src_offset
                dst = rp.dst.base_addr + d_block * rp.dst.block_len + rp.dst_offset
                out.append((src, dst, rp.length))
    return out


def chunks(items: Sequence[Triple], unit: int) -> list[Triple]:
    return [(s + k, d + k, unit) for s, d, n in items for k in range(0, n, unit)]


@st.composite
def region_plans(draw: st.DrawFn, groups: int) -> RegionPlan:
    unit = 16
    length = unit * draw(st.integers(1, 4))
    pad = draw(st.sampled_from([0, 0, unit]))
    group = draw(st.integers(-1, groups - 1))
    shared = tuple(draw(st.sets(st.integers(0, groups - 1), min_size=1))) if group < 0 else ()
    src_offset, dst_offset = draw(st.sampled_from([(0, 0), (0, 0), (unit, 0), (0, unit)]))
    bases = st.integers(0, 2**64 - 2**16)

    def make(base: int, offset: int) -> Region:
        return Region("l", 0, base, length + pad + offset, length, group, shared)

    src, dst = make(draw(bases), src_offset), make(draw(bases), dst_offset)
    return RegionPlan(src, dst, src_offset, dst_offset, length, draw(st.booleans()))


def block_ids(n: int) -> st.SearchStrategy[list[int]]:
    """``n`` block ids: mostly a run of consecutive ids, so that coalescing happens."""
    run = st.integers(0, 40).map(lambda start: list(range(start, start + n)))
    return run | st.lists(st.integers(0, 40), min_size=n, max_size=n)


@st.composite
def requests(draw: st.DrawFn) -> tuple[Plan, list[list[int]], list[list[int]]]:
    groups = draw(st.integers(1, 3))
    plan = Plan(tuple(draw(st.lists(region_plans(groups), max_size=5))))
    src_blocks, dst_blocks = [], []
    for _ in range(groups):
        n = draw(st.integers(0, 12))
        prefix = draw(st.lists(st.integers(0, 40), max_size=3))  # P's blocks D already holds
        src_blocks.append(prefix + draw(block_ids(n)))
        dst_blocks.append(draw(block_ids(n)))
    return plan, src_blocks, dst_blocks


@settings(max_examples=300, deadline=None)
@given(requests())
def test_vectorised_descriptors_equal_per_block_loop(
    request: tuple[Plan, list[list[int]], list[list[int]]],
) -> None:
    plan, src_blocks, dst_blocks = request
    expected = reference(plan, src_blocks, dst_blocks)
    got = triples(descs_of(descriptors(plan, src_blocks, dst_blocks)))
    unit = math.gcd(*(n for _, _, n in expected + got)) or 1
    assert chunks(got, unit) == chunks(expected, unit)
    assert len(got) <= len(expected)
