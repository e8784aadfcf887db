"""The bootstrap server (spec §4): P workers register their side-channel address, D workers and the
proxy read every engine's entry.

Run in-process with ``BootstrapServer`` (uvicorn in a daemon thread), or from the command line
with ``pdwire bootstrap``. ``server_version=1`` emulates vLLM's server: pdwire/2 fields of a
registration are dropped, replies carry no ``pdwire_version`` and there is no ``/health``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdwire import error_strings as es
from pdwire import sections
from pdwire.auth import Keys, registration_is_signed
from pdwire.errors import DecodeError
from pdwire.http_models import (
    EngineEntry,
    QueryResponse,
    RegisterError,
    RegisterReply,
    RegisterWorkerPayload,
    decode_json,
)
from pdwire.limits import REFERENCE, exceeded
from pdwire.messages import ErrorCode
from pdwire.versions import CURRENT_VERSION, WIRE_VERSION

from .body_limit import REGISTER_BODY_LIMIT, BodyLimit
from .http_server import AppServer
from .metrics import CONTENT_TYPE, Counts, render

logger = logging.getLogger(__name__)

#: 401 detail of a registration without a valid tag (4.1-R16).
AUTH_FAILED_DETAIL: Final = f"AUTH_FAILED: {es.AUTH_FAILED}"
#: 400 detail when a registration's engine-wide pdwire/2 fields differ from those held (4.1-R14).
ENGINE_FIELDS_MISMATCH: Final = (
    "pdwire/2 fields of dp_rank={dp_rank} differ from those already registered: {fields}"
)
#: pdwire/2 fields that describe the whole engine; all of its workers must agree (4.1-R12).
ENGINE_FIELDS: Final = ("tp_size", "pp_size", "fingerprint")
LEGACY_VERSION: Final = WIRE_VERSION["legacy"]


# -- the registry ---------------------------------------------------------------------------


class RegistrationRejected(Exception):
    """A registration the server answers with an HTTP error."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class _Worker:
    addr: str
    version: int | None
    caps: list[str] | None


@dataclass
class _Engine:
    engine_id: str
    workers: dict[int, dict[int, _Worker]] = field(default_factory=dict)
    # tp_size, pp_size, fingerprint as the first worker that sent each gave it
    shared: dict[str, Any] = field(default_factory=dict)

    def entry(self) -> EngineEntry:
        addrs = {
            tp: {pp: w.addr for pp, w in sorted(by_pp.items())}
            for tp, by_pp in sorted(self.workers.items())
        }
        return EngineEntry(engine_id=self.engine_id, worker_addr=addrs, **self._announcement())

    def _announcement(self) -> dict[str, Any]:
        """pdwire/2 fields of the entry: only when every registered worker announced a version,
        so one legacy worker makes D speak legacy to the whole engine."""
        workers = [w for by_pp in self.workers.values() for w in by_pp.values()]
        if not workers or any(w.version is None for w in workers):
            return {}
        out: dict[str, Any] = {
            "pdwire_version": min(w.version for w in workers if w.version is not None),
            **self.shared,
        }
        if any(w.caps is not None for w in workers):
            first = workers[0].caps or []
            out["pdwire_caps"] = [c for c in first if all(c in (w.caps or []) for w in workers)]
        return out


class Registry:
    """Every registered engine, by ``dp_rank``. Not locked: the app mutates it only from the
    event loop, without awaiting between the checks and the update."""

    max_workers: int | None = None  # None: no limit, as vLLM's server

    def __init__(
        self, *, keep_pdwire_fields: bool = True, max_workers: int | None = REFERENCE.registrations
    ) -> None:
        self.engines: dict[int, _Engine] = {}
        self.keep_pdwire_fields = keep_pdwire_fields
        self.max_workers = max_workers
        self.workers = 0

    def register(self, p: RegisterWorkerPayload) -> None:
        """Store one worker (4.1-R4) or raise ``RegistrationRejected`` (4.1-R5, R6, R14,
        13.6-R1)."""
        known = self.engines.get(p.dp_rank)
        is_new = known is None or p.pp_rank not in known.workers.get(p.tp_rank, {})
        if is_new and self.max_workers is not None and self.workers >= self.max_workers:
            detail = exceeded("registrations", self.workers + 1, self.max_workers)
            raise RegistrationRejected(507, f"{ErrorCode.LIMIT_EXCEEDED}: {detail}")
        engine = self.engines.setdefault(p.dp_rank, _Engine(p.engine_id))
        if engine.engine_id != p.engine_id:
            raise RegistrationRejected(
                400,
                es.ENGINE_ID_MISMATCH.format(
                    dp_rank=p.dp_rank, registered_engine_id=engine.engine_id, engine_id=p.engine_id
                ),
            )
        shared = self._shared_fields(p)
        self._check_shared(engine, p.dp_rank, shared)
        by_pp = engine.workers.setdefault(p.tp_rank, {})
        held = by_pp.get(p.pp_rank)
        if held is not None and held.addr != p.addr:
            raise RegistrationRejected(
                400,
                es.WORKER_ALREADY_REGISTERED.format(
                    dp_rank=p.dp_rank,
                    tp_rank=p.tp_rank,
                    pp_rank=p.pp_rank,
                    registered_addr=held.addr,
                    addr=p.addr,
                ),
            )
        if held is None:  # an identical re-registration changes nothing (4.1-R7)
            by_pp[p.pp_rank] = self._worker(p)
            self.workers += 1
            engine.shared = {**shared, **engine.shared}

    def _worker(self, p: RegisterWorkerPayload) -> _Worker:
        if not self.keep_pdwire_fields:
            return _Worker(p.addr, None, None)
        return _Worker(p.addr, p.pdwire_version, p.pdwire_caps)

    def _shared_fields(self, p: RegisterWorkerPayload) -> dict[str, Any]:
        if not self.keep_pdwire_fields:
            return {}
        return {name: getattr(p, name) for name in ENGINE_FIELDS if getattr(p, name) is not None}

    @staticmethod
    def _check_shared(engine: _Engine, dp_rank: int, shared: dict[str, Any]) -> None:
        differing = [k for k, v in shared.items() if k in engine.shared and engine.shared[k] != v]
        if differing:
            raise RegistrationRejected(
                400, ENGINE_FIELDS_MISMATCH.format(dp_rank=dp_rank, fields=", ".join(differing))
            )

    def query(self) -> QueryResponse:
        return QueryResponse({dp: e.entry() for dp, e in sorted(self.engines.items())})


# -- the app ----------------------------------------------------------------------------------


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=RegisterError(detail=detail).dump())


def _parse_body(raw: bytes, auth_key: Keys | None) -> RegisterWorkerPayload:
    """Decode, authenticate, then validate a registration body."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise RegistrationRejected(422, _decode_error(f"invalid JSON: {exc}")) from None
    if not isinstance(body, dict):
        raise RegistrationRejected(422, _decode_error("the body must be a JSON object"))
    if auth_key is not None and not registration_is_signed(body, auth_key):
        raise RegistrationRejected(401, AUTH_FAILED_DETAIL)
    try:
        return decode_json(RegisterWorkerPayload, body)
    except DecodeError as exc:
        raise RegistrationRejected(422, str(exc)) from None


def _decode_error(message: str) -> str:
    return str(DecodeError(message, section=sections.REGISTER, kind="RegisterWorkerPayload"))


def create_app(*, auth_key: Keys | None = None, server_version: int = CURRENT_VERSION) -> FastAPI:
    """The bootstrap app; its registry is ``app.state.registry``.

    ``POST /register`` answers 200 ``RegisterReply``; 400 ``{"detail": ...}`` for the two
    conflicts of §4.1 (and for differing engine-wide pdwire/2 fields, 4.1-R14); 507 for a new
    worker past the server's ``registrations`` limit (13.6-R1); 401 with a key
    and no valid ``auth_tag``; 422 for a body that is not a valid ``RegisterWorkerPayload``, as
    FastAPI would, but with ``detail`` the ``DecodeError`` text (path and spec section) rather
    than FastAPI's list of errors. Auth is checked before the schema, so an unauthenticated
    client learns nothing about it.
    """
    if server_version not in WIRE_VERSION.values():
        raise ValueError(f"unknown wire version {server_version}")
    legacy = server_version == LEGACY_VERSION
    if legacy and auth_key is not None:
        raise ValueError("a legacy bootstrap server cannot authenticate registrations")
    app = FastAPI(title="pdwire bootstrap server", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=REGISTER_BODY_LIMIT)  # 4.1-R17
    app.state.registry = Registry(
        keep_pdwire_fields=not legacy, max_workers=None if legacy else REFERENCE.registrations
    )
    counts = Counts()

    @app.post("/register", response_model=None)
    async def register(request: Request) -> dict[str, Any] | JSONResponse:
        raw = await request.body()
        try:
            payload = _parse_body(raw, auth_key)
            app.state.registry.register(payload)
        except RegistrationRejected as exc:
            logger.warning("rejected registration (HTTP %d): %s", exc.status, exc.detail)
            counts.inc("pdwire_bootstrap_registrations_total", "rejected")
            return _error(exc.status, exc.detail)
        counts.inc("pdwire_bootstrap_registrations_total", "ok")
        announced = payload.pdwire_version is not None and not legacy
        return RegisterReply(pdwire_version=server_version if announced else None).dump()

    @app.get("/query")
    async def query() -> dict[str, Any]:
        registry: Registry = app.state.registry
        counts.inc("pdwire_bootstrap_queries_total")
        return registry.query().dump()

    if not legacy:

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics() -> Response:
            gauges = {"pdwire_bootstrap_workers": {"": float(app.state.registry.workers)}}
            return Response(render(counts.snapshot(), gauges), media_type=CONTENT_TYPE)

    return app


# -- the server thread ----------------------------------------------------------------------


class BootstrapServer(AppServer):
    """``create_app`` served by uvicorn in a daemon thread."""

    name = "bootstrap server"

    def __init__(
        self,
        *,
        auth_key: Keys | None = None,
        server_version: int = CURRENT_VERSION,
        app: FastAPI | None = None,
    ) -> None:
        super().__init__(app or create_app(auth_key=auth_key, server_version=server_version))
