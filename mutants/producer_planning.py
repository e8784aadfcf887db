"""Mutants of how P places a pull's bytes (§10.6 to §10.8): each replaces one step of
``pdwire.planning``, which the producer session calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pdwire import planning
from pdwire import producer as producer_module
from pdwire.messages import ErrorCode
from pdwire.planning import PlanError, Region, RegionPlan, Side

from . import mutant, replace


@mutant(
    "no-shard-offsets",
    "prefill",
    "writes at offset 0 of both blocks when TP sizes differ",
    cases=(
        "producer/10.8/1",
        "producer/10.8/2",
        "producer/10.8/4",
    ),
)
def _no_shard_offsets() -> None:
    original = planning._place

    def place(i: int, src: Region, dst: Region, shards: Any) -> Any:
        placed = original(i, src, dst, shards)
        if isinstance(placed, RegionPlan):
            return dataclasses.replace(placed, src_offset=0, dst_offset=0)
        return placed

    replace(planning, "_place", place)


@mutant(
    "no-length-check",
    "prefill",
    "serves regions whose lengths do not fit the TP ratio",
    cases=(
        "producer/10.8/3",
        "producer/10.9/1",
    ),
)
def _no_length_check() -> None:
    original = planning._place

    def place(i: int, src: Region, dst: Region, shards: Any) -> Any:
        placed = original(i, src, dst, shards)
        if isinstance(placed, PlanError) and placed.code is ErrorCode.REGION_LENGTH:
            length = min(src.kv_block_len, dst.kv_block_len or src.kv_block_len)
            return RegionPlan(src, dst, 0, 0, length, shards.write)
        return placed

    replace(planning, "_place", place)


@mutant(
    "aligns-by-position",
    "prefill",
    "pairs its regions with D's by position, not by name",
    cases=("producer/10.7/1",),
)
def _aligns_by_position() -> None:
    original = planning._align

    def align(producer: Side, consumer: Side) -> Any:
        if len(producer.regions) == len(consumer.regions):
            return list(zip(producer.regions, consumer.regions, strict=True))
        return original(producer, consumer)

    replace(planning, "_align", align)


@mutant(
    "no-alignment-check",
    "prefill",
    "never compares the layer and group of aligned regions",
    cases=("producer/10.7/2",),
)
def _no_alignment_check() -> None:
    replace(planning, "_mismatch", lambda src, dst: None)


@mutant(
    "first-blocks-on-prefix-hit",
    "prefill",
    "sends its first n blocks, not its last n",
    cases=("producer/10.6/1",),
)
def _first_blocks_on_prefix_hit() -> None:
    original = planning._select

    def select(src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> Any:
        if len(src) == len(dst):
            src = [
                list(s)[: len(d)] if len(s) >= len(d) else s for s, d in zip(src, dst, strict=True)
            ]
        return original(src, dst)

    replace(planning, "_select", select)


@mutant(
    "pp-aligns-exact",
    "prefill",
    "aligns the exact layer sets whatever the PP sizes",
    cases=("producer/10.2/1",),
)
def _pp_aligns_exact() -> None:
    original = planning._align

    def align(producer: Side, consumer: Side) -> Any:
        return original(producer, dataclasses.replace(consumer, pp_size=producer.pp_size))

    replace(planning, "_align", align)


@mutant(
    "replicas-all-write",
    "prefill",
    "every P rank that holds a replica of the KV writes it, not only the first of each group",
    cases=("producer/10.8/5",),
)
def _replicas_all_write() -> None:
    original = planning._shards

    def shards(producer: Side, consumer: Side) -> Any:
        return dataclasses.replace(original(producer, consumer), write=True)

    replace(planning, "_shards", shards)


@mutant(
    "coalesces-slices",
    "prefill",
    "writes runs of blocks with one descriptor also when a slice is not a whole block",
    cases=(
        "producer/10.8/1",
        "producer/10.8/2",
        "producer/10.8/4",
    ),
)
def _coalesces_slices() -> None:
    replace(planning, "_coalesces", lambda rp: True)


@mutant(
    "runs-by-source-only",
    "prefill",
    "writes a run of P's consecutive blocks with one descriptor whatever D's block ids are",
    cases=("producer/10.8/6",),
)
def _runs_by_source_only() -> None:
    original = planning._runs

    def runs(src: Any, dst: Any) -> Any:
        return original(src, src - src[:1] + dst[:1])

    replace(planning, "_runs", runs)


@mutant(
    "blocks-as-kernel-blocks",
    "prefill",
    "takes each block id for one kernel block when a block holds several",
    cases=("producer/10.6/2",),
)
def _blocks_as_kernel_blocks() -> None:
    original = planning.descriptors

    def descriptors(plan: planning.Plan, src: Any, dst: Any) -> Any:
        return original(dataclasses.replace(plan, kernel_blocks=1), src, dst)

    replace(producer_module, "descriptors", descriptors)


@mutant(
    "window-unclipped",
    "prefill",
    "keeps, and sends, every block of a prompt in its sliding-window KV-cache group (10.4.7)",
    cases=("producer/10.4/4",),
)
def keep_every_block() -> None:
    """The node keeps every block of a prompt in each KV-cache group."""
    from pdwire.sim.geometry import Geometry

    replace(Geometry, "firsts", lambda self, prompt_blocks: [0] * self.num_groups)


@mutant(
    "keeps-null-blocks",
    "prefill",
    "compares and copies a state-space group's null-block placeholders like blocks (10.6.3)",
    cases=("producer/10.6/3",),
)
def _keeps_null_blocks() -> None:
    replace(planning, "_without_null_blocks", lambda blocks, groups: list(blocks))


@mutant(
    "widens-packed-rows",
    "prefill",
    "copies a slice at the start of a packed row as the whole row, though layers were skipped",
    cases=("producer/10.7/3",),
)
def _widens_packed_rows() -> None:
    original = planning._place

    def place(i: int, src: Region, dst: Region, shards: Any) -> Any:
        placed = original(i, src, dst, shards)
        if isinstance(placed, RegionPlan) and src.row_offset == 0 == dst.row_offset:
            return dataclasses.replace(placed, length=src.block_len)
        return placed

    replace(planning, "_place", place)


@mutant(
    "shared-region-one-group",
    "prefill",
    "copies a region its KV-cache groups share at the blocks of the first group only (10.6.7)",
    cases=("producer/10.6/4",),
)
def _shared_region_one_group() -> None:
    original = planning._shared_groups
    replace(planning, "_shared_groups", lambda rp: original(rp)[:1])
