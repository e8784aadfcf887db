"""Proxy cases: the headers of the two legs (§5.4): X-Request-Id, X-data-parallel-rank,
Authorization."""

from __future__ import annotations

import uuid

from ..case import Skip, case, expect, expect_equal
from .proxy_env import ProxyCtx

DP_HEADER = "x-data-parallel-rank"


@case(
    "proxy/5.4/8",
    "5.4-R8",
)
async def same_request_id_on_both_legs(t: ProxyCtx) -> None:
    """Both legs of a request carry the same X-Request-Id, a random UUID, another one for each
    request."""
    seen: set[str] = set()
    for stream in (False, True):
        _, p, d = await t.served(t.body(stream=stream))
        rid = p.headers.get("x-request-id")
        expect(rid is not None, "the P leg has no X-Request-Id header")
        expect_equal(d.headers.get("x-request-id"), rid, "the D leg's X-Request-Id")
        try:
            uuid.UUID(str(rid))
        except ValueError:
            expect(False, f"X-Request-Id {rid!r} is not a UUID")
        expect(rid not in seen, f"X-Request-Id {rid} was sent for two client requests")
        seen.add(str(rid))


@case(
    "proxy/5.4/18",
    "5.4-R17",
)
async def transfer_id_not_from_request_id(t: ProxyCtx) -> None:
    """Neither leg's transfer_id holds the X-Request-Id of the request, whether the client
    sent one or the proxy minted it: a client sees that header, and must not learn from it a
    transfer_id that lets it pull or cancel another's KV."""
    theirs = str(uuid.uuid4())
    for headers in ({"X-Request-Id": theirs}, None):
        body = t.body()
        reply = await t.complete(body, headers=headers)
        expect(reply.status == 200, f"the proxy answered {reply.describe()}, not D's HTTP 200")
        p, d = await t.legs(body)
        rids = {theirs, p.headers.get("x-request-id"), d.headers.get("x-request-id")} - {None}
        for leg, hit in (("P", p), ("D", d)):
            tid = str(hit.params.get("transfer_id"))
            for rid in rids:
                expect(
                    str(rid).lower() not in tid.lower(),
                    f"the {leg} leg's transfer_id {tid} holds the X-Request-Id {rid}",
                )


@case(
    "proxy/5.4/9",
    "5.4-R9",
)
async def dp_rank_header_on_p_leg_only(t: ProxyCtx) -> None:
    """With a P of two DP ranks, each P leg carries X-data-parallel-rank naming the rank whose
    engine id the D leg names as remote_engine_id; no D leg carries the header."""
    engines = t.world.bootstrap.engines
    for _ in range(2 * len(engines)):
        _, p, d = await t.served(t.body())
        rank = p.headers.get(DP_HEADER)
        expect(rank is not None, "the P leg has no X-data-parallel-rank header")
        assert rank is not None
        expect(
            rank.isdigit() and int(rank) in engines,
            f"the P leg's X-data-parallel-rank {rank!r} is not a DP rank of P's /query answer "
            f"({sorted(engines)})",
        )
        expect_equal(
            d.params.get("remote_engine_id"),
            engines[int(rank)],
            f"the D leg's remote_engine_id for a P leg sent to DP rank {rank}",
        )
        expect(
            DP_HEADER not in d.headers,
            f"the D leg carries X-data-parallel-rank {d.headers.get(DP_HEADER)!r}",
        )


@case(
    "proxy/5.4/10",
    "5.4-R10",
    timeout=20.0,
)
async def authorization_with_key(t: ProxyCtx) -> None:
    """A proxy started with an API key sends Authorization: Bearer <key> on both legs."""
    if t.options.key_command is None:
        raise Skip("no --key-command: the harness cannot start the proxy with an API key")
    key = f"pdwire-key-{uuid.uuid4().hex}"
    w = await t.own_world(key=key)
    reply = await t.until_served(w)
    expect(reply.status == 200, f"the proxy with a key answered {reply.describe()}")
    _, p, d = await t.served(t.body(), w)
    for leg, hit in (("P", p), ("D", d)):
        expect_equal(
            hit.headers.get("authorization"), f"Bearer {key}", f"the {leg} leg's Authorization"
        )


@case(
    "proxy/5.4/11",
    "5.4-R11",
)
async def no_authorization_without_key(t: ProxyCtx) -> None:
    """A proxy without an API key sends no Authorization header on either leg."""
    for stream in (False, True):
        _, p, d = await t.served(t.body(stream=stream))
        for leg, hit in (("P", p), ("D", d)):
            expect(
                "authorization" not in hit.headers,
                f"the {leg} leg carries Authorization {hit.headers.get('authorization')!r} "
                "though the proxy has no key",
            )
