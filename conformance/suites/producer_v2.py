"""Producer cases: what pdwire/2 adds (§3.5 XferCancel, §3.6 fingerprint, §6.2 deadline_ms,
§7.2 codes, §8 negotiation, §10.11 fixes). A case that needs a pdwire/2 P, or a capability P
did not announce, is unsupported against one that lacks it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from pdwire import error_strings
from pdwire.consumer import mint_layout_id
from pdwire.messages import KV_LAYOUT_NAMES, Fingerprint, XferResponseStatus, layout_named
from pdwire.versions import ALL_CAPS, Capability

from ..case import Unsupported, case, expect, expect_equal
from ..peers.fake_d import DWorker, PullResult
from .producer_env import ProducerCtx
from .producer_pairing import control, expect_slice, pull_each
from .producer_timers import DELIVERY, EXPIRY_BOUND, SLACK, expect_failed

FINISH, ERROR = XferResponseStatus.FINISH, XferResponseStatus.ERROR
MISS = XferResponseStatus.LAYOUT_MISS
V2_KEYS: Final = frozenset({"pdwire_version", "pdwire_caps", "err_code", "err_codes", "auth_tag"})
QUICK: Final = 1.0  # an answer due at once must come within this


@case(
    "producer/2.4/3",
    "2.4-R3",
    covers=("3.5-R6", "2.4-R2", "3.1-R7"),
)
async def undecodable_cancel(t: ProducerCtx) -> None:
    """A cancel P cannot decode (a wrong type, a TP rank not below the TP size) gets one ERROR
    reply with err_code BAD_MESSAGE, like an undecodable pull."""
    t.require_cap(Capability.CANCEL)
    worker = t.worker(1, 0)
    good: dict[str, Any] = {
        "pdwire_version": 2,
        "remote_hostname": worker.engine.hostname,
        "remote_port": worker.engine.port,
        "remote_tp_size": 1,
        "remote_tp_rank": 0,
        "cancel_reqs": {t.new_d_req(): t.new_transfer_id()},
    }
    bad = {
        "cancel_reqs an int": {**good, "cancel_reqs": 5},
        "remote_tp_rank == remote_tp_size": {**good, "remote_tp_rank": 1},
        "remote_pp_rank == remote_pp_size": {**good, "remote_pp_rank": 1},
    }
    results = await asyncio.gather(
        *(t.send(t.addr(), msgspec.msgpack.encode(m), linger_after=0.2) for m in bad.values())
    )
    for name, r in zip(bad, results, strict=True):
        expect(
            len(r.replies) == 1 and r.status is ERROR,
            f"{name}: expected one ERROR reply, got {r.describe()}",
        )
        assert r.terminal is not None
        expect_equal(r.terminal.err_code, "BAD_MESSAGE", f"{name}: err_code")


# -- fingerprint (§3.6) -----------------------------------------------------------------------


def differing(fp: Fingerprint) -> dict[str, Fingerprint]:
    """Fingerprints that differ from ``fp`` in one field each, in two, and by one byte."""
    out = {}
    for f in dataclasses.fields(fp):
        value = getattr(fp, f.name)
        other: Any = value + 1 if isinstance(value, int) else f"{value}-other"
        out[f.name] = dataclasses.replace(fp, **{f.name: other})
    out["model, num_layers"] = dataclasses.replace(
        fp, model=f"{fp.model}-other", num_layers=fp.num_layers + 1
    )
    out["model (a trailing space)"] = dataclasses.replace(fp, model=f"{fp.model} ")
    return out


def expect_names_fields(message: str, fields: list[str], what: str) -> None:
    at = [message.find(f) for f in fields]
    expect(
        all(i >= 0 for i in at) and at == sorted(at),
        f"{what}: err_msg {message!r} does not name {', '.join(fields)} in that order",
    )


async def mismatched_pulls(
    t: ProducerCtx, caps: Sequence[str] | None = None
) -> list[tuple[str, PullResult]]:
    """A pull for an unknown transfer with each differing fingerprint, answered at once."""
    assert t.env.fingerprint is not None
    worker = t.worker(1, 0)
    variants = differing(t.env.fingerprint)
    results = await asyncio.gather(
        *(
            t.pull(
                worker,
                t.addr(),
                {t.new_d_req(): (t.new_transfer_id(), [[0]])},
                announce=True,
                caps=caps,
                fingerprint=fp,
                timeout=QUICK,
            )
            for fp in variants.values()
        )
    )
    return list(zip(variants, results, strict=True))


@case(
    "producer/3.6/1",
    "3.6-R4",
    covers=("3.6-R1", "3.6-R3", "10.11.14", "3.4-R8", "3.3-R4", "10.4.1"),
    risk=9,
)
async def fingerprint_mismatch(t: ProducerCtx) -> None:
    """A pull whose fingerprint differs from P's in any field (a trailing space included) gets
    ERROR at once, before P waits for its transfer, with err_code FINGERPRINT_MISMATCH and an
    err_msg naming every differing field in declaration order."""
    t.require_cap(Capability.FINGERPRINT)
    for name, r in await mismatched_pulls(t):
        expect(r.status is ERROR, f"fingerprint differing in {name}: got {r.describe()}")
        assert r.terminal is not None
        expect_equal(r.terminal.err_code, "FINGERPRINT_MISMATCH", f"{name}: err_code")
        fields = [f.strip() for f in name.split("(")[0].split(",")]
        expect_names_fields(r.terminal.err_msg or "", fields, name)


@case(
    "producer/7.2/1",
    "7.2-R4",
    covers=("8.4-R7", "8.3-R3"),
)
async def no_fingerprint_code_unless_agreed(t: ProducerCtx) -> None:
    """To a pdwire/2 D that did not announce fingerprint, a fingerprint mismatch never carries
    the code FINGERPRINT_MISMATCH."""
    t.require_cap(Capability.FINGERPRINT)
    caps = sorted(ALL_CAPS - {Capability.FINGERPRINT.value})
    for name, r in await mismatched_pulls(t, caps):
        codes = {r.terminal.err_code if r.terminal else None}
        codes |= {c for m in r.decoded() for c in (m.err_codes or {}).values()}
        expect(
            "FINGERPRINT_MISMATCH" not in codes,
            f"{name}: FINGERPRINT_MISMATCH sent to a D without the capability: {r.describe()}",
        )


@case(
    "producer/3.6/2",
    "3.6-R7",
)
async def no_fingerprint_is_fine(t: ProducerCtx) -> None:
    """A pdwire/2 pull (fingerprint announced) that carries no fingerprint is served."""
    t.require_cap(Capability.FINGERPRINT)
    loaded = await t.load(announce=True, fingerprint=None)
    t.expect_loaded(loaded)
    t.release(loaded)


@case(
    "producer/3.6/4",
    "3.6-R11",
)
async def fingerprint_names_the_layout(t: ProducerCtx) -> None:
    """P's fingerprint names how its blocks lie with a name of §3.6.1, and a transfer into
    blocks that lie as that name says is served (the fake D lays its regions out by the name)."""
    t.require_cap(Capability.FINGERPRINT)
    fp = t.env.fingerprint
    assert fp is not None
    named = layout_named(fp.kv_layout)
    if named is None:
        raise Unsupported(
            f"P's fingerprint names its layout {fp.kv_layout!r}, a name outside §3.6.1 "
            f"({', '.join(KV_LAYOUT_NAMES.values())}): the harness cannot lay out such blocks"
        )
    expect(
        named == t.env.geometry.kv_layout,
        f"P's fingerprint names {fp.kv_layout!r} ({named}), the run was told --kv-layout "
        f"{t.env.geometry.kv_layout}",
    )
    loaded = await t.load(announce=True)
    t.expect_loaded(loaded)
    t.release(loaded)


@case(
    "producer/3.6/3",
    "3.6-R6",
    covers=("3.7-R11",),
)
async def mismatched_layout_not_cached(t: ProducerCtx) -> None:
    """A layout that came with a mismatching fingerprint is not cached: a later pull that omits
    it under the same layout_id gets LAYOUT_MISS."""
    t.require_cap(Capability.FINGERPRINT)
    assert t.env.fingerprint is not None
    worker = t.worker(1, 0)
    layout_id = mint_layout_id()
    wrong = differing(t.env.fingerprint)["dtype"]
    req = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
    r = await t.pull(
        worker, t.addr(), req, announce=True, fingerprint=wrong, layout_id=layout_id, timeout=QUICK
    )
    expect(r.status is ERROR, f"a mismatching fingerprint: expected ERROR, got {r.describe()}")
    r = await t.pull(
        worker, t.addr(), req, announce=True, with_layout=False, layout_id=layout_id, timeout=QUICK
    )
    expect(r.status is MISS, f"expected LAYOUT_MISS, got {r.describe()}")


# -- negotiation (§8) -------------------------------------------------------------------------


async def served_keys(t: ProducerCtx, worker: DWorker, **pull: Any) -> list[list[str]]:
    """A ready transfer pulled by ``worker`` from every P worker it pairs with: served; the
    top-level keys of every reply."""
    (tid,) = await t.ready(1)
    d_req, blocks = t.new_d_req(), worker.take(t.blocks_for())
    try:
        keys = []
        for addr in t.targets(worker):
            r = await t.pull(worker, addr, {d_req: (tid, [blocks])}, **pull)
            t.expect_ok(worker, addr, r, d_req)
            keys += [reply.keys for reply in r.replies]
            if pull.get("announce"):
                for m in r.decoded():
                    expect(m.pdwire_version >= 2, f"{addr}: a reply without pdwire_version")
        return keys
    finally:
        worker.give_back(blocks)


@case(
    "producer/8.2/1",
    "8.2-R4",
    covers=("8.3-R1", "3.4-R6"),
)
async def each_pull_negotiates_alone(t: ProducerCtx) -> None:
    """P answers each pull as that pull announced: a legacy pull after an announcing one from
    the same D worker gets legacy replies."""
    t.require_pdwire2()
    worker = t.worker(1, 0)
    await served_keys(t, worker, announce=True)
    for keys in await served_keys(t, worker):
        extra = V2_KEYS & set(keys)
        expect(not extra, f"a legacy pull after an announcing one got {sorted(extra)}")


def reply_caps(r: PullResult) -> list[list[str]]:
    return [list(m.pdwire_caps) for m in r.decoded()]


@case(
    "producer/8.1/1",
    "8.1-R2",
    covers=("3.4-R7", "8.1-R3"),
)
async def newer_d_gets_p_version(t: ProducerCtx) -> None:
    """A D announcing a version above P's is answered at P's own highest version."""
    t.require_pdwire2()
    loaded = await t.load(announce=True, pdwire_version=t.env.p_version + 1)
    t.expect_loaded(loaded)
    t.release(loaded)
    for _, addr, r in loaded.pulls:
        for m in r.decoded():
            expect_equal(m.pdwire_version, t.env.p_version, f"{addr}: pdwire_version")


@case(
    "producer/8.2/2",
    "8.2-R5",
    covers=("8.2-R1", "8.3-R2"),
)
async def unknown_caps_ignored(t: ProducerCtx) -> None:
    """A pull announcing a capability P does not know is served, and P's replies announce P's
    own capabilities, as its /query entry does, never the unknown one."""
    t.require_pdwire2()
    caps = sorted({*ALL_CAPS, "x-teleport"})
    loaded = await t.load(announce=True, pdwire_caps=caps)
    t.expect_loaded(loaded)
    t.release(loaded)
    own = sorted(t.env.entry.get("pdwire_caps") or [])
    for _, addr, r in loaded.pulls:
        for announced in reply_caps(r):
            expect_equal(sorted(announced), own, f"{addr}: the reply's pdwire_caps")


@case(
    "producer/8.5/1",
    "8.5-R2",
)
async def caps_are_exact_names(t: ProducerCtx) -> None:
    """P announces its capabilities as the exact lower-case names of §8.5, in its replies and
    in its /query entry."""
    t.require_pdwire2()
    loaded = await t.load(announce=True)
    t.release(loaded)
    seen = [list(t.env.entry.get("pdwire_caps") or [])]
    for _, addr, r in loaded.pulls:
        announced = reply_caps(r)
        expect(bool(announced), f"{addr}: no reply announced capabilities, got {r.describe()}")
        seen += announced
    for caps in seen:
        odd = sorted(set(caps) - ALL_CAPS)
        expect(not odd, f"capabilities that are not names of §8.5: {odd}")


# -- will-not-send (§7.2.1, §10.11.1) ---------------------------------------------------------


#: One round of pulls for a transfer P will not send: what they were, the request they named,
#: and (P worker, result) for each.
Round = tuple[str, str, list[tuple[str, PullResult]]]


async def stop_then_pull(t: ProducerCtx, **pull: Any) -> list[Round]:
    """Pulls wait for a transfer whose P leg then ends on a stop token as its only token; then
    pulls name it again, and then a release-only request under another id names it, as vLLM's
    D sends for a request its server answered with an error (10.11.10)."""
    worker = t.worker(1, 0)
    prompt, tid, d_req = t.prompt(), t.new_transfer_id(), t.new_d_req()
    await t.first_token(prompt)  # Unsupported before anything waits at P
    addrs = t.targets(worker)
    req = {d_req: (tid, [[0]])}
    wait = t.abort_timeout / 2
    pulls = [asyncio.create_task(t.pull(worker, a, req, timeout=wait, **pull)) for a in addrs]
    await asyncio.sleep(0.2)  # the pulls must be waiting at P: nothing to await from outside
    try:
        await t.stop_leg(tid, prompt)
    except BaseException:
        for task in pulls:
            task.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)
        raise
    waiting = await asyncio.gather(*pulls)
    later = await asyncio.gather(*(t.pull(worker, a, req, timeout=QUICK, **pull) for a in addrs))
    other = t.new_d_req()
    release: dict[str, tuple[str, list[list[int]]]] = {other: (tid, [])}
    released = await asyncio.gather(
        *(t.pull(worker, a, release, timeout=QUICK, **pull) for a in addrs)
    )
    return [
        ("a waiting pull", d_req, list(zip(addrs, waiting, strict=True))),
        ("a later pull", d_req, list(zip(addrs, later, strict=True))),
        ("a release-only request under another id", other, list(zip(addrs, released, strict=True))),
    ]


def expect_will_not_send(rounds: list[Round], code: str | None) -> None:
    for when, d_req, results in rounds:
        for addr, r in results:
            what = f"{when} to {addr}"
            expect_failed(r, d_req, what, {"WILL_NOT_SEND": error_strings.WILL_NOT_SEND})
            assert r.terminal is not None
            got = (r.terminal.err_codes or {}).get(d_req)
            expect_equal(got, code, f"{what}: err_codes[{d_req}]")


@case(
    "producer/10.11/3",
    "10.11.1",
    covers=("7.2-R5", "7.2-R7", "7.1-R3", "8.5-R1", "10.9.5", "10.11.10"),
    timeout=15.0,
    risk=1,
)
async def stop_token_answers_at_once(t: ProducerCtx) -> None:
    """When P's only token is a stop token, P will not send: the pulls waiting for the transfer,
    and later ones, get at once (not after T) the request in err_reqs with "Prefill will not
    send KV for this request." and, to a D that announced will-not-send, the code."""
    t.require_cap(Capability.WILL_NOT_SEND)
    expect_will_not_send(await stop_then_pull(t, announce=True), "WILL_NOT_SEND")


@case(
    "producer/7.2/3",
    "7.2-R6",
    covers=("7.2-R5", "8.5-R1", "10.11.15", "7.1-R3", "3.4-R6"),
    timeout=15.0,
    risk=1,
)
async def stop_token_to_legacy_d(t: ProducerCtx) -> None:
    """A legacy D waiting for a transfer P will not send gets a FINISH at once, with the request
    in err_reqs and no code."""
    t.require_cap(Capability.WILL_NOT_SEND)
    rounds = await stop_then_pull(t)
    expect_will_not_send(rounds, None)
    for _, r in (result for _, _, results in rounds for result in results):
        for reply in r.replies:
            expect(not V2_KEYS & set(reply.keys), "a reply to a legacy D has pdwire/2 fields")


@case(
    "producer/7.2/2",
    "7.2-R3",
    covers=("8.3-R2", "8.4-R7", "7.2-R2"),
    timeout=15.0,
)
async def no_will_not_send_code_unless_agreed(t: ProducerCtx) -> None:
    """To a pdwire/2 D that did not announce will-not-send, P lists the request in err_reqs
    with the same message and without the code WILL_NOT_SEND."""
    t.require_cap(Capability.WILL_NOT_SEND)
    caps = sorted(ALL_CAPS - {Capability.WILL_NOT_SEND.value})
    expect_will_not_send(await stop_then_pull(t, announce=True, caps=caps), None)


# -- duplicate transfer_ids (§10.11) ----------------------------------------------------------


@case(
    "producer/10.11/4",
    "10.11.10",
    covers=("10.11.9", "7.1-R4", "3.4-R16"),
)
async def duplicate_transfer_id_in_pulls(t: ProducerCtx) -> None:
    """A transfer_id is bound to the d_req_id of the first pull naming it: another D request
    naming it, in another pull or the same one, gets err_reqs with "Duplicate transfer_id ..."
    and the code DUPLICATE_TRANSFER_ID; the first is served."""
    t.require_pdwire2()
    (tid,) = await t.ready(1)
    first, second = t.new_d_req(), t.new_d_req()
    workers = t.d_workers(2 * t.p_tp)
    n = t.blocks_for()
    taken = {w: w.take(n) for w in workers}
    extra = {w: w.take(n) for w in workers}
    message = {"DUPLICATE_TRANSFER_ID": error_strings.DUPLICATE_TRANSFER_ID.format(transfer_id=tid)}
    try:
        by_rank = {w.side.tp_rank: w for w in workers}
        await pull_each(t, [by_rank[0]], tid, first, taken)
        w1 = by_rank[1]
        (addr,) = t.targets(w1)
        r = await t.pull(w1, addr, {second: (tid, [extra[w1]])}, announce=True, timeout=QUICK)
        expect_failed(r, second, "another d_req_id in another pull", message)
        assert r.terminal is not None
        expect_equal((r.terminal.err_codes or {}).get(second), "DUPLICATE_TRANSFER_ID", "code")
        expect(w1.stray_bytes() == 0, "P wrote for the duplicate request")
        await pull_each(t, [w1], tid, first, taken)
        for w in (w for w in workers if w.side.tp_rank >= 2):
            (addr,) = t.targets(w)
            reqs = {first: (tid, [taken[w]]), second: (tid, [extra[w]])}
            r = await t.pull(w, addr, reqs, announce=True)
            expect(
                r.status is FINISH and r.ok() == [first] and r.err() == [second],
                f"two requests of one pull naming {tid}: expected {first} ok and {second} "
                f"failed, got {r.describe()}",
            )
    finally:
        for w in workers:
            w.give_back(taken[w] + extra[w])


@case(
    "producer/10.11/5",
    "10.11.7",
    covers=("10.11.6", "5.1-R3"),
    risk=4,
)
async def duplicate_transfer_id_in_p_legs(t: ProducerCtx) -> None:
    """A second P request with the transfer_id of a ready one does not replace its send state:
    D's pulls get the first request's KV, the same bytes as a control transfer of its prompt."""
    t.require_pdwire2()
    prompt = t.prompt()
    full = await control(t, prompt)
    tid = t.new_transfer_id()
    t.expect_leg_ok(await t.prefill(tid, prompt=prompt))
    await t.prefill(tid)  # another prompt, the same transfer_id: P may fail this leg
    workers = t.d_workers()
    d_req = t.new_d_req()
    taken = {w: w.take(t.blocks_for(len(prompt))) for w in workers}
    try:
        await pull_each(t, workers, tid, d_req, taken)
        for w in workers:
            expect_slice(full, w, taken[w])
    finally:
        for w, blocks in taken.items():
            w.give_back(blocks)


# -- remote_pp_size, deadline_ms --------------------------------------------------------------


@case(
    "producer/10.11/6",
    "10.11.11",
    covers=("10.11.12", "10.4.1", "3.4-R8"),
)
async def missing_remote_pp_size(t: ProducerCtx) -> None:
    """A D stage that holds half the model's layers but sends no remote_pp_size gets ERROR with
    "Consumer registered {registered} of {total} layers but sent no remote_pp_size." and the
    code MISSING_REMOTE_PP_SIZE."""
    t.require_pdwire2()
    worker = t.worker(t.p_tp, 0, 2, 0)
    registered = len({r.layer_name for r in worker.regions})
    want = error_strings.MISSING_REMOTE_PP_SIZE.format(
        registered=registered, total=t.geometry.num_layers
    )
    req = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
    for announce in (False, True):
        r = await t.pull(worker, t.addr(), req, announce=announce, remote_pp_size=1, timeout=QUICK)
        what = "pdwire/2 pull" if announce else "legacy pull"
        expect(r.status is ERROR, f"{what}: expected ERROR, got {r.describe()}")
        assert r.terminal is not None
        expect_equal(r.terminal.err_msg, want, f"{what}: err_msg")
        if announce:
            expect_equal(r.terminal.err_code, "MISSING_REMOTE_PP_SIZE", f"{what}: err_code")


@case(
    "producer/6.3/1",
    "6.3-R5",
    covers=("7.1-R4", "6.3-R10"),
)
async def deadline_ms_is_honoured(t: ProducerCtx) -> None:
    """A pull with deadline_ms (deadline announced) for a transfer that is never sent ends at
    that deadline, long before T, with "Consumer deadline exceeded." and DEADLINE_EXCEEDED, at
    most 1 s after the deadline (6.3-R10) plus its way over loopback."""
    t.require_cap(Capability.DEADLINE)
    deadline = 0.3
    worker = t.worker(1, 0)
    req = {t.new_d_req(): (t.new_transfer_id(), [[0]])}
    (d_req,) = req
    r = await t.pull(
        worker,
        t.addr(),
        req,
        announce=True,
        deadline_ms=int(deadline * 1000),
        timeout=deadline + SLACK,
    )
    expect_failed(r, d_req, "the pull", {"DEADLINE_EXCEEDED": error_strings.DEADLINE_EXCEEDED})
    assert r.terminal is not None
    expect_equal((r.terminal.err_codes or {}).get(d_req), "DEADLINE_EXCEEDED", "err_codes")
    took = r.replies[-1].t
    latest = deadline + EXPIRY_BOUND + DELIVERY
    expect(
        deadline * 0.9 <= took <= latest,
        f"ended after {took:.2f}s: expected between {deadline * 0.9:.2f}s and {latest:.2f}s "
        f"(the {deadline:.2f}s deadline, at most {EXPIRY_BOUND:.1f}s late, 6.3-R10)",
    )


@case("producer/3.1/4", "3.1-R7", covers=("12.3-R1",))
async def two_kinds_in_one_message_are_refused(t: ProducerCtx) -> None:
    """A pull of a ready transfer that also carries the discriminator key of a cancel, or of a
    lease renewal, is of no one kind: P answers ERROR BAD_MESSAGE and acts on neither, and the
    transfer is then served to plain pulls."""
    t.require_pdwire2()
    (tid,) = await t.ready()
    worker = t.d_workers()[0]
    blocks = worker.take(t.blocks_for())
    try:
        pull = t.pull_map(worker, {t.new_d_req(): (tid, [blocks])}, announce=True)
        mixed = {
            "a cancel": {**pull, "cancel_reqs": {t.new_d_req(): tid}},
            "a lease renewal": {**pull, "lease_transfer_ids": [tid]},
        }
        for what, msg in mixed.items():
            r = await t.send(t.targets(worker)[0], msgspec.msgpack.encode(msg), linger_after=0.2)
            expect(
                len(r.replies) == 1 and r.status is ERROR,
                f"a pull with the key of {what}: expected one ERROR reply, got {r.describe()}",
            )
            assert r.terminal is not None
            expect_equal(r.terminal.err_code, "BAD_MESSAGE", f"a pull with the key of {what}")
        expect(
            len(worker.unwritten([blocks[0]])) == len(worker.regions),
            "P wrote the blocks of a message that is no one kind",
        )
    finally:
        worker.give_back(blocks)
    await t.serve_ready(tid)
