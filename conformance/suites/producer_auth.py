"""Producer cases of authentication (§8.6), for a P that shares a key with the harness
(``--auth-key-file``; skipped without one). The harness signs its pdwire/2 pulls and cancels with
the key unless a case says otherwise."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import msgspec

from pdwire import auth, error_strings

from ..case import case, expect, expect_equal
from ..peers.fake_d import DWorker, PullResult
from ..peers.http import request
from .producer_env import ProducerCtx, describe

#: The detail of a refused registration (4.1-R16).
AUTH_DETAIL = f"AUTH_FAILED: {error_strings.AUTH_FAILED}"


def _expect_auth_failed(r: PullResult, what: str, *, legacy: bool = False) -> None:
    """P answered ERROR "auth_tag missing or invalid." with err_code AUTH_FAILED (8.6-R7), or,
    to a ``legacy`` pull, with no pdwire/2 field at all (3.4-R6)."""
    reply = r.terminal
    expect(
        reply is not None and reply.status.name == "ERROR",
        f"{what}: expected ERROR, got {r.describe()}",
    )
    assert reply is not None
    expect_equal(reply.err_msg, error_strings.AUTH_FAILED, f"{what}: err_msg")
    if legacy:
        expect(
            reply.pdwire_version == 0 and reply.err_code is None and reply.auth_tag is None,
            f"{what}: the reply carries pdwire/2 fields, which a legacy D cannot decode",
        )
    else:
        expect_equal(str(reply.err_code), "AUTH_FAILED", f"{what}: err_code")


def _expect_untouched(worker: DWorker, blocks: list[int], what: str) -> None:
    expect(
        len(worker.unwritten(blocks)) == len(worker.regions) * len(blocks),
        f"{what}: P wrote into {describe(worker)}'s blocks for a message it had to refuse",
    )


async def _refused_then_served(t: ProducerCtx, tamper: Any, what: str) -> None:
    """A pull of a ready transfer, signed by ``tamper(msg)`` (unsigned: the message as it is),
    is refused with AUTH_FAILED and not acted on; signed pulls of it are then served."""
    _ = t.auth_key
    t.require_pdwire2()
    (tid,) = await t.ready()
    worker = t.d_workers()[0]
    blocks = worker.take(t.blocks_for())
    try:
        msg = worker.pull({t.new_d_req(): (tid, [blocks])}, **t.announce())
        data = t.encode(tamper(msg), True, signed=False)
        _expect_auth_failed(await t.send(t.targets(worker)[0], data), what)
        _expect_untouched(worker, blocks, what)
    finally:
        worker.give_back(blocks)
    await t.serve_ready(tid)


@case(
    "producer/8.6/1",
    "8.6-R7",
    covers=("8.6-R6",),
)
async def unsigned_pull_is_refused_and_not_acted_on(t: ProducerCtx) -> None:
    """An announcing pull without `auth_tag` is answered `ERROR` "auth_tag missing or invalid."
    with `AUTH_FAILED`, and nothing is written; signed pulls of the same transfer are then
    served."""
    await _refused_then_served(t, lambda msg: msg, "the unsigned pull")


@case(
    "producer/8.6/2",
    "8.6-R6",
    covers=("8.6-R7", "8.6-R2"),
)
async def pull_with_a_tag_over_other_content_is_refused(t: ProducerCtx) -> None:
    """A pull whose `auth_tag` is the tag of another message (a block id changed after
    signing) is refused like an unsigned one: P compares the tag with the one it computes over
    what it decoded."""

    def tampered(msg: Any) -> Any:
        signed = t.sign(msg)
        d_req, (tid, groups) = next(iter(signed.req_blocks.items()))
        moved = [[b + 1 for b in groups[0]]]
        return msgspec.structs.replace(signed, req_blocks={d_req: (tid, moved)})

    await _refused_then_served(t, tampered, "the pull with a tag over other content")


@case(
    "producer/8.6/3",
    "8.6-R5",
    covers=("3.4-R13", "8.6-R1", "8.6-R3", "8.6-R4", "8.6-R9", "8.6-R13"),
)
async def replies_are_signed(t: ProducerCtx) -> None:
    """A P with a key announces `auth` and signs every reply to a pdwire/2 D: its `auth_tag` is
    32 bytes, the HMAC-SHA256 of the reply's canonical encoding followed by the pull's tag, under
    the key."""
    key = t.auth_key
    t.require_cap("auth")
    loaded = await t.load(announce=True)
    try:
        t.expect_loaded(loaded)
        replies = [(m, r.sent_tag) for _, _, r in loaded.pulls for m in r.decoded()]
        expect(bool(replies), "P sent no reply")
        for reply, pull_tag in replies:
            expect("auth" in (reply.pdwire_caps or []), f"P's reply announces {reply.pdwire_caps}")
            tag = reply.auth_tag
            expect(tag is not None, f"P's {reply.status.name} reply carries no auth_tag")
            assert tag is not None
            expect_equal(len(tag), 32, "the length of auth_tag")
            expect(
                hmac.compare_digest(tag, auth.tag(reply, key, answers=pull_tag)),
                f"P's {reply.status.name} reply: auth_tag is not the tag of its canonical "
                "encoding and its pull's tag under the shared key",
            )
    finally:
        t.release(loaded)


@case(
    "producer/8.6/4",
    "8.6-R7",
    covers=("8.6-R6",),
)
async def unsigned_cancel_is_refused_and_not_acted_on(t: ProducerCtx) -> None:
    """An `XferCancel` without `auth_tag` is answered `ERROR` `AUTH_FAILED` and does not cancel:
    the transfer is still served to signed pulls."""
    _ = t.auth_key
    t.require_cap("cancel")
    (tid,) = await t.ready()
    worker = t.d_workers()[0]
    got = await t.cancel(worker, t.targets(worker)[0], {t.new_d_req(): tid}, signed=False)
    _expect_auth_failed(got, "the unsigned cancel")
    await t.serve_ready(tid)


async def _register(t: ProducerCtx, body: dict[str, Any]) -> Any:
    return await request(t.env.http, "POST", f"{t.options.bootstrap}/register", t.log, body=body)


def _own_registration(t: ProducerCtx) -> dict[str, Any]:
    """P's TP 0, PP 0 worker's registration as its /query entry shows it."""
    e = t.env.entry
    body: dict[str, Any] = {
        "engine_id": e["engine_id"],
        "dp_rank": t.env.dp_rank,
        "tp_rank": 0,
        "pp_rank": 0,
        "addr": t.addr(),
    }
    for field in ("pdwire_version", "pdwire_caps", "tp_size", "pp_size", "fingerprint"):
        if e.get(field) is not None:
            body[field] = e[field]
    return body


def key_id(key: bytes) -> str:
    """8.6-R15: the first 8 bytes of HMAC-SHA256("pdwire/2 key id"), in lower-case hex."""
    return hmac.new(key, b"pdwire/2 key id", hashlib.sha256).digest()[:8].hex()


def canonical_json(body: dict[str, Any]) -> bytes:
    """8.6-R11: sorted keys, no whitespace, non-ASCII as \\u escapes."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@case(
    "producer/8.6/5",
    "8.6-R16",
    covers=("4.1-R16",),
)
async def keyed_bootstrap_refuses_unsigned_registrations(t: ProducerCtx) -> None:
    """P's bootstrap server, keyed, answers a registration without `auth_tag`, or with a wrong
    one, HTTP 401 with the detail "AUTH_FAILED: auth_tag missing or invalid.", and registers
    nothing."""
    _ = t.auth_key
    before = await request(t.env.http, "GET", f"{t.options.bootstrap}/query", t.log)
    intruder = {**_own_registration(t), "dp_rank": 97, "engine_id": "harness-intruder"}
    for what, body in (
        ("without auth_tag", intruder),
        ("with a wrong auth_tag", {**intruder, "auth_tag": "00" * 32}),
    ):
        got = await _register(t, body)
        expect_equal(got.status, 401, f"the registration {what}: HTTP status")
        detail = got.body.get("detail") if isinstance(got.body, dict) else None
        expect_equal(detail, AUTH_DETAIL, f"the registration {what}: detail")
    after = await request(t.env.http, "GET", f"{t.options.bootstrap}/query", t.log)
    expect_equal(after.body, before.body, "GET /query after refused registrations")


@case(
    "producer/8.6/6",
    "8.6-R10",
    covers=("8.6-R11", "8.6-R15"),
)
async def keyed_bootstrap_accepts_a_signed_registration(t: ProducerCtx) -> None:
    """A registration signed as §8.6 says (lower-case hex HMAC-SHA256 of the canonical JSON of
    the body less `auth_tag`, the key named by `auth_key_id`), sent with its members in another
    order and with whitespace, is accepted: P's own worker registered again, which changes
    nothing."""
    key = t.auth_key
    body = {**_own_registration(t), "auth_key_id": key_id(key)}
    body["auth_tag"] = hmac.new(key, canonical_json(body), hashlib.sha256).hexdigest()
    raw = json.dumps(dict(reversed(list(body.items()))), indent=1)
    got = await request(
        t.env.http,
        "POST",
        f"{t.options.bootstrap}/register",
        t.log,
        content=raw.encode(),
        headers={"Content-Type": "application/json"},
    )
    expect(got.status == 200, f"the signed registration: HTTP {got.status} {got.body!r}")
    loaded = await t.load(announce=True)
    try:
        t.expect_loaded(loaded)
    finally:
        t.release(loaded)


@case("producer/8.6/7", "8.6-R14", covers=("8.6-R7", "3.4-R6"))
async def keyed_p_refuses_a_legacy_pull(t: ProducerCtx) -> None:
    """A pull that does not announce pdwire/2, and so carries no tag, is refused by a P with a
    key: `ERROR` "auth_tag missing or invalid." with no pdwire/2 field, and nothing written;
    signed pulls of the same transfer are then served."""
    _ = t.auth_key
    t.require_pdwire2()
    (tid,) = await t.ready()
    worker = t.d_workers()[0]
    blocks = worker.take(t.blocks_for())
    what = "the legacy pull"
    try:
        msg = worker.pull({t.new_d_req(): (tid, [blocks])})
        got = await t.send(t.targets(worker)[0], t.encode(msg, False))
        _expect_auth_failed(got, what, legacy=True)
        _expect_untouched(worker, blocks, what)
    finally:
        worker.give_back(blocks)
    await t.serve_ready(tid)


@case("producer/8.6/8", "8.6-R2", covers=("8.6-R6",))
async def map_keys_are_signed_sorted(t: ProducerCtx) -> None:
    """A signed pull of two requests whose ids are sent in descending order is served: P
    computes the tag over its `req_blocks` with the keys sorted, as the harness signed it, not
    in the order they came."""
    _ = t.auth_key
    t.require_pdwire2()
    tids = await t.ready(2)
    d_reqs = sorted((t.new_d_req() for _ in tids), reverse=True)
    taken = {w: [w.take(t.blocks_for()) for _ in tids] for w in t.d_workers()}
    try:
        for w, blocks in taken.items():
            req = {
                d: (tid, w.group_lists(b)) for d, tid, b in zip(d_reqs, tids, blocks, strict=True)
            }
            sent = list(w.pull(req, **t.announce()).req_blocks)
            expect_equal(sent, d_reqs, "the order of req_blocks as sent")
            for addr in t.targets(w):
                r = await t.pull(w, addr, req, announce=True)
                for d_req in d_reqs:
                    t.expect_ok(w, addr, r, d_req)
            for b in blocks:
                t.expect_written(w, b)
    finally:
        for w, blocks in taken.items():
            for b in blocks:
                w.give_back(b)


@case("producer/8.6/9", "8.6-R16", covers=("8.6-R15", "8.6-R7"))
async def pull_naming_no_key_is_refused(t: ProducerCtx) -> None:
    """A pull whose tag is right under the shared key but which names no key by its
    `auth_key_id` (none at all, or an id of no key P holds) is refused with `AUTH_FAILED` and
    not acted on; signed pulls of the same transfer are then served."""
    key = t.auth_key
    for what, key_id in (("without auth_key_id", None), ("naming an unknown key", "0" * 16)):

        def named(msg: Any, key_id: str | None = key_id) -> Any:
            unsigned = msgspec.structs.replace(msg, auth_key_id=key_id, auth_tag=None)
            return msgspec.structs.replace(unsigned, auth_tag=auth.tag(unsigned, key))

        await _refused_then_served(t, named, f"the pull {what}")
