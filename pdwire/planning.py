"""Transfer planning (spec §10.6-§10.8): which bytes of P's KV regions go where in D's.

Pure functions. ``prepare`` aligns P's regions with a pull's and fixes the byte placement of each
aligned pair, once per layout (the result is cached by the producer). ``descriptors`` turns the
block ids of one request into (src, dst, length) descriptors, vectorised with numpy, coalescing
runs of consecutive blocks into one descriptor when §10.8.13 allows it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from . import error_strings as es
from .messages import ErrorCode, XferMetadata

_U64 = npt.NDArray[np.uint64]
_T = TypeVar("_T")
#: The block id of vLLM's null block: a placeholder in a state-space group's list (10.6.3).
NULL_BLOCK_ID: Final = 0
_POSITIONAL: Final = "#"  # prefix of the names regions_of_pull gives unnamed regions


@dataclasses.dataclass(frozen=True)
class Region:
    """One registered KV region: a tensor view with one row per block."""

    layer_name: str
    layer_index: int
    base_addr: int
    block_len: int  # stride between consecutive blocks, bytes
    kv_block_len: int  # payload bytes per block (<= block_len)
    group_index: int = 0  # KV-cache group; -1 = packed region shared by several groups
    shared_group_ids: tuple[int, ...] = ()
    row_offset: int = -1  # byte offset inside its block row; -1 = not a packed-row view


@dataclasses.dataclass(frozen=True)
class Side:
    """One worker's parallel position and regions."""

    tp_size: int
    tp_rank: int
    pp_size: int
    regions: tuple[Region, ...]
    replicated: bool = False  # KV identical on every TP rank (MLA, or TP > KV heads)
    total_kv_heads: int | None = None
    kernel_blocks: int = 1  # kernel blocks per block (10.6.6); the regions' rows are these
    mamba_groups: frozenset[int] = frozenset()  # its KV-cache groups of state-space layers


@dataclasses.dataclass(frozen=True)
class PlanError:
    """Why a pull cannot be served: ``code`` and the exact §7.1 ``message``."""

    code: ErrorCode
    message: str


@dataclasses.dataclass(frozen=True)
class RegionPlan:
    """One aligned pair of regions and where its bytes go."""

    src: Region  # P's region
    dst: Region  # D's region
    src_offset: int  # byte offset inside P's block
    dst_offset: int  # byte offset inside D's block
    length: int  # bytes per block
    write: bool  # False: this P rank is a replica that sends nothing (§10.8.7)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one P worker serves pulls of one D layout."""

    regions: tuple[RegionPlan, ...]
    kernel_blocks: int = 1  # P's kernel blocks per block, which D's block ids share (10.6.6)
    mamba_groups: frozenset[int] = frozenset()  # P's groups of state-space layers (10.6.3)

    @functools.cached_property
    def _compiled(self) -> _Compiled:
        # Not a field: computed on first use and kept in the instance dict. The producer caches
        # the plan per layout, so this runs once per layout, not once per request.
        return _compile(self.regions)


@dataclasses.dataclass
class Descriptors:
    """The write of one round: parallel arrays of source address, destination address, length."""

    src: npt.NDArray[np.uint64]
    dst: npt.NDArray[np.uint64]
    length: npt.NDArray[np.uint64]

    def __len__(self) -> int:
        return len(self.length)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    @classmethod
    def empty(cls) -> Descriptors:
        return cls(_u64([]), _u64([]), _u64([]))

    @classmethod
    def concat(cls, parts: Sequence[Descriptors]) -> Descriptors:
        if not parts:
            return cls.empty()
        return cls(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.length for p in parts]),
        )


def _u64(values: Iterable[int] | npt.ArrayLike) -> _U64:
    return np.asarray(values, dtype=np.uint64)


# -- D's regions ------------------------------------------------------------------------------


def regions_of_pull(msg: XferMetadata) -> tuple[Region, ...]:
    """D's regions as its pull describes them (§3.2); unnamed regions (older variants) are named
    by their position so that alignment falls back to position (§10.7.2).

    Defaults for the per-region lists a pull leaves out (§3.8): layer name ``"#<position>"``,
    layer index = position, group 0, no shared groups, row offset -1 (not a packed-row view), and
    ``block_len`` / ``kv_block_len`` 0, meaning "not sent": ``prepare`` then takes D's lengths
    from P's aligned region, scaled by the head-shard ratio (P derives them from its own layout).
    A pull that omits its layout (§3.7) gives ``()``."""
    n = len(msg.kv_caches_base_addr)
    names = msg.registered_layer_names or [f"{_POSITIONAL}{i}" for i in range(n)]
    indices = msg.registered_layer_indices or list(range(n))
    groups = msg.registered_group_indices or [0] * n
    shared = msg.registered_shared_group_ids or [[]] * n
    offsets = msg.registered_row_offsets or [-1] * n
    strides = msg.block_lens or [0] * n
    payloads = msg.kv_block_lens or [0] * n
    return tuple(
        Region(
            layer_name=names[i],
            layer_index=indices[i],
            base_addr=msg.kv_caches_base_addr[i],
            block_len=strides[i],
            kv_block_len=payloads[i],
            group_index=groups[i],
            shared_group_ids=tuple(shared[i]),
            row_offset=offsets[i],
        )
        for i in range(n)
    )


def layout_of(regions: Sequence[Region]) -> dict[str, Any]:
    """The layout fields of a pull (§3.2) that describe ``regions``: what ``regions_of_pull``
    reads back."""
    return {
        "kv_caches_base_addr": [r.base_addr for r in regions],
        "block_lens": [r.block_len for r in regions],
        "kv_block_lens": [r.kv_block_len for r in regions],
        "registered_layer_names": [r.layer_name for r in regions],
        "registered_layer_indices": [r.layer_index for r in regions],
        "registered_group_indices": [r.group_index for r in regions],
        "registered_shared_group_ids": [list(r.shared_group_ids) for r in regions],
        "registered_row_offsets": [r.row_offset for r in regions],
    }


def window_blocks(window: int, block_size: int) -> int:
    """How many of a request's last blocks a sliding-window group transfers (10.4.7)."""
    return -(-window // block_size) + 1


def clip_window(blocks: Sequence[_T], window: int, block_size: int) -> Sequence[_T]:
    """A sliding-window group's blocks as P and D transfer them: the last
    ``window_blocks(window, block_size)`` (10.4.7)."""
    return blocks[-window_blocks(window, block_size) :]


def has_opaque_packed_row(regions: Sequence[Region]) -> bool:
    """Whether one of ``regions`` is an opaque packed row: a whole row at offset 0, registered
    under its first layer name (3.2-R10, 10.2.8)."""
    return any(r.row_offset == 0 and r.kv_block_len == r.block_len for r in regions)


# -- TP pairing -------------------------------------------------------------------------------


def target_ranks(local_tp: int, local_rank: int, remote_tp: int) -> list[int]:
    """The TP ranks of the other side that ``local_rank`` pairs with (§10.1).

    Raises ``ValueError`` when neither TP size divides the other (10.1.1) or the rank is out of
    range."""
    if local_tp < 1 or remote_tp < 1 or not 0 <= local_rank < local_tp:
        raise ValueError(f"invalid TP: rank {local_rank} of {local_tp}, remote size {remote_tp}")
    sizes = {"local_tp": local_tp, "remote_tp": remote_tp}
    if local_tp >= remote_tp:
        if local_tp % remote_tp:
            raise ValueError(es.TP_LOCAL_NOT_DIVISIBLE.format(**sizes))
        return [local_rank // (local_tp // remote_tp)]
    if remote_tp % local_tp:
        raise ValueError(es.TP_REMOTE_NOT_DIVISIBLE.format(**sizes))
    k = remote_tp // local_tp
    return [local_rank * k + i for i in range(k)]


# -- region alignment (§10.7) -----------------------------------------------------------------

_Pairs = list[tuple[Region, Region]]


def _alignment_error(message: str) -> PlanError:
    return PlanError(ErrorCode.LAYER_ALIGNMENT, message)


def _positional(regions: Sequence[Region]) -> bool:
    return bool(regions) and all(r.layer_name.startswith(_POSITIONAL) for r in regions)


def _by_occurrence(regions: Sequence[Region]) -> dict[tuple[str, int], Region]:
    """Regions keyed by (layer name, occurrence of that name), in their order."""
    counts: dict[str, int] = {}
    keyed: dict[tuple[str, int], Region] = {}
    for region in regions:
        occurrence = counts.get(region.layer_name, 0)
        counts[region.layer_name] = occurrence + 1
        keyed[region.layer_name, occurrence] = region
    return keyed


def _mismatch(src: Region, dst: Region) -> PlanError | None:
    """The first of the 10.7.3 disagreements between an aligned pair, if any."""
    name = src.layer_name
    if src.layer_index != dst.layer_index:
        return _alignment_error(
            es.LAYER_INDEX_MISMATCH.format(
                layer_name=name, producer=src.layer_index, consumer=dst.layer_index
            )
        )
    if src.group_index != dst.group_index:
        return _alignment_error(
            es.GROUP_INDEX_MISMATCH.format(
                layer_name=name, producer=src.group_index, consumer=dst.group_index
            )
        )
    p_shared, d_shared = src.shared_group_ids, dst.shared_group_ids
    if p_shared and d_shared and set(p_shared) != set(d_shared):
        return _alignment_error(
            es.SHARED_GROUP_MISMATCH.format(
                layer_name=name, producer=list(p_shared), consumer=list(d_shared)
            )
        )
    return None


def _align_by_name(
    producer: Sequence[Region], consumer: Sequence[Region], *, allow_partial: bool
) -> _Pairs | PlanError:
    """10.7.1, 10.7.3-6. Under ``allow_partial`` a P region is skipped only when D holds no
    region of its layer at all; a layer D holds but with fewer occurrences is still an error."""
    remote = _by_occurrence(consumer)
    pairs: _Pairs = []
    for (name, occurrence), src in _by_occurrence(producer).items():
        dst = remote.get((name, occurrence))
        if dst is None:
            if allow_partial and (name, 0) not in remote:
                continue
            return _alignment_error(
                es.NO_MATCHING_OCCURRENCE.format(layer_name=name, occurrence=occurrence)
            )
        if (error := _mismatch(src, dst)) is not None:
            return error
        pairs.append((src, dst))
    return pairs


def _count_mismatch(producer: Sequence[Region], consumer: Sequence[Region], pairs: _Pairs) -> bool:
    """Whether D holds more regions of the layers P holds than were aligned (10.8.11)."""
    held = {r.layer_name for r in producer}
    return sum(r.layer_name in held for r in consumer) != len(pairs)


def _align(producer: Side, consumer: Side) -> _Pairs | PlanError:
    p_regions, d_regions = producer.regions, consumer.regions
    if _positional(d_regions):
        if len(p_regions) != len(d_regions):
            return PlanError(ErrorCode.REGION_LENGTH, es.ASYMMETRIC_REGION_COUNT)
        return list(zip(p_regions, d_regions, strict=True))
    partial = producer.pp_size != consumer.pp_size
    pairs = _align_by_name(p_regions, d_regions, allow_partial=partial)
    if isinstance(pairs, PlanError):
        return pairs
    if producer.tp_size != consumer.tp_size and _count_mismatch(p_regions, d_regions, pairs):
        return PlanError(ErrorCode.REGION_LENGTH, es.ASYMMETRIC_REGION_COUNT)
    return pairs


def _shared_groups(rp: RegionPlan) -> tuple[int, ...]:
    """The groups whose blocks a shared (-1) region takes, in group order (10.6.7)."""
    return tuple(sorted(set(rp.src.shared_group_ids or rp.dst.shared_group_ids)))


# -- byte placement (§10.8) -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Shards:
    """Both sides' TP sizes and ranks counted in distinct head shards (10.8.9-10), and whether
    this P rank writes (10.8.7)."""

    p_size: int
    p_rank: int
    d_size: int
    d_rank: int
    write: bool


def _kv_heads(producer: Side, consumer: Side) -> int | None:
    heads = producer.total_kv_heads or consumer.total_kv_heads
    for s in (producer, consumer):
        # Identical on every rank though no head count explains it (MLA): a single shard.
        if s.replicated and (heads is None or heads >= s.tp_size):
            return 1
    return heads


def _capped(tp_size: int, heads: int | None) -> tuple[int, int]:
    """(distinct shards, ranks holding each shard) of a TP group over ``heads`` KV heads."""
    if heads is None:
        return tp_size, 1
    if tp_size <= heads:
        if heads % tp_size:
            raise ValueError(f"{heads} KV heads cannot be sharded over TP {tp_size}")
        return tp_size, 1
    if tp_size % heads:
        raise ValueError(f"TP {tp_size} is not a multiple of the {heads} KV heads")
    return heads, tp_size // heads


def _shards(producer: Side, consumer: Side) -> _Shards:
    heads = _kv_heads(producer, consumer)
    p_size, p_replicas = _capped(producer.tp_size, heads)
    d_size, d_replicas = _capped(consumer.tp_size, heads)
    write = True
    if producer.tp_size > consumer.tp_size:
        # Of the P ranks paired with one D rank, the first holding each shard writes it.
        ratio = producer.tp_size // consumer.tp_size
        write = producer.tp_rank % min(p_replicas, ratio) == 0
    p_rank, d_rank = producer.tp_rank // p_replicas, consumer.tp_rank // d_replicas
    return _Shards(p_size, p_rank, d_size, d_rank, write)


def _with_lengths(dst: Region, src: Region, shards: _Shards) -> Region:
    """D's region, with the lengths an older D did not send derived from P's (§3.8)."""
    if dst.block_len and dst.kv_block_len:
        return dst
    scale, div = shards.p_size, shards.d_size
    return dataclasses.replace(
        dst,
        block_len=dst.block_len or src.block_len * scale // div,
        kv_block_len=dst.kv_block_len or src.kv_block_len * scale // div,
    )


def _length_error(template: str, i: int, src: Region, dst: Region, **ratio: int) -> PlanError:
    message = template.format(i=i, local=src.kv_block_len, remote=dst.kv_block_len, **ratio)
    return PlanError(ErrorCode.REGION_LENGTH, message)


def _place(i: int, src: Region, dst: Region, s: _Shards) -> RegionPlan | PlanError:
    dst = _with_lengths(dst, src, s)
    lp, ld = src.kv_block_len, dst.kv_block_len
    if s.p_size == s.d_size:
        if lp != ld:
            return _length_error(es.REGION_LENGTH_HOMOGENEOUS, i, src, dst)
        return RegionPlan(src, dst, 0, 0, lp, s.write)
    if s.p_size > s.d_size:
        r = s.p_size // s.d_size
        if ld != r * lp:
            return _length_error(es.REGION_LENGTH_PRODUCER_RATIO, i, src, dst, tp_ratio=r)
        return RegionPlan(src, dst, 0, (s.p_rank % r) * lp, lp, s.write)
    k = s.d_size // s.p_size
    if lp != k * ld:
        # vLLM's ratio is negative when D's TP is the larger: its #6d prints it so.
        return _length_error(es.REGION_LENGTH_CONSUMER_RATIO, i, src, dst, tp_ratio=-k)
    return RegionPlan(src, dst, (s.d_rank % k) * ld, 0, ld, s.write)


def _pairing_error(producer: Side, consumer: Side) -> PlanError | None:
    expected = target_ranks(producer.tp_size, producer.tp_rank, consumer.tp_size)
    if consumer.tp_rank in expected:
        return None
    message = es.TP_RANK_NOT_PAIRED.format(
        d_tp_rank=consumer.tp_rank, p_tp_rank=producer.tp_rank, expected=expected
    )
    return PlanError(ErrorCode.TP_RANK_NOT_PAIRED, message)


def prepare(producer: Side, consumer: Side) -> Plan | PlanError:
    """Align P's regions with D's (§10.7) and place the bytes of each pair (§10.8).

    ``consumer`` is D as its pull describes it (``regions_of_pull``, D's TP size and rank,
    ``remote_pp_size``). D's regions named ``"#<position>"`` (a pull without layer names) are
    paired with P's by position, and only their counts are checked. Otherwise regions are
    aligned by (layer name, occurrence), skipping P's layers that D does not hold at all when the
    PP sizes differ. D regions that P does not hold are left out of the plan. Errors, first
    found first: D's TP rank not paired with P's (message #1), alignment (#4a-#4e), with
    different TP sizes D holding more regions of the shared layers than were aligned (#6a),
    and region lengths (#6b-#6d, region ``i`` = index of the aligned pair).

    Placement works in head shards: with ``total_kv_heads`` (P's, else D's) each TP size is
    capped at it and the ranks that hold the same heads count as one shard, so a replicated P
    writes each shard once (the first of the P ranks paired with a D rank that holds it). A side
    marked ``replicated`` without ``total_kv_heads``, or with no fewer heads than ranks (MLA),
    makes the cache a single shard: offsets 0, and only P ranks with ``P_rank % r == 0`` write.

    Pure and deterministic. Raises ``ValueError`` for impossible geometry: TP sizes that do not
    divide each other, or heads that do not shard over a TP size."""
    if (error := _pairing_error(producer, consumer)) is not None:
        return error
    pairs = _align(producer, consumer)
    if isinstance(pairs, PlanError):
        return pairs
    shards = _shards(producer, consumer)
    regions: list[RegionPlan] = []
    for i, (src, dst) in enumerate(pairs):
        placed = _place(i, src, dst, shards)
        if isinstance(placed, PlanError):
            return placed
        if placed.src.group_index < 0 and not _shared_groups(placed):
            return _alignment_error(es.SHARED_GROUP_METADATA)
        regions.append(placed)
    return Plan(tuple(regions), producer.kernel_blocks, producer.mamba_groups)


# -- descriptors (§10.6, §10.8.12-14) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The writing regions of a plan that take their blocks from one source and are addressed
    alike; per-region values are column vectors, so one broadcast addresses every block of
    every region."""

    source: int  # index into _Compiled.sources
    coalesce: bool
    src_start: _U64  # base address + offset
    src_stride: _U64
    dst_start: _U64
    dst_stride: _U64
    length: _U64


_SourceKey = tuple[bool, tuple[int, ...]]  # (a shared -1 region's, the groups it concatenates)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    sources: tuple[_SourceKey, ...]
    batches: tuple[_Batch, ...]
    batch_of: npt.NDArray[np.intp]  # per writing region, in plan order
    row_of: npt.NDArray[np.intp]  # its row in that batch
    in_order: bool  # the batches' rows, concatenated, are already in plan order


def _source(rp: RegionPlan) -> _SourceKey:
    group = rp.src.group_index
    return (False, (group,)) if group >= 0 else (True, _shared_groups(rp))


def _coalesces(rp: RegionPlan) -> bool:
    """10.8.13: runs of blocks may be written at once."""
    whole_block = rp.length == rp.src.block_len == rp.dst.block_len
    return rp.src_offset == 0 and rp.dst_offset == 0 and whole_block


def _column(values: Iterable[int]) -> _U64:
    return _u64(list(values)).reshape(-1, 1)


def _batch(source: int, coalesce: bool, members: Sequence[RegionPlan]) -> _Batch:
    return _Batch(
        source=source,
        coalesce=coalesce,
        src_start=_column(rp.src.base_addr + rp.src_offset for rp in members),
        src_stride=_column(rp.src.block_len for rp in members),
        dst_start=_column(rp.dst.base_addr + rp.dst_offset for rp in members),
        dst_stride=_column(rp.dst.block_len for rp in members),
        length=_column(rp.length for rp in members),
    )


def _compile(regions: Sequence[RegionPlan]) -> _Compiled:
    writing = [rp for rp in regions if rp.write]
    sources: dict[_SourceKey, int] = {}
    members: dict[tuple[int, bool], list[int]] = {}
    for i, rp in enumerate(writing):
        source = sources.setdefault(_source(rp), len(sources))
        members.setdefault((source, _coalesces(rp)), []).append(i)
    batch_of = np.zeros(len(writing), dtype=np.intp)
    row_of = np.zeros(len(writing), dtype=np.intp)
    for b, rows in enumerate(members.values()):
        batch_of[rows], row_of[rows] = b, np.arange(len(rows))
    order = [i for rows in members.values() for i in rows]
    return _Compiled(
        sources=tuple(sources),
        batches=tuple(_batch(s, c, [writing[i] for i in rows]) for (s, c), rows in members.items()),
        batch_of=batch_of,
        row_of=row_of,
        in_order=order == sorted(order),
    )


_Ids = tuple[_U64, _U64]  # P's and D's block ids, aligned


def _release_only(dst_blocks: Sequence[Sequence[int]]) -> bool:
    return all(len(group) == 0 for group in dst_blocks)


def _without_null_blocks(
    blocks: Sequence[Sequence[int]], groups: frozenset[int]
) -> list[Sequence[int]]:
    """10.6.3: ``blocks`` with the null-block placeholders of ``groups`` left out."""
    return [
        [b for b in ids if b != NULL_BLOCK_ID] if g in groups else ids
        for g, ids in enumerate(blocks)
    ]


def _select(
    src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]]
) -> list[_Ids] | PlanError:
    """10.6.2, 10.6.4-5: per group, P's last ``len(D)`` blocks beside D's."""
    if len(src_blocks) != len(dst_blocks):
        return PlanError(ErrorCode.KV_GROUP_COUNT_MISMATCH, es.KV_GROUP_COUNT_MISMATCH)
    selected: list[_Ids] = []
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        if len(src) < len(dst):
            return PlanError(ErrorCode.P_BLOCKS_LESS_THAN_D, es.P_BLOCKS_LESS_THAN_D)
        selected.append((_u64(src)[len(src) - len(dst) :], _u64(dst)))
    return selected


def _kernel_ids(ids: _Ids, q: int) -> _Ids:
    """10.6.6: each block id ``b`` of both sides as the kernel blocks ``b*q ... b*q+q-1``."""
    rows = np.arange(q, dtype=np.uint64)
    src, dst = ids
    return (
        (src[:, None] * np.uint64(q) + rows).ravel(),
        (dst[:, None] * np.uint64(q) + rows).ravel(),
    )


def _source_ids(selected: Sequence[_Ids], groups: tuple[int, ...]) -> _Ids:
    if len(groups) == 1:
        return selected[groups[0]]
    return (
        np.concatenate([selected[g][0] for g in groups]),
        np.concatenate([selected[g][1] for g in groups]),
    )


def _gather_ids(compiled: _Compiled, selected: Sequence[_Ids]) -> list[_Ids] | PlanError:
    n = len(selected)
    for shared, groups in compiled.sources:
        if shared and (not groups or groups[-1] >= n):
            return _alignment_error(es.SHARED_GROUP_METADATA)
        if groups[-1] >= n:
            return PlanError(ErrorCode.KV_GROUP_COUNT_MISMATCH, es.KV_GROUP_COUNT_MISMATCH)
    return [_source_ids(selected, groups) for _, groups in compiled.sources]


def _runs(src: _U64, dst: _U64) -> tuple[npt.NDArray[np.intp], _U64]:
    """Starts and lengths of the runs over which both id sequences step by +1."""
    n = len(src)
    bounds = np.ones(n + 1, dtype=bool)  # bounds[i]: a run ends before block i
    # uint64 differences wrap on a decrease, which is != 1 as wanted.
    bounds[1:n] = (src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)
    edges = np.flatnonzero(bounds)
    return edges[:-1], (edges[1:] - edges[:-1]).astype(np.uint64)


def _address(b: _Batch, ids: _Ids) -> tuple[_U64, _U64, _U64]:
    """2-D (region, block or run) arrays of source, destination and length."""
    src, dst = ids
    if b.coalesce:
        starts, lengths = _runs(src, dst)
        src, dst = src[starts], dst[starts]
        length = b.length * lengths[None, :]
    else:
        length = np.broadcast_to(b.length, (len(b.length), len(src)))
    return (
        b.src_start + src[None, :] * b.src_stride,
        b.dst_start + dst[None, :] * b.dst_stride,
        length,
    )


def _plan_order(compiled: _Compiled, shapes: Sequence[tuple[int, int]]) -> npt.NDArray[np.intp]:
    """Indices that put the batches' concatenated rows back in plan order."""
    cols = np.array([c for _, c in shapes], dtype=np.intp)
    sizes = np.array([r * c for r, c in shapes], dtype=np.intp)
    batch_start = np.cumsum(sizes) - sizes
    count = cols[compiled.batch_of]
    first = batch_start[compiled.batch_of] + compiled.row_of * count
    out_start = np.cumsum(count) - count
    return np.repeat(first - out_start, count) + np.arange(int(count.sum()), dtype=np.intp)


def _assemble(compiled: _Compiled, parts: Sequence[tuple[_U64, _U64, _U64]]) -> Descriptors:
    src, dst, length = (np.concatenate([p[k].ravel() for p in parts]) for k in range(3))
    if not compiled.in_order:
        order = _plan_order(compiled, [p[0].shape for p in parts])
        src, dst, length = src[order], dst[order], length[order]
    return Descriptors(src, dst, length)


def descriptors(
    plan: Plan, src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]]
) -> Descriptors | PlanError:
    """The descriptors that copy one request: block selection per group (§10.6), then one
    descriptor per run of consecutive blocks or per block (§10.8.12-14).

    ``src_blocks``: P's block ids per KV-cache group; ``dst_blocks``: D's, from the pull. In
    ``plan.mamba_groups`` both sides' null blocks are left out first (10.6.3). With
    ``plan.kernel_blocks`` q above 1, each selected id ``b`` of both sides stands for the region
    rows ``b*q ... b*q+q-1`` (10.6.6). A release-only request (no D blocks) gives no
    descriptors. Descriptors go region by region in plan order,
    blocks in order; regions that do not write (10.8.7) give none."""
    if _release_only(dst_blocks):
        return Descriptors.empty()
    if plan.mamba_groups:
        src_blocks = _without_null_blocks(src_blocks, plan.mamba_groups)
        dst_blocks = _without_null_blocks(dst_blocks, plan.mamba_groups)
    selected = _select(src_blocks, dst_blocks)
    if isinstance(selected, PlanError):
        return selected
    if plan.kernel_blocks > 1:
        selected = [_kernel_ids(ids, plan.kernel_blocks) for ids in selected]
    compiled = plan._compiled
    ids = _gather_ids(compiled, selected)
    if isinstance(ids, PlanError):
        return ids
    if not compiled.batches:
        return Descriptors.empty()
    return _assemble(compiled, [_address(b, ids[b.source]) for b in compiled.batches])
