"""Proxy cases: the bodies of the two legs (§5.1, §5.2, §5.4): kv_transfer_params, transfer_id,
what P's leg changes and D's leg keeps, and that both legs go out at once."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

from ..case import case, expect, expect_equal
from ..peers.backends import Hit
from .proxy_env import ProxyCtx

_XFER = re.compile(r"^xfer-(?P<uuid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$")
#: The slow P of 5.4-R7: D must get its leg well before P answers.
P_DELAY_S = 1.5


def expect_transfer_id(tid: Any, where: str) -> None:
    """``tid`` is "xfer-" and a random (version 4) UUID in its canonical form (5.4-R3)."""
    m = _XFER.match(tid) if isinstance(tid, str) else None
    expect(m is not None, f"{where} transfer_id {tid!r} is not xfer-<uuid>")
    assert m is not None
    u = uuid.UUID(m["uuid"])
    expect(
        u.version == 4 and u.variant == uuid.RFC_4122,
        f"{where} transfer_id {tid!r} is not a random UUID (version {u.version}, not 4)",
    )


def _without_params(body: Any) -> dict[str, Any]:
    return {k: v for k, v in (body or {}).items() if k != "kv_transfer_params"}


@case(
    "proxy/5.1/1",
    "5.1-R4",
    covers=("5.1-R1",),
)
async def no_internal_keys(t: ProxyCtx) -> None:
    """Neither leg's kv_transfer_params has a key beginning with "_", even when the client's
    request carries such keys; the P leg carries do_remote_decode true, do_remote_prefill false
    and a transfer_id."""
    body = t.body(kv_transfer_params={"_p_side_truncated": True, "_pdwire_probe": 1})
    _, p, d = await t.served(body)
    for leg, hit in (("P", p), ("D", d)):
        internal = sorted(k for k in hit.params if k.startswith("_"))
        expect(not internal, f"the {leg} leg's kv_transfer_params carry internal keys {internal}")
    expect_equal(p.params.get("do_remote_decode"), True, "the P leg's do_remote_decode")
    expect_equal(p.params.get("do_remote_prefill"), False, "the P leg's do_remote_prefill")
    expect("transfer_id" in p.params, f"the P leg has no transfer_id: {p.params}")


@case(
    "proxy/5.2/1",
    "5.2-R1",
)
async def d_leg_params(t: ProxyCtx) -> None:
    """The D leg carries do_remote_prefill true, do_remote_decode false, P's bootstrap server as
    remote_bootstrap_addr, the engine id of P's DP rank as remote_engine_id, and P's
    transfer_id."""
    for stream in (False, True):
        body = t.body(stream=stream)
        _, p, d = await t.served(body)
        dp = d.params
        expect_equal(dp.get("do_remote_prefill"), True, "the D leg's do_remote_prefill")
        expect_equal(dp.get("do_remote_decode"), False, "the D leg's do_remote_decode")
        expect_equal(
            str(dp.get("remote_bootstrap_addr", "")).rstrip("/"),
            t.world.bootstrap.url,
            "the D leg's remote_bootstrap_addr",
        )
        engines = t.world.bootstrap.engines
        rank = p.headers.get("x-data-parallel-rank", "")
        want = engines.get(int(rank)) if rank.isdigit() else None
        engine = dp.get("remote_engine_id")
        expect(
            engine == want if want is not None else engine in engines.values(),
            f"the D leg's remote_engine_id {engine!r} is not the engine id of the DP rank the P "
            f"leg went to (X-data-parallel-rank {rank or 'absent'}; /query: {engines})",
        )
        expect_equal(dp.get("transfer_id"), p.params.get("transfer_id"), "the D leg's transfer_id")


@case(
    "proxy/5.4/3",
    "5.4-R3",
)
async def transfer_id_minted_per_request(t: ProxyCtx) -> None:
    """Each client request gets a transfer_id of its own, "xfer-" and a random UUID."""
    seen: set[str] = set()
    for stream in (False, True, False):
        body = t.body(stream=stream)
        _, p, d = await t.served(body)
        tid = p.params.get("transfer_id")
        expect_transfer_id(tid, "the P leg's")
        expect_equal(d.params.get("transfer_id"), tid, "the D leg's transfer_id")
        expect(tid not in seen, f"transfer_id {tid} was given to two client requests")
        seen.add(str(tid))


@case(
    "proxy/5.4/4",
    "5.4-R4",
)
async def client_transfer_id_ignored(t: ProxyCtx) -> None:
    """A transfer_id in the client's kv_transfer_params is not used: both legs carry one the
    proxy minted."""
    theirs = f"xfer-{uuid.uuid4()}"
    body = t.body(kv_transfer_params={"transfer_id": theirs, "do_remote_decode": True})
    _, p, d = await t.served(body)
    for leg, hit in (("P", p), ("D", d)):
        tid = hit.params.get("transfer_id")
        expect(tid != theirs, f"the {leg} leg carries the client's transfer_id {theirs}")
        expect_transfer_id(tid, f"the {leg} leg's")


@case(
    "proxy/5.4/5",
    "5.4-R5",
)
async def p_leg_one_token_no_stream(t: ProxyCtx) -> None:
    """The P leg asks for one token (max_tokens, and max_completion_tokens when the client set
    it), without streaming and without stream_options."""
    bodies = [
        t.body(
            max_tokens=9,
            max_completion_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        ),
        t.body(max_tokens=5),
    ]
    for body in bodies:
        _, p, _ = await t.served(body)
        pb = p.body
        expect_equal(pb.get("max_tokens"), 1, "the P leg's max_tokens")
        if "max_completion_tokens" in body:
            expect_equal(pb.get("max_completion_tokens"), 1, "the P leg's max_completion_tokens")
        expect(
            pb.get("stream", False) is False,
            f"the P leg has stream {pb.get('stream')!r}, not false",
        )
        expect(
            "stream_options" not in pb,
            f"the P leg carries stream_options {pb.get('stream_options')!r}",
        )


@case(
    "proxy/5.4/6",
    "5.4-R6",
)
async def d_leg_passes_client_fields(t: ProxyCtx) -> None:
    """The D leg carries every field of the client's request unchanged, stream and
    stream_options included; only kv_transfer_params is the proxy's."""
    extra: dict[str, Any] = {
        "max_tokens": 7,
        "top_p": 0.5,
        "seed": 11,
        "stop": ["\n\n", "END"],
        "n": 1,
        "logprobs": None,
        "user": "pdwire-conformance",
        "pdwire_extension_field": {"nested": [1, 2, {"x": "y"}]},
    }
    for stream in (True, False):
        more = {"stream_options": {"include_usage": True}} if stream else {}
        body = t.body(**extra, stream=stream, **more)
        _, _, d = await t.served(body)
        expect_equal(_without_params(d.body), _without_params(body), "the D leg's body")


@case(
    "proxy/5.4/7",
    "5.4-R7",
    timeout=15.0,
)
async def legs_sent_at_once(t: ProxyCtx) -> None:
    """With a P that takes 1.5 s to answer, D receives its leg before P has answered."""
    t.world.p.delay = P_DELAY_S
    t.log.note(f"the fake P answers each completion {P_DELAY_S}s late")
    for stream in (False, True):
        body = t.body(stream=stream)
        reply = asyncio.create_task(t.complete(body))
        try:
            d = await t.leg(t.world.d, body, wait=P_DELAY_S + 3.0)
            p = await t.leg(t.world.p, body)
        finally:
            await reply
        _expect_before(p, d)


def _expect_before(p: Hit, d: Hit) -> None:
    answered = p.answered
    expect(
        answered is None or d.arrived < answered,
        f"D received its leg {d.arrived - p.arrived:.2f}s after P its leg, "
        f"{d.arrived - (answered or 0):.2f}s after P answered: the proxy waited for P",
    )
