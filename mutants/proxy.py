"""Mutants of the proxy (§5.4), caught by the proxy suite, which plays the client, P and D
around it. A proxy started with ``preload.environ(NAME)`` applies one before it serves."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from . import mutant, replace

# -- start-up --------------------------------------------------------------------------------


@mutant(
    "proxy-ready-early",
    "proxy",
    "routes completions before P is ready instead of 503",
    cases=("proxy/5.4/2",),
)
def _ready_early() -> None:
    from reference_connector import proxy

    original = proxy.Proxy.completion

    async def completion(self: proxy.Proxy, request: Any, path: str) -> Any:
        if self.readiness.ready:
            return await original(self, request, path)
        guess = proxy.Target(self.readiness.prefills[0], 0, "not-known-yet", None)
        self.readiness.targets = [guess]
        try:
            return await original(self, request, path)
        finally:
            self.readiness.targets, self._targets = [], None

    replace(proxy.Proxy, "completion", completion)


@mutant(
    "proxy-query-before-health",
    "proxy",
    "polls P's /health but queries P's bootstrap server whatever it answers",
    cases=(
        "proxy/5.4/1",
        "proxy/5.4/2",
    ),
)
def _query_before_health() -> None:
    import httpx

    from reference_connector import bootstrap_client, proxy

    async def check(self: proxy.Readiness, prefill: Any, client: httpx.AsyncClient) -> Any:
        try:
            await client.get("/health", timeout=proxy.HEALTH_TIMEOUT_S)
            engines = await bootstrap_client.query(prefill.bootstrap, timeout=2.0, attempts=1)
        except Exception as exc:
            return f"bootstrap {prefill.bootstrap}: {exc}"
        return proxy._targets(prefill, engines) if engines.root else "no engine yet"

    replace(proxy.Readiness, "_check", check)


@mutant(
    "proxy-bootstrap-port-8999",
    "proxy",
    "takes an omitted bootstrap port as 8999, not 8998",
    cases=("proxy/5.4/17",),
)
def _bootstrap_port_8999() -> None:
    from pdwire import http_models

    replace(http_models, "DEFAULT_BOOTSTRAP_PORT", 8999)


# -- the legs' bodies ------------------------------------------------------------------------


@mutant(
    "proxy-same-transfer-id",
    "proxy",
    "gives every request the same transfer_id",
    cases=("proxy/5.4/3",),
)
def _same_transfer_id() -> None:
    from reference_connector import proxy

    original = proxy.Proxy._route
    fixed = f"xfer-{uuid.uuid4()}"

    def route(self: proxy.Proxy, path: str, request_id: str | None) -> Any:
        return dataclasses.replace(original(self, path, request_id), transfer_id=fixed)

    replace(proxy.Proxy, "_route", route)


def _client_transfer_id(legs: Any, body: dict[str, Any]) -> Any:
    params = body.get("kv_transfer_params")
    tid = params.get("transfer_id") if isinstance(params, dict) else None
    return dataclasses.replace(legs, transfer_id=tid) if tid else legs


@mutant(
    "proxy-reuses-client-transfer-id",
    "proxy",
    "uses the transfer_id of the client's kv_transfer_params when there is one",
    cases=("proxy/5.4/4",),
)
def _reuses_client_transfer_id() -> None:
    from reference_connector import proxy

    p_body, d_body = proxy.Proxy.prefill_body, proxy.Proxy.decode_body

    def prefill_body(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> dict[str, Any]:
        return p_body(self, _client_transfer_id(legs, body), body)

    def decode_body(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> dict[str, Any]:
        return d_body(self, _client_transfer_id(legs, body), body)

    replace(proxy.Proxy, "prefill_body", prefill_body)
    replace(proxy.Proxy, "decode_body", decode_body)


@mutant(
    "proxy-transfer-id-from-request-id",
    "proxy",
    "mints each transfer_id as xfer- and the request's X-Request-Id",
    cases=("proxy/5.4/18",),
)
def _transfer_id_from_request_id() -> None:
    from reference_connector import proxy

    route = proxy.Proxy._route

    def from_request_id(self: proxy.Proxy, path: str, request_id: str | None) -> proxy._Legs:
        legs = route(self, path, request_id)
        return dataclasses.replace(legs, transfer_id=f"xfer-{legs.request_id}")

    replace(proxy.Proxy, "_route", from_request_id)


@mutant(
    "proxy-merges-client-params",
    "proxy",
    "merges the client's kv_transfer_params (internal _ keys included) into both legs'",
    cases=("proxy/5.1/1",),
)
def _merges_client_params() -> None:
    from reference_connector import proxy

    p_body, d_body = proxy.Proxy.prefill_body, proxy.Proxy.decode_body

    def merged(out: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        theirs = body.get("kv_transfer_params")
        if isinstance(theirs, dict):
            out["kv_transfer_params"] = {**theirs, **out["kv_transfer_params"]}
        return out

    def prefill_body(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> dict[str, Any]:
        return merged(p_body(self, legs, body), body)

    def decode_body(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> dict[str, Any]:
        return merged(d_body(self, legs, body), body)

    replace(proxy.Proxy, "prefill_body", prefill_body)
    replace(proxy.Proxy, "decode_body", decode_body)


@mutant(
    "proxy-d-leg-own-transfer-id",
    "proxy",
    "gives the D leg a transfer_id other than P's",
    cases=("proxy/5.2/1",),
)
def _d_leg_own_transfer_id() -> None:
    from reference_connector import proxy

    original = proxy.Proxy.decode_body

    def decode_body(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> dict[str, Any]:
        return original(self, dataclasses.replace(legs, transfer_id=f"xfer-{uuid.uuid4()}"), body)

    replace(proxy.Proxy, "decode_body", decode_body)


@mutant(
    "proxy-p-leg-streams",
    "proxy",
    "sends the P leg with the client's stream and options",
    cases=("proxy/5.4/5",),
)
def _p_leg_streams() -> None:
    from reference_connector import proxy

    original = proxy.Proxy.prefill_body

    def prefill_body(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> dict[str, Any]:
        out = original(self, legs, body)
        for key in ("stream", "stream_options"):
            if key in body:
                out[key] = body[key]
        return out

    replace(proxy.Proxy, "prefill_body", prefill_body)


@mutant(
    "proxy-shares-leg-body",
    "proxy",
    "builds the D leg from the P leg's body (max_tokens 1, stream false)",
    cases=("proxy/5.4/6",),
)
def _shares_leg_body() -> None:
    from reference_connector import proxy

    original = proxy.Proxy.decode_body

    def decode_body(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> dict[str, Any]:
        return original(self, legs, self.prefill_body(legs, body))

    replace(proxy.Proxy, "decode_body", decode_body)


# -- the legs' headers -----------------------------------------------------------------------


@mutant(
    "proxy-request-id-per-leg",
    "proxy",
    "sends a different X-Request-Id on the D leg",
    cases=("proxy/5.4/8",),
)
def _request_id_per_leg() -> None:
    from reference_connector import proxy

    original = proxy.Proxy._decode_request

    def decode_request(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> Any:
        return original(self, dataclasses.replace(legs, request_id=str(uuid.uuid4())), body)

    replace(proxy.Proxy, "_decode_request", decode_request)


@mutant(
    "proxy-dp-rank-header-on-d-leg",
    "proxy",
    "sends X-data-parallel-rank on the D leg too",
    cases=("proxy/5.4/9",),
)
def _dp_rank_header_on_d_leg() -> None:
    from reference_connector import proxy

    original = proxy.Proxy._decode_request

    def decode_request(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> Any:
        request = original(self, legs, body)
        request.headers["X-data-parallel-rank"] = str(legs.target.dp_rank)
        return request

    replace(proxy.Proxy, "_decode_request", decode_request)


@mutant(
    "proxy-dp-rank-always-0",
    "proxy",
    "sends X-data-parallel-rank 0 whichever DP rank's engine id it gave D",
    cases=("proxy/5.4/9",),
)
def _dp_rank_always_0() -> None:
    from reference_connector import proxy

    original = proxy.Proxy._prefill_leg

    async def prefill_leg(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> Any:
        target = dataclasses.replace(legs.target, dp_rank=0)
        return await original(self, dataclasses.replace(legs, target=target), body)

    replace(proxy.Proxy, "_prefill_leg", prefill_leg)


@mutant(
    "proxy-no-auth-on-d-leg",
    "proxy",
    "sends its API key on the P leg only",
    cases=("proxy/5.4/10",),
)
def _no_auth_on_d_leg() -> None:
    from reference_connector import proxy

    original = proxy.Proxy._decode_request

    def decode_request(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> Any:
        request = original(self, legs, body)
        request.headers.pop("Authorization", None)
        return request

    replace(proxy.Proxy, "_decode_request", decode_request)


@mutant(
    "proxy-bearer-none",
    "proxy",
    "sends 'Authorization: Bearer None' without a key (vLLM's)",
    cases=("proxy/5.4/11",),
)
def _bearer_none() -> None:
    from reference_connector import proxy

    def auth(self: proxy.Proxy) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    replace(proxy.Proxy, "_auth", auth)


# -- answers and failures --------------------------------------------------------------------


@mutant(
    "proxy-serial-legs",
    "proxy",
    "waits for P's answer before it sends the D leg",
    cases=("proxy/5.4/7",),
)
def _serial_legs() -> None:
    from reference_connector import proxy

    for name in ("_unary", "_streaming"):
        original = getattr(proxy.Proxy, name)

        def after_p(original: Any) -> Any:
            async def leg(
                self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any], prefill: Any
            ) -> Any:
                await asyncio.wait({prefill})
                return await original(self, legs, body, prefill)

            return leg

        replace(proxy.Proxy, name, after_p(original))


@mutant(
    "proxy-buffers-stream",
    "proxy",
    "reads D's whole stream before it answers the client",
    cases=("proxy/5.4/12",),
)
def _buffers_stream() -> None:
    from fastapi.responses import Response

    from reference_connector import proxy

    async def start_stream(
        self: proxy.Proxy, legs: proxy._Legs, response: Any, prefill: Any
    ) -> Any:
        content = await response.aread()
        await response.aclose()
        return Response(
            content=content, status_code=response.status_code, media_type=proxy.SSE_MEDIA_TYPE
        )

    replace(proxy.Proxy, "_start_stream", start_stream)


@mutant(
    "proxy-drops-p-error",
    "proxy",
    "ignores a failed P leg and returns D's answer (vLLM's)",
    cases=(
        "proxy/5.4/13",
        "proxy/5.4/14",
        "proxy/5.4/15",
    ),
)
def _drops_p_error() -> None:
    from reference_connector import proxy

    original = proxy.Proxy._prefill_leg

    async def prefill_leg(self: proxy.Proxy, legs: proxy._Legs, body: dict[str, Any]) -> None:
        await original(self, legs, body)

    replace(proxy.Proxy, "_prefill_leg", prefill_leg)


@mutant(
    "proxy-hides-p-error",
    "proxy",
    "reports a failed P leg without P's error",
    cases=("proxy/5.4/13",),
)
def _hides_p_error() -> None:
    from reference_connector import proxy

    def prefill_failed(self: proxy.Proxy, legs: proxy._Legs, what: str) -> str:
        return "prefill failed"

    replace(proxy.Proxy, "_prefill_failed", prefill_failed)


@mutant(
    "proxy-keeps-d-leg",
    "proxy",
    "lets the D leg run to its end after the P leg failed",
    cases=("proxy/5.4/16",),
)
def _keeps_d_leg() -> None:
    import httpx

    from reference_connector import proxy

    async def cancel(task: asyncio.Task[Any]) -> None:
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is None:
            result = task.result()
            if isinstance(result, httpx.Response):
                await result.aclose()

    replace(proxy, "_cancel", cancel)
