"""The HTTP side of the protocol as pydantic models: the bootstrap routes (spec §4) and
``kv_transfer_params`` (spec §5).

Legacy fields first, with vLLM's names; pdwire/2 fields default to None and are left out of the
JSON by ``dump``, so a legacy peer sees vLLM's exact documents. Unknown keys are ignored, as vLLM's
models do.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, RootModel, ValidationError

from . import error_strings, sections
from .errors import DecodeError
from .messages import V2, Fingerprint

#: The longest registration body a pdwire server reads (4.1-R17).
MAX_REGISTER_BODY_BYTES: Final = 64 * 1024
#: The bootstrap server's port when none is given: VLLM_MOONCAKE_BOOTSTRAP_PORT's default
#: (4.4-R14), and the proxy's for a P whose bootstrap port is omitted (5.4-R16).
DEFAULT_BOOTSTRAP_PORT: Final = 8998
#: Seconds pdwire's HTTP clients (the proxy, the harness, the load generator) keep an idle pooled
#: connection: well below the 5 s after which uvicorn, and so vLLM's API server and the bootstrap
#: server, close one. With equal timers a request sent on a connection the server is closing
#: fails without an answer ("Server disconnected without sending a response"): the client starts
#: its idle clock when it has read the response, later than the server, the more so under load.
CLIENT_KEEPALIVE_S: Final = 2.0
#: What ``addr`` must look like (§4.1): a ZMQ TCP endpoint with a host and a port.
WORKER_ADDR: Final = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(?P<port>\d{1,5})")


def split_host_port(address: str) -> tuple[str, int]:
    """``host`` and ``port`` of a bootstrap server address ``host:port`` (``[v6]:port`` too;
    4.4-R12); ``ValueError`` naming the rule when either is missing."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{error_strings.BOOTSTRAP_ADDRESS_INVALID}: {address!r} (spec §4.4)")
    return host, int(port)


def url_of(host: str, port: int) -> str:
    """The base URL of the bootstrap server at ``host``:``port``."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bootstrap_url(prefill_url: str, port: int | None = None) -> str:
    """``http://<host of prefill_url>:<port or 8998>`` (5.4-R16)."""
    host = urlsplit(prefill_url).hostname
    if not host:
        raise ValueError(f"not an http URL with a host: {prefill_url!r}")
    if not 0 <= (port or 0) < 65536:
        raise ValueError(f"bootstrap port out of range: {port}")
    return url_of(host, port or DEFAULT_BOOTSTRAP_PORT)


#: The BOOTSTRAP part of ``URL@BOOTSTRAP`` given as a host and port, without a scheme.
_HOST_PORT: Final = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^/@:\[\]]+):\d+$")


def parse_prefill(spec: str) -> tuple[str, str]:
    """``URL[@BOOTSTRAP]`` -> (P's API URL, its bootstrap server's URL). BOOTSTRAP is a URL, a
    ``HOST:PORT``, a port on URL's host, or ``none``; without it, port 8998 of URL's host
    (5.4-R16). The last ``@`` separates them; a URL with user info names its BOOTSTRAP."""
    url, sep, rest = spec.rpartition("@")
    bootstrap = ""
    if not sep or not (
        rest.isdigit() or rest.lower() == "none" or "://" in rest or _HOST_PORT.match(rest)
    ):
        url = spec  # no bootstrap part
    elif rest.isdigit():
        bootstrap = bootstrap_url(url, int(rest))
    elif "://" in rest:
        bootstrap = rest
    elif rest.lower() != "none":
        bootstrap = f"http://{rest}"
    url = url.rstrip("/")
    if urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"P's URL must be http(s)://host:port, got {url!r}")
    return url, bootstrap.rstrip("/") or bootstrap_url(url)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def dump(self) -> dict[str, Any]:
        """The JSON document: pdwire/2 fields that are unset are left out."""
        return self.model_dump(mode="json", exclude_none=True)


def _ext(description: str, **constraints: Any) -> Any:
    """A pdwire/2 extension field: optional, left out of the JSON when unset."""
    return Field(
        default=None, description=description, json_schema_extra={"x-since": V2}, **constraints
    )


def _check_addr(value: str) -> str:
    m = WORKER_ADDR.fullmatch(value)
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ValueError(f"addr must be tcp://host:port, got {value!r}")
    return value


#: A P worker's side-channel address (§4.1).
WorkerAddr = Annotated[str, AfterValidator(_check_addr)]


class RegisterWorkerPayload(_Model):
    """``POST /register`` body: one P worker's side-channel address (§4.1). Sent by P workers."""

    engine_id: str = Field(min_length=1, description="P's engine id (one per DP rank).")
    dp_rank: int = Field(ge=0, description="The worker's data-parallel rank.")
    tp_rank: int = Field(ge=0, description="The worker's tensor-parallel rank.")
    pp_rank: int = Field(ge=0, description="The worker's pipeline-parallel rank.")
    addr: WorkerAddr = Field(description="The worker's ZMQ ROUTER endpoint, tcp://host:port.")
    pdwire_version: int | None = _ext("Highest wire version the worker speaks.", ge=1)
    pdwire_caps: list[str] | None = _ext("Capabilities the worker announces (§8.5).")
    tp_size: int | None = _ext("P's TP size.", ge=1)
    pp_size: int | None = _ext("P's PP size.", ge=1)
    fingerprint: Fingerprint | None = _ext("P's compatibility fingerprint (§3.6).")
    auth_key_id: str | None = _ext("Id of the key auth_tag was made with (8.6-R15).")
    auth_tag: str | None = _ext("Hex HMAC-SHA256 of the body without this field (§8.6).")


class RegisterReply(_Model):
    """``POST /register`` reply (§4.1). Sent by the bootstrap server."""

    status: Literal["ok"] = Field(default="ok", description='Always "ok".')
    pdwire_version: int | None = _ext("The server's wire version.", ge=1)


class RegisterError(_Model):
    """``POST /register`` HTTP 400 body, as FastAPI writes an ``HTTPException`` (§4.1)."""

    detail: str = Field(description="One of the two error strings of §4.1.")


class EngineEntry(_Model):
    """One P engine (one DP rank) in ``GET /query`` (§4.2). Sent by the bootstrap server."""

    engine_id: str = Field(min_length=1, description="P's engine id for this DP rank.")
    worker_addr: dict[int, dict[int, WorkerAddr]] = Field(
        description="tp_rank -> pp_rank -> tcp://host:port; JSON keys are strings."
    )
    pdwire_version: int | None = _ext("Highest wire version P's workers speak.", ge=1)
    pdwire_caps: list[str] | None = _ext("Capabilities P's workers announce (§8.5).")
    tp_size: int | None = _ext("P's TP size; the entry is complete when every rank is there.", ge=1)
    pp_size: int | None = _ext("P's PP size.", ge=1)
    fingerprint: Fingerprint | None = _ext("P's compatibility fingerprint (§3.6).")


class QueryResponse(RootModel[dict[int, EngineEntry]]):
    """``GET /query`` reply: dp_rank -> engine entry (§4.2)."""

    def dump(self) -> dict[str, Any]:
        return {str(dp): entry.dump() for dp, entry in self.root.items()}


class PrefillParams(_Model):
    """``kv_transfer_params`` the proxy sends to P (§5.1)."""

    do_remote_decode: Literal[True] = Field(default=True, description="P sends its KV to a D.")
    do_remote_prefill: Literal[False] = Field(default=False, description="Always false on P.")
    transfer_id: str = Field(min_length=1, description="Shared id of the transfer, xfer-<uuid4>.")
    pdwire_version: int | None = _ext("The proxy's wire version.", ge=1)


class DecodeParams(_Model):
    """``kv_transfer_params`` the proxy sends to D (§5.2)."""

    do_remote_decode: Literal[False] = Field(default=False, description="Always false on D.")
    do_remote_prefill: Literal[True] = Field(default=True, description="D loads its KV from P.")
    remote_bootstrap_addr: str = Field(
        min_length=1, description="http://host:port of P's bootstrap server."
    )
    remote_engine_id: str = Field(min_length=1, description="P's engine id for the chosen DP rank.")
    transfer_id: str = Field(min_length=1, description="The same transfer_id as P's.")
    pdwire_version: int | None = _ext("The proxy's wire version.", ge=1)
    deadline_ms: int | None = _ext("D's budget for loading the KV, in ms.", ge=1)


class DecodeResultParams(_Model):
    """``kv_transfer_params`` in D's own response (§5.3); P's response carries null."""

    do_remote_decode: bool | None = Field(default=None, description="As D last held it.")
    do_remote_prefill: bool | None = Field(
        default=None, description="False once D has loaded (one transfer per request)."
    )
    remote_prefill_cached_tokens: int | None = Field(
        default=None, ge=0, description="Prompt tokens D loaded from P, when the engine adds it."
    )
    pdwire_version: int | None = _ext("D's wire version.", ge=1)


HTTP_SECTIONS: Final[dict[type[BaseModel], str]] = {
    RegisterWorkerPayload: sections.REGISTER,
    RegisterReply: sections.REGISTER,
    RegisterError: sections.REGISTER,
    EngineEntry: sections.QUERY,
    QueryResponse: sections.QUERY,
    PrefillParams: sections.KV_PARAMS_PREFILL,
    DecodeParams: sections.KV_PARAMS_DECODE,
    DecodeResultParams: sections.KV_PARAMS_RESULT,
}

M = TypeVar("M", bound=BaseModel)


def _path_part(part: int | str) -> str:
    if isinstance(part, int):
        return f"[{part}]"
    return part if part.startswith("[") else f".{part}"  # pydantic's "[key]": a bad dict key


def decode_json(model: type[M], data: bytes | str | dict[str, Any]) -> M:
    """Validate an HTTP document; every failure is a ``DecodeError`` naming path and section."""
    section = HTTP_SECTIONS[model]
    kind = model.__name__
    try:
        if isinstance(data, dict):
            return model.model_validate(data)
        return model.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = "$" + "".join(_path_part(p) for p in first["loc"])
        raise DecodeError(first["msg"], path=path, section=section, kind=kind) from None
