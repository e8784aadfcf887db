"""Directives of the operations chapter: the bootstrap server's routes, read from the reference
server itself, and the fields of the sessions' configuration objects."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Final, get_type_hints

from fastapi.routing import APIRoute

from pdwire import spectables
from pdwire.versions import WIRE_VERSION
from reference_connector.bootstrap import create_app
from reference_connector.metrics import METRICS

from .api import default_text
from .markdown import MarkdownDirective

#: path -> (spec section, or "" for a route of the reference only; request body, replies).
ROUTE_DOCUMENTS: Final = {
    "/register": (
        "4.1",
        "`RegisterWorkerPayload`",
        "200 `RegisterReply`; 400 and 401 `RegisterError`; 422 for an invalid body",
    ),
    "/query": ("4.2", "none", "200 `QueryResponse`"),
    "/health": ("4.3", "none", '200 `{"status": "ok"}`'),
    "/metrics": ("", "none", "200, the Prometheus text format ([Metrics](#metrics))"),
}


def _routes(server_version: int) -> set[tuple[str, str]]:
    app = create_app(server_version=server_version)
    return {
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }


class Routes(MarkdownDirective):
    """Every route of the reference bootstrap server, and whether a vLLM (legacy) server has it."""

    def markdown(self) -> str:
        ours = _routes(WIRE_VERSION["pdwire/2"])
        legacy = _routes(WIRE_VERSION["legacy"])
        lines = [
            "| route | spec | request body | replies | on a legacy server |",
            "|---|---|---|---|---|",
        ]
        unknown = sorted(f"{m} {p}" for m, p in ours if p not in ROUTE_DOCUMENTS)
        if unknown:
            raise self.error(f"routes without an entry in ROUTE_DOCUMENTS: {unknown}")
        rows = sorted((ROUTE_DOCUMENTS[path], method, path) for method, path in ours)
        for (section, body, replies), method, path in rows:
            on_legacy = "yes" if (method, path) in legacy else "no"
            spec = f"§{section}" if section else "none (operations)"
            lines.append(f"| `{method} {path}` | {spec} | {body} | {replies} | {on_legacy} |")
        return "\n".join(lines) + "\n"


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return default_text(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return default_text(field.default_factory())
    return "required"


class ConfigFields(MarkdownDirective):
    """The fields of a configuration dataclass, named ``module.Class``, with types and defaults."""

    required_arguments = 1

    def markdown(self) -> str:
        module, _, name = self.arguments[0].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        hints = get_type_hints(cls)
        lines = ["| field | type | default |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            kind = spectables.type_name(hints[f.name]).replace("|", "\\|")
            default = _default(f).replace("|", "\\|")
            lines.append(f"| `{f.name}` | `{kind}` | `{default}` |")
        return "\n".join(lines) + "\n"


class Metrics(MarkdownDirective):
    """Every metric of the reference deployment (``reference_connector.metrics.METRICS``)."""

    def markdown(self) -> str:
        lines = [
            "| metric | type | label | what it counts | when it moves |",
            "|---|---|---|---|---|",
        ]
        for m in METRICS:
            label = f"`{m.label}`" if m.label else ""
            lines.append(f"| `{m.name}` | {m.kind} | {label} | {m.help} | {m.action} |")
        return "\n".join(lines) + "\n"
