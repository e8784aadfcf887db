"""Consumer cases: how D's pulls travel and what they carry (§3.1, §3.2)."""

from __future__ import annotations

from typing import Final

import msgspec

from pdwire.codec import REGION_LISTS
from pdwire.planning import window_blocks
from pdwire.versions import ALL_CAPS, Capability

from ..case import Unsupported, expect, expect_equal
from ..peers.fake_p import Received
from .consumer_env import QUIET, ConsumerCtx, consumer_case

V2_PULL_KEYS: Final = frozenset(
    {"pdwire_version", "pdwire_caps", "fingerprint", "deadline_ms", "auth_tag"}
)


@consumer_case(
    "consumer/3.1/1",
    "3.1-R2",
    covers=("3.1-R3", "5.2-R3"),
)
async def each_pull_on_a_new_dealer(t: ConsumerCtx) -> None:
    """Each pull comes on a new DEALER as one frame, and nothing more follows on that socket."""
    fake = await t.fake_p()
    identities = []
    for _ in range(2):
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        expect(
            len(rx.frames) == 2,
            f"the pull reached P's ROUTER as {len(rx.frames)} frames (sizes "
            f"{[len(f) for f in rx.frames]}): D must send it as one frame",
        )
        identities.append(rx.identity)
        await fake.serve(rx)
        t.expect_decoded(await leg.result())
        more = await t.quiet(fake)
        expect(more is None, f"after the pull's terminal reply D sent {more and more.describe()}")
    expect(
        identities[0] != identities[1],
        "two pulls came on one socket (one ZMQ identity): D must open a new DEALER per pull",
    )


@consumer_case(
    "consumer/3.2/1",
    "3.2-R4",
    covers=("3.2-R1", "3.2-R2", "3.2-R8", "3.2-R10", "3.7-R1", "3.8-R3"),
)
async def pull_names_the_prompt_blocks(t: ConsumerCtx) -> None:
    """D's pull maps its request to the transfer_id it was given and one list of block ids per
    KV-cache group, as many as the prompt fills (as sent: nested lists, not the older flat
    variant); its region lists agree, and P's write reaches D at remote_hostname:remote_port."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    pull = rx.pull
    assert pull is not None
    d_req = rx.d_req(leg.transfer_id)
    sent = msgspec.msgpack.decode(rx.data)["req_blocks"][d_req][1]
    expect(
        all(isinstance(g, list) for g in sent),
        f"D sent the request's blocks as {sent!r}: the flat list of vLLM 0.16 to 0.19, not one "
        "list per KV-cache group",
    )
    _, groups = pull.req_blocks[d_req]
    expect(rx.with_layout, "D's first pull to a P worker carries no layout")
    n = len(pull.kv_caches_base_addr)
    for name in REGION_LISTS:
        values = getattr(pull, name)
        expect(len(values) in (0, n), f"{name} has {len(values)} entries for {n} regions")
    for i, (stride, payload) in enumerate(zip(pull.block_lens, pull.kv_block_lens, strict=False)):
        expect(payload <= stride, f"region {i}: kv_block_lens {payload} > block_lens {stride}")
    for i, offset in enumerate(pull.registered_row_offsets):
        row = pull.block_lens[i] if i < len(pull.block_lens) else None
        expect(
            offset == -1 or (offset >= 0 and (row is None or offset < row)),
            f"region {i}: registered_row_offsets {offset} is neither -1 nor inside its row",
        )
    kv_groups = {g for g in pull.registered_group_indices if g >= 0}
    kv_groups |= {g for ids in pull.registered_shared_group_ids for g in ids}
    expect_equal(len(groups), max(1, len(kv_groups)), "block lists (one per KV-cache group)")
    block_size = t.block_size(rx)
    if block_size is None:
        t.log.note("D's block size is unknown (no fingerprint, no --block-size): count not checked")
    else:
        want = -(-len(leg.prompt) // block_size)
        window = t.options.sliding_window
        for g, ids in enumerate(groups):
            if g == 1 and window is not None:  # the window group keeps its last blocks (10.4.7)
                want = min(want, window_blocks(window, block_size))
            expect(
                len(ids) == want,
                f"group {g} lists {len(ids)} blocks for a prompt of {len(leg.prompt)} tokens in "
                f"blocks of {block_size}: expected {want}",
            )
    for g, ids in enumerate(groups):
        expect(len(set(ids)) == len(ids), f"group {g} names a block twice: {ids}")
    expect(pull.layout_id == 0 or pull.layout_id % 2 == 1, f"layout_id {pull.layout_id} is not odd")
    await fake.serve(rx)
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/3.2/2",
    "3.2-R11",
    covers=("10.2.5",),
)
async def remote_pp_size_of_a_staged_d(t: ConsumerCtx) -> None:
    """A D of several PP stages says so in remote_pp_size (a D of one stage sends 1); together
    its stages' pulls name every layer of the model."""
    fake = await t.fake_p()
    leg = t.start(fake)
    pulls = [await t.pull(fake)]
    while (more := await fake.next(QUIET, lambda r: r.kind == "pull")) is not None:
        pulls.append(more)
    stages: dict[int, set[tuple[str, int]]] = {}
    layers: set[int] = set()
    for rx in pulls:
        host, port, rank = rx.sender
        stages.setdefault(rank, set()).add((host, port))
        assert rx.pull is not None
        layers |= set(rx.pull.registered_layer_indices)
    seen = max(len(s) for s in stages.values())
    fingerprint = next(
        (rx.pull.fingerprint for rx in pulls if rx.pull and rx.pull.fingerprint), None
    )
    total = fingerprint.num_layers if fingerprint is not None else None
    for rx in pulls:
        assert rx.pull is not None
        held = set(rx.pull.registered_layer_indices)
        staged = seen > 1 or (total is not None and bool(held) and len(held) < total)
        pp = rx.pull.remote_pp_size
        if staged:
            expect(
                pp > 1,
                f"D pulls from {seen} workers per TP rank, this one holding {len(held)} of "
                f"{total or '?'} layers, but its pull says remote_pp_size {pp}",
            )
        else:
            expect_equal(pp, 1, "remote_pp_size of a D of one stage")
        if seen > 1:
            expect_equal(pp, seen, "remote_pp_size (the D stages that pulled)")
    if total is not None and layers:
        expect(
            layers == set(range(total)),
            f"D's pulls name layers {sorted(layers)} of a model of {total}",
        )
    for rx in pulls:
        await fake.serve(rx)
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/3.2/3",
    "3.2-R12",
    covers=("3.2-R13", "3.4-R4", "3.7-R4", "3.7-R6", "9.3-R2", "3.8-R4"),
)
async def layout_until_echoed(t: ConsumerCtx) -> None:
    """D carries its layout in every pull to a P worker until that worker echoed D's layout_id
    in a FINISH (no echo, or another id, does not count); a pull that omits the layout leaves
    every region list empty and carries the layout_id."""
    fake = await t.fake_p()

    async def exchange(echo: int | None, carry: str = "") -> Received:
        """One request; ``carry``: why its pull must carry the layout."""
        leg = t.start(fake)
        rx = await t.pull_of(fake, leg)
        if carry:
            expect(rx.with_layout, f"D omitted its layout in a pull {carry}")
        fake.write(rx)
        await fake.reply(rx, ok=[rx.d_req(leg.transfer_id)], layout_id=echo)
        t.expect_decoded(await leg.result())
        return rx

    first = await exchange(0, "to a P worker it never pulled from")
    assert first.pull is not None
    layout_id = first.pull.layout_id
    # Not echoed, then echoed with another id: both times D must carry its layout again.
    await exchange(layout_id ^ 2 if layout_id else 0, "after a FINISH without an echo")
    await exchange(None, f"after a FINISH echoing another id than its {layout_id:#x}")
    if not layout_id:
        t.log.note("D sends layout_id 0: it carries its layout on every pull")
        return
    last = await exchange(None)
    assert last.pull is not None
    if last.with_layout:
        t.log.note("D carried its layout though P echoed it (allowed: 3.7-R6 is a MAY)")
        return
    for name in ("kv_caches_base_addr", *REGION_LISTS):
        expect(not getattr(last.pull, name), f"a pull that omits the layout still sends {name}")
    expect_equal(last.pull.layout_id, layout_id, "layout_id of a pull that omits the layout")


@consumer_case(
    "consumer/3.2/4",
    "3.2-R20",
    covers=("8.4-R1", "8.2-R3", "8.3-R1", "4.2-R11", "5.3-R4"),
)
async def legacy_pull_to_a_legacy_p(t: ConsumerCtx) -> None:
    """To a P whose /query entry has no pdwire_version (a legacy P), D's pull carries no pdwire/2
    field, even when the request's kv_transfer_params carry pdwire_version 2 (a pdwire/2
    proxy's, which says nothing of P's)."""
    fake = await t.fake_p(version=None)
    leg = t.start(fake, pdwire_version=2)
    rx = await t.pull(fake)
    await fake.serve(rx)
    extra = V2_PULL_KEYS & set(rx.keys)
    expect(not extra, f"D's pull to a legacy P carries the pdwire/2 fields {sorted(extra)}")
    t.expect_decoded(await leg.result())


@consumer_case(
    "consumer/3.2/5",
    "3.2-R14",
    covers=("3.2-R16", "3.2-R20", "8.5-R2"),
    risk=9,
)
async def announcing_pulls(t: ConsumerCtx) -> None:
    """A D that announces to a pdwire/2 P does so in every pull, with its capabilities by their
    exact names, and with its fingerprint in each pull that carries its layout when it announces
    fingerprint."""
    fake = await t.fake_p(tp=2)
    leg = t.start(fake)
    pulls = await t.all_pulls(fake, leg)
    for rx in pulls:
        await fake.serve(rx)
    t.expect_decoded(await leg.result())
    if not any(rx.announced for rx in pulls):
        for rx in pulls:
            extra = V2_PULL_KEYS & set(rx.keys)
            expect(not extra, f"D does not announce, yet its pull carries {sorted(extra)}")
        raise Unsupported("D does not announce pdwire/2 (a legacy D)")
    for rx in pulls:
        assert rx.pull is not None
        expect(rx.announced, f"D announced in one pull but not in its pull to {rx.addr}")
        caps = rx.pull.pdwire_caps
        for cap in caps:
            expect(
                cap.lower() not in ALL_CAPS or cap in ALL_CAPS,
                f"D announces {cap!r}: capabilities are the exact lower-case names",
            )
        if Capability.FINGERPRINT in caps and rx.with_layout:
            expect(
                rx.pull.fingerprint is not None,
                f"D announces fingerprint but its pull to {rx.addr}, which carries the layout, "
                "has none",
            )
