"""Mutants of P's bootstrap server (§4), caught by the producer suite's bootstrap cases. The
server runs in the node's front process, which applies the mutant before it starts."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI

from pdwire import error_strings
from pdwire.http_models import EngineEntry, RegisterWorkerPayload
from reference_connector import bootstrap
from reference_connector.bootstrap import RegistrationRejected, Registry

from . import mutant, replace


@mutant(
    "register-no-validation",
    "prefill",
    "stores a registration body without validating it",
    cases=("producer/4.1/1",),
)
def _register_no_validation() -> None:
    def parse(raw: bytes, auth_key: bytes | None) -> RegisterWorkerPayload:
        return RegisterWorkerPayload.model_construct(**json.loads(raw))

    replace(bootstrap, "_parse_body", parse)


@mutant(
    "register-last-wins",
    "prefill",
    "a conflicting registration replaces the one held",
    cases=(
        "producer/4.1/4",
        "producer/4.1/5",
    ),
)
def _register_last_wins() -> None:
    original = Registry.register

    def register(self: Registry, p: RegisterWorkerPayload) -> None:
        engine = self.engines.get(p.dp_rank)
        if engine is not None and engine.engine_id != p.engine_id:
            del self.engines[p.dp_rank]
        elif engine is not None:
            engine.workers.get(p.tp_rank, {}).pop(p.pp_rank, None)
        original(self, p)

    replace(Registry, "register", register)


@mutant(
    "reregister-rejected",
    "prefill",
    "answers an identical re-registration with HTTP 400",
    cases=("producer/4.1/3",),
)
def _reregister_rejected() -> None:
    original = Registry.register

    def register(self: Registry, p: RegisterWorkerPayload) -> None:
        engine = self.engines.get(p.dp_rank)
        held = engine.workers.get(p.tp_rank, {}).get(p.pp_rank) if engine else None
        if held is not None and held.addr == p.addr:
            detail = error_strings.WORKER_ALREADY_REGISTERED.format(
                dp_rank=p.dp_rank,
                tp_rank=p.tp_rank,
                pp_rank=p.pp_rank,
                registered_addr=held.addr,
                addr=p.addr,
            )
            raise RegistrationRejected(400, detail)  # as vLLM before 0.33
        original(self, p)

    replace(Registry, "register", register)


@mutant(
    "query-swaps-ranks",
    "prefill",
    "lists worker_addr by pp_rank, then tp_rank",
    cases=(
        "producer/3.1/3",
        "producer/4.1/2",
    ),
)
def _query_swaps_ranks() -> None:
    original = bootstrap._Engine.entry

    def entry(self: Any) -> EngineEntry:
        e = original(self)
        swapped: dict[int, dict[int, str]] = {}
        for tp, by_pp in e.worker_addr.items():
            for pp, addr in by_pp.items():
                swapped.setdefault(pp, {})[tp] = addr
        return e.model_copy(update={"worker_addr": swapped})

    replace(bootstrap._Engine, "entry", entry)


@mutant(
    "query-drops-fields",
    "prefill",
    "leaves pdwire_caps and fingerprint out of /query",
    cases=("producer/4.1/6",),
)
def _query_drops_fields() -> None:
    original = bootstrap._Engine._announcement

    def announcement(self: Any) -> dict[str, Any]:
        out: dict[str, Any] = original(self)
        return {k: v for k, v in out.items() if k not in ("pdwire_caps", "fingerprint")}

    replace(bootstrap._Engine, "_announcement", announcement)


@mutant(
    "no-health",
    "prefill",
    "the bootstrap server has no GET /health",
    at_start=True,
    cases=("producer/4.3/1",),
)
def _no_health() -> None:
    original = bootstrap.create_app

    def create_app(**kwargs: Any) -> FastAPI:
        app = original(**kwargs)
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") != "/health"]
        return app

    replace(bootstrap, "create_app", create_app)


@mutant(
    "bootstrap-no-body-limit",
    "prefill",
    "reads a request body of any length",
    cases=("producer/4.1/7",),
)
def _bootstrap_no_body_limit() -> None:
    from reference_connector import body_limit

    async def call(self: body_limit.BodyLimit, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    replace(body_limit.BodyLimit, "__call__", call)
