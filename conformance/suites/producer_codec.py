"""Producer cases: how P decodes a pull (chapter 2, §3.2, §3.8). Every pull is a real one of a
fake D worker, altered and packed by hand: what must be accepted must be served like any pull,
what must be rejected must get one ERROR reply (BAD_MESSAGE to a pull that announced pdwire/2)
and change nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

import msgspec

from pdwire.messages import XferResponseStatus

from ..case import case, expect, expect_equal
from ..peers.fake_d import DWorker
from ..peers.rawpack import Verbatim, Wide, pack
from .producer_env import ProducerCtx

ERROR = XferResponseStatus.ERROR
TOKENS: Final = 8  # two blocks: decode cases move little memory
MIB: Final = 1 << 20
Alter = Callable[[dict[str, Any]], bytes]


def _set(**fields: Any) -> Alter:
    return lambda m: pack({**m, **fields})


def _drop(*names: str) -> Alter:
    return lambda m: pack({k: v for k, v in m.items() if k not in names})


def _blocks(value: Any) -> Alter:
    """The first request's block lists replaced by ``value``."""

    def alter(m: dict[str, Any]) -> bytes:
        d_req, (tid, _) = next(iter(m["req_blocks"].items()))
        return pack({**m, "req_blocks": {d_req: [tid, value]}})

    return alter


# -- rejected ---------------------------------------------------------------------------------


async def expect_rejected(
    t: ProducerCtx, bad: dict[str, Alter], *, announced_too: bool = True
) -> None:
    """Each alteration of a pull gets exactly one ERROR reply with an err_msg (2.4-R1); the
    same alteration of a pull that announced pdwire/2 also gets err_code BAD_MESSAGE (2.4-R2)
    from a P that speaks pdwire/2. Then P still serves (7.3-R3)."""
    worker = t.worker(1, 0)
    sent: list[tuple[str, bool, bytes]] = []
    for name, alter in bad.items():
        req = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
        sent.append((name, False, alter(t.pull_map(worker, req))))
        if announced_too:
            sent.append((name, True, alter(t.pull_map(worker, req, announce=True))))
    results = await asyncio.gather(
        *(t.send(t.addr(), data, linger_after=0.2) for _, _, data in sent)
    )
    for (name, announced, _), r in zip(sent, results, strict=True):
        what = f"{name} ({'pdwire/2' if announced else 'legacy'} pull)"
        expect(
            len(r.replies) == 1 and r.status is ERROR,
            f"{what}: expected exactly one ERROR reply, got {r.describe()}",
        )
        assert r.terminal is not None
        expect(bool(r.terminal.err_msg), f"{what}: the ERROR reply has no err_msg")
        if announced and t.env.p_version >= 2:
            expect_equal(r.terminal.err_code, "BAD_MESSAGE", f"{what}: err_code")
    loaded = await t.load(tokens=TOKENS)
    t.expect_loaded(loaded)
    t.release(loaded)


@case(
    "producer/2.1/5",
    "2.1-R8",
    covers=("2.4-R1", "2.4-R2", "7.3-R3"),
)
async def missing_required_field(t: ProducerCtx) -> None:
    """A pull without one of its required fields is a decode error."""
    required = (
        "remote_hostname",
        "remote_port",
        "remote_tp_size",
        "remote_tp_rank",
        "req_blocks",
        "kv_caches_base_addr",
    )
    await expect_rejected(t, {f"no {name}": _drop(name) for name in required})


@case(
    "producer/2.2/1",
    "2.2-R1",
    covers=("2.4-R1", "2.4-R2"),
)
async def wrong_types(t: ProducerCtx) -> None:
    """A value of another MessagePack type than its field's is rejected, never converted."""
    # pdwire/2's fields are unknown keys to a legacy P, which ignores them (2.1-R9).
    v2_fields = (
        {
            "str for bin (auth_tag)": _set(auth_tag="00" * 32),
            "str for map (fingerprint)": _set(fingerprint="LBHNC"),
        }
        if t.env.p_version >= 2
        else {}
    )
    await expect_rejected(
        t,
        {
            **v2_fields,
            "str for int (remote_port)": _set(remote_port="5555"),
            "int for str (remote_hostname)": _set(remote_hostname=5),
            "array for map (req_blocks)": _set(req_blocks=[]),
            "int for array (kv_caches_base_addr)": _set(kv_caches_base_addr=7),
            "bool for int (remote_tp_size)": _set(remote_tp_size=True),
            "float for int (remote_tp_size)": _set(remote_tp_size=1.0),
            "int for str (layer names)": lambda m: pack(
                {**m, "registered_layer_names": list(range(len(m["kv_caches_base_addr"])))}
            ),
            "str for int (block id)": _blocks([["0"]]),
        },
    )


@case(
    "producer/2.2/2",
    "2.2-R2",
    covers=("2.4-R1", "2.4-R2"),
)
async def out_of_range_integers(t: ProducerCtx) -> None:
    """An integer outside its field's range is rejected."""
    await expect_rejected(
        t,
        {
            "remote_port 0": _set(remote_port=0),
            "remote_port 65536": _set(remote_port=65536),
            "remote_tp_size 0": _set(remote_tp_size=0),
            "remote_tp_rank -1": _set(remote_tp_rank=-1),
            "remote_pp_size 0": _set(remote_pp_size=0),
            "block id -1": _blocks([[-1]]),
            "layout_id 2**63": _set(layout_id=2**63),
            "base address -1": lambda m: pack(
                {**m, "kv_caches_base_addr": [-1] * len(m["kv_caches_base_addr"])}
            ),
            "group index -2": lambda m: pack(
                {**m, "registered_group_indices": [-2] * len(m["kv_caches_base_addr"])}
            ),
            "deadline_ms -1": _set(deadline_ms=-1),
        },
    )


@case(
    "producer/2.2/3",
    "2.2-R5",
    covers=("2.4-R1", "2.4-R2"),
)
async def non_str_keys(t: ProducerCtx) -> None:
    """A map key that is not a str is rejected, at the top level and inside req_blocks."""

    def int_d_req(m: dict[str, Any]) -> bytes:
        (tid, groups) = next(iter(m["req_blocks"].values()))
        return pack({**m, "req_blocks": {7: [tid, groups]}})

    await expect_rejected(
        t,
        {
            "int key at the top level": lambda m: pack({**m, 1: "x"}),
            "bin key at the top level": lambda m: pack({**m, b"remote_port": 1}),
            "int key in req_blocks": int_d_req,
        },
    )


@case(
    "producer/2.3/2",
    "2.3-R6",
    covers=("2.4-R1", "2.4-R2"),
)
async def nested_too_deep(t: ProducerCtx) -> None:
    """A value nested deeper than its type allows is a decode error."""
    await expect_rejected(
        t,
        {
            "array for a block id": _blocks([[[0]]]),
            "array for an address": lambda m: pack(
                {**m, "kv_caches_base_addr": [[a] for a in m["kv_caches_base_addr"]]}
            ),
            "array for the hostname": lambda m: pack({**m, "remote_hostname": [[["h"]]]}),
        },
    )


@case(
    "producer/2.3/4",
    "2.3-R9",
    covers=("2.4-R1",),
)
async def not_a_map(t: ProducerCtx) -> None:
    """A message whose top-level value is not a map, or that is no MessagePack at all, is a
    decode error."""
    await expect_rejected(
        t,
        {
            "an array": lambda m: pack(list(m.values())),
            "an int": lambda m: pack(2),
            "a str": lambda m: pack("remote_hostname"),
            "nil": lambda m: pack(None),
            "the reserved byte 0xc1": lambda m: b"\xc1",
            "no bytes": lambda m: b"",
        },
        announced_too=False,
    )


@case(
    "producer/2.3/3",
    "2.3-R8",
    covers=("2.4-R1", "2.4-R5", "7.3-R3"),
)
async def trailing_or_truncated(t: ProducerCtx) -> None:
    """A pull followed by more bytes, or cut short, is a decode error, and P acts on no part of
    it: the ready transfer it names is not written and stays for a valid pull."""
    (tid,) = await t.ready(1, TOKENS)
    worker = t.worker(1, 0)
    blocks = worker.take(t.blocks_for(TOKENS))
    try:
        d_req = t.new_d_req()
        data = pack(t.pull_map(worker, {d_req: (tid, [blocks])}))
        bad = {"a trailing nil": data + b"\xc0", "the last byte cut": data[:-1]}
        results = await asyncio.gather(
            *(t.send(a, b, linger_after=0.2) for b in bad.values() for a in t.targets(worker))
        )
        for r in results:
            expect(
                len(r.replies) == 1 and r.status is ERROR,
                f"expected exactly one ERROR reply, got {r.describe()}",
            )
        written = len(worker.unwritten(blocks)) < len(worker.regions) * len(blocks)
        expect(not written, "P wrote the blocks of a pull it could not decode")
        for addr, r in zip(
            t.targets(worker),
            await asyncio.gather(*(t.send(a, data) for a in t.targets(worker))),
            strict=True,
        ):
            t.expect_ok(worker, addr, r, d_req)
        t.expect_written(worker, blocks)
    finally:
        worker.give_back(blocks)


@case(
    "producer/3.2/1",
    "3.2-R3",
    covers=("3.2-R1", "3.2-R2", "2.4-R1", "2.4-R2"),
)
async def cross_field_rules(t: ProducerCtx) -> None:
    """A pull whose remote_tp_rank is not below remote_tp_size, or whose per-region lists are
    not one entry per region, is a decode error."""

    def short(name: str) -> Alter:
        return lambda m: pack({**m, name: m[name][:-1]})

    def long(name: str) -> Alter:
        return lambda m: pack({**m, name: [*m[name], m[name][0]]})

    await expect_rejected(
        t,
        {
            "remote_tp_rank == remote_tp_size": _set(remote_tp_rank=1),
            "block_lens one short": short("block_lens"),
            "kv_block_lens one long": long("kv_block_lens"),
            "registered_layer_names one short": short("registered_layer_names"),
            "registered_row_offsets one long": long("registered_row_offsets"),
        },
    )


@case(
    "producer/3.2/2",
    "3.2-R21",
)
async def payload_past_the_stride(t: ProducerCtx) -> None:
    """A pull that declares a region's payload one byte longer than its block stride is a
    decode error: served, it would have P write into the next block of D's region."""

    def past(m: dict[str, Any]) -> bytes:
        payloads = [m["block_lens"][0] + 1, *m["kv_block_lens"][1:]]
        return pack({**m, "kv_block_lens": payloads})

    await expect_rejected(t, {"kv_block_lens[0] = block_lens[0] + 1": past})


# -- accepted ---------------------------------------------------------------------------------


async def expect_served(
    t: ProducerCtx, variants: dict[str, Alter], *, announce: bool = False
) -> dict[str, list[list[Any]]]:
    """Each variant of a pull for its own transfer is served like any pull: FINISH with the
    request in ok_reqs and every block written. A D of TP 1 pulls from every P rank, so each
    transfer is settled. Returns each variant's replies' top-level keys.

    The pulls go with the P legs, not after them: P's ready wait and retention timer then run
    only for the time between the two, however long a large pull takes to reach P."""
    worker = t.worker(1, 0)
    tids = [t.new_transfer_id() for _ in variants]
    n = t.blocks_for(TOKENS)
    jobs: list[tuple[str, str, list[int], bytes]] = []
    try:
        for (name, alter), tid in zip(variants.items(), tids, strict=True):
            d_req, blocks = t.new_d_req(), worker.take(n)
            m = t.pull_map(worker, {d_req: (tid, [blocks])}, announce=announce)
            jobs.append((name, d_req, blocks, alter(m)))
        addrs = t.targets(worker)
        legs = [t.start_prefill(tid, TOKENS) for tid in tids]
        results = await asyncio.gather(*(t.send(a, j[3]) for j in jobs for a in addrs))
        for leg in await asyncio.gather(*legs):
            t.expect_leg_ok(leg)
        keys: dict[str, list[list[Any]]] = {}
        for i, (name, d_req, blocks, _) in enumerate(jobs):
            for addr, r in zip(addrs, results[i * len(addrs) : (i + 1) * len(addrs)], strict=True):
                expect(
                    r.status is not None and r.status.name == "FINISH" and d_req in r.ok(),
                    f"{name}: expected FINISH with {d_req} in ok_reqs from {addr}, "
                    f"got {r.describe()}",
                )
                keys.setdefault(name, []).extend(reply.keys for reply in r.replies)
            missing = worker.unwritten(blocks)
            expect(not missing, f"{name}: (region, block) never written: {missing[:8]}")
        stray = worker.stray_bytes()
        expect(stray == 0, f"{stray} bytes written outside the blocks asked for")
        return keys
    finally:
        for _, _, blocks, _ in jobs:
            worker.give_back(blocks)


@case(
    "producer/2.1/1",
    "2.1-R5",
)
async def fields_in_any_order(t: ProducerCtx) -> None:
    """A pull whose fields come in another order than the declaration order is served."""

    def reverse(m: dict[str, Any]) -> bytes:
        return pack(dict(reversed(m.items())))

    def rotate(m: dict[str, Any]) -> bytes:
        items = list(m.items())
        return pack(dict(items[3:] + items[:3]))

    await expect_served(t, {"reversed": reverse, "rotated by 3": rotate})


@case(
    "producer/2.1/2",
    "2.1-R7",
    covers=("2.1-R6", "3.2-R15", "8.1-R1", "3.4-R6"),
)
async def defaults_written_or_absent(t: ProducerCtx) -> None:
    """A pull that writes defaulted fields with their defaults (pdwire_version 0 or 1
    included) is served like one that leaves them out, and answered under the legacy
    profile."""
    defaults = {
        "remote_pp_size": 1,
        "layout_id": 0,
        "pdwire_caps": [],
        "fingerprint": None,
        "deadline_ms": 0,
        "auth_tag": None,
    }
    keys = await expect_served(
        t,
        {
            "defaults absent": pack,
            "defaults written, pdwire_version 0": _set(**defaults, pdwire_version=0),
            "defaults written, pdwire_version 1": _set(**defaults, pdwire_version=1),
        },
    )
    v2 = {"pdwire_version", "pdwire_caps", "err_code", "err_codes", "auth_tag"}
    for name, replies in keys.items():
        for reply_keys in replies:
            extra = v2 & set(reply_keys)
            expect(not extra, f"{name}: a reply to a pull that did not announce has {extra}")


@case(
    "producer/2.1/3",
    "2.1-R9",
)
async def unknown_keys_ignored(t: ProducerCtx) -> None:
    """Map keys P does not know, at the top level and inside the fingerprint, are ignored."""
    odd: dict[str, Any] = {
        "x_later_field": 1,
        "x_nested": {"a": [1, {"b": None}], "c": b"\x00"},
        "x_str": "future",
    }

    def in_fingerprint(m: dict[str, Any]) -> bytes:
        fp = m.get("fingerprint")
        return pack({**m, "fingerprint": {**fp, "x_future": 3}} if isinstance(fp, dict) else m)

    await expect_served(t, {"unknown top-level keys": _set(**odd)})
    if t.env.fingerprint is not None:
        await expect_served(t, {"an unknown fingerprint key": in_fingerprint}, announce=True)


@case(
    "producer/2.1/4",
    "2.1-R11",
)
async def every_header_width(t: ProducerCtx) -> None:
    """Pulls written with map, array and string headers of 16 and 32 bits and with integers
    of 64 bits are served."""

    def wide(m: dict[str, Any]) -> bytes:
        return pack(m, wide_ints=True)

    def wide_port(m: dict[str, Any]) -> bytes:
        return pack({**m, "remote_port": Wide(m["remote_port"])})

    await expect_served(
        t,
        {
            "fixmap": pack,
            "map 16": lambda m: pack(m, width=16),
            "map 32": lambda m: pack(m, width=32),
            "64-bit integers": wide,
            "map 32 and 64-bit integers": lambda m: pack(m, width=32, wide_ints=True),
            "one 64-bit integer": wide_port,
        },
    )


@case(
    "producer/2.3/1",
    "2.3-R1",
    timeout=20.0,
)
async def accepts_16_mib(t: ProducerCtx) -> None:
    """A pull of exactly 16 MiB (made long by an unknown key) is served."""

    def padded(m: dict[str, Any]) -> bytes:
        data = pack({**m, "x_padding": Verbatim(b"")})
        fill = 16 * MIB - len(data) - 5  # a bin 32 header is 5 bytes
        out = pack({**m, "x_padding": b"\x00" * fill})
        assert len(out) == 16 * MIB, len(out)
        return out

    await expect_served(t, {"16 MiB": padded})


@case(
    "producer/3.8/1",
    "3.8-R1",
    covers=("3.8-R2", "3.2-R5", "10.7.2", "10.6.1", "2.1-R6"),
)
async def older_variants_served(t: ProducerCtx) -> None:
    """Pulls of older vLLM releases are served: flat block lists, no block_lens or
    kv_block_lens, no layer metadata (regions by position), no remote_pp_size, no layout_id,
    and all of these at once."""

    def flat(m: dict[str, Any]) -> bytes:
        d_req, (tid, groups) = next(iter(m["req_blocks"].items()))
        return pack({**m, "req_blocks": {d_req: [tid, groups[0]]}})

    def oldest(m: dict[str, Any]) -> bytes:
        d_req, (tid, groups) = next(iter(m["req_blocks"].items()))
        drop = {"block_lens", "kv_block_lens", "remote_pp_size", "layout_id", *_LAYER_KEYS}
        kept = {k: v for k, v in m.items() if k not in drop}
        return pack({**kept, "req_blocks": {d_req: [tid, groups[0]]}})

    await expect_served(
        t,
        {
            "flat block lists": flat,
            "no block_lens, kv_block_lens": _drop("block_lens", "kv_block_lens"),
            "no layer metadata": _drop(*_LAYER_KEYS),
            "no remote_pp_size, layout_id": _drop("remote_pp_size", "layout_id"),
            "vLLM 0.16": oldest,
        },
    )
    await release_only_stays_empty(t, t.worker(1, 0))


_LAYER_KEYS: Final = (
    "registered_layer_names",
    "registered_layer_indices",
    "registered_group_indices",
    "registered_shared_group_ids",
    "registered_row_offsets",
)


async def release_only_stays_empty(t: ProducerCtx, worker: DWorker) -> None:
    """An empty block list is no flat list: the request is release-only, served with
    nothing written."""
    (tid,) = await t.ready(1, TOKENS)
    d_req = t.new_d_req()
    m = t.pull_map(worker, {d_req: (tid, [])})
    for addr in t.targets(worker):
        r = await t.send(addr, msgspec.msgpack.encode(m))
        t.expect_ok(worker, addr, r, d_req)
    stray = worker.stray_bytes()
    expect(stray == 0, f"a release-only request wrote {stray} bytes")


@case(
    "producer/2.3/5",
    "2.3-R2",
    timeout=30.0,
)
async def rejects_a_message_over_its_limit(t: ProducerCtx) -> None:
    """A pull one byte longer than P's size limit (made long by an unknown key) is answered
    with one `ERROR` and not served; P then serves pulls as before. Skipped unless the run is
    told P's limit (``--max-message-bytes``, or ``message_bytes`` in ``--limits``)."""
    limit = t.max_message_bytes
    worker = t.worker(1, 0)
    (tid,) = await t.ready(1, TOKENS)
    blocks = worker.take(t.blocks_for(TOKENS))
    try:
        m = t.pull_map(worker, {t.new_d_req(): (tid, [blocks])})
        data = pack({**m, "x_padding": Verbatim(b"")})
        fill = limit + 1 - len(data) - 5  # a bin 32 header is 5 bytes
        long = pack({**m, "x_padding": b"\x00" * fill})
        assert len(long) == limit + 1, len(long)
        r = await t.send(t.targets(worker)[0], long, linger_after=0.2)
        expect(
            len(r.replies) == 1 and r.status is XferResponseStatus.ERROR,
            f"a pull of {limit + 1} bytes: expected one ERROR reply, got {r.describe()}",
        )
        expect(
            len(worker.unwritten(blocks)) == len(worker.regions) * len(blocks),
            "P wrote KV for a pull over its size limit",
        )
    finally:
        worker.give_back(blocks)
    loaded = await t.load(d_tp=1)
    try:
        t.expect_loaded(loaded)
    finally:
        t.release(loaded)
