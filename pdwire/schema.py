"""JSON Schemas (2020-12) of every message and HTTP document, generated from the code.

Their rendering ships inside the package (``pdwire/data/schemas/``, which ``spec/schemas`` links
to); a test fails when the two drift.
"""

from __future__ import annotations

import json
from importlib.resources import files
from importlib.resources.abc import Traversable
from typing import Any, Final

import msgspec
from pydantic import BaseModel

from . import http_models as http
from .messages import (
    LeaseHeartbeat,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseV2,
)

DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"
ID_BASE: Final = "https://pdwire.dev/schemas/"

#: Side-channel messages (msgpack; bytes appear base64 in JSON renderings).
MSGPACK_MESSAGES: Final[dict[str, type[msgspec.Struct]]] = {
    "XferMetadata": XferMetadata,
    "XferMetadataV2": XferMetadataV2,
    "XferResponse": XferResponse,
    "XferResponseV2": XferResponseV2,
    "XferCancel": XferCancel,
    "LeaseHeartbeat": LeaseHeartbeat,
}

#: HTTP documents (JSON).
HTTP_DOCUMENTS: Final[dict[str, type[BaseModel]]] = {
    "RegisterWorkerPayload": http.RegisterWorkerPayload,
    "RegisterReply": http.RegisterReply,
    "RegisterError": http.RegisterError,
    "QueryResponse": http.QueryResponse,
    "PrefillParams": http.PrefillParams,
    "DecodeParams": http.DecodeParams,
    "DecodeResultParams": http.DecodeResultParams,
}


def schema_of(name: str) -> dict[str, Any]:
    """The JSON Schema of one message or document, with ``$schema`` and ``$id``."""
    if name in MSGPACK_MESSAGES:
        body = msgspec.json.schema(MSGPACK_MESSAGES[name])
    else:
        body = HTTP_DOCUMENTS[name].model_json_schema()
    return {"$schema": DIALECT, "$id": f"{ID_BASE}{name}.json", **body}


def packaged() -> Traversable:
    """The directory of the schema files that ship with pdwire, one ``NAME.json`` each."""
    return files("pdwire") / "data" / "schemas"


def schemas() -> dict[str, str]:
    """File name -> rendered schema, for every message and document."""
    return {
        f"{name}.json": json.dumps(schema_of(name), indent=2, sort_keys=True, ensure_ascii=False)
        + "\n"
        for name in (*MSGPACK_MESSAGES, *HTTP_DOCUMENTS)
    }
