"""Markdown tables of the spec, generated from the code: the field table of every message and
document, and the negotiation table. ``spec/*.md`` holds them between markers; a test fails when
they drift (``pdwire spec-tables --write`` refreshes them)."""

from __future__ import annotations

import dataclasses
import re
import string
import types
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Final, Union, get_args, get_origin, get_type_hints

import msgspec
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from . import error_strings as error_strings_module
from .http_models import EngineEntry
from .messages import ErrorCode, Fingerprint, XferMetadata, XferResponse, XferResponseStatus
from .negotiation import NEGOTIATION_TABLE
from .roles import LETTER
from .schema import HTTP_DOCUMENTS, MSGPACK_MESSAGES
from .transitions import LOAD_TRANSITIONS, TRANSFER_TRANSITIONS

SENDERS: Final = {
    "XferMetadata": "D worker",
    "XferMetadataV2": "D worker",
    "XferResponse": "P worker",
    "XferResponseV2": "P worker",
    "XferCancel": "D worker",
    "LeaseHeartbeat": "D worker",
    "Fingerprint": "D in its pull; P in /register",
    "RegisterWorkerPayload": "P worker",
    "RegisterReply": "bootstrap server",
    "RegisterError": "bootstrap server",
    "EngineEntry": "bootstrap server",
    "QueryResponse": "bootstrap server",
    "PrefillParams": "proxy",
    "DecodeParams": "proxy",
    "DecodeResultParams": "D engine",
}

_MODELS: Final[dict[str, type[BaseModel]]] = {**HTTP_DOCUMENTS, "EngineEntry": EngineEntry}

_EXTENDS: Final[dict[str, type[msgspec.Struct]]] = {
    "XferMetadataV2": XferMetadata,
    "XferResponseV2": XferResponse,
}
_QUERY_KEY: Final = "One entry per P data-parallel rank; the JSON key is the rank in decimal."

_FIELDS: Final = re.compile(r"(<!-- fields:(\w+) -->\n)(.*?)(<!-- /fields -->)", re.DOTALL)
_TRANSITIONS: Final = re.compile(
    r"(<!-- transitions:(\w+) -->\n)(.*?)(<!-- /transitions -->)", re.DOTALL
)
_NEGOTIATION: Final = re.compile(
    r"(<!-- negotiation-table -->\n)(.*?)(<!-- /negotiation-table -->)", re.DOTALL
)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    type: str
    default: str
    since: str
    meaning: str


def type_name(tp: Any) -> str:
    """A Python type written the way the spec writes it: ``dict[str, list[int]] | None``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", repr(tp))


def _meta(tp: Any) -> dict[str, Any]:
    """Description and x-since from the msgspec ``Meta`` of an annotated field type."""
    out: dict[str, Any] = {}
    if get_origin(tp) is Annotated:
        for m in get_args(tp)[1:]:
            if isinstance(m, msgspec.Meta):
                out.update(m.extra_json_schema or {})
                if m.description:
                    out["description"] = m.description
    return out


def _struct_rows(cls: type[msgspec.Struct], skip: tuple[str, ...] = ()) -> Iterator[Row]:
    for f in msgspec.structs.fields(cls):
        if f.name in skip:
            continue
        meta = _meta(f.type)
        if f.required:
            default = "required"
        elif f.default_factory is not msgspec.NODEFAULT:
            default = repr(f.default_factory())
        else:
            default = repr(f.default)
        yield Row(f.name, type_name(f.type), default, meta["x-since"], meta["description"])


def _model_rows(cls: type[BaseModel]) -> Iterator[Row]:
    for name, f in cls.model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        default = "required" if f.default is PydanticUndefined else repr(f.default)
        yield Row(
            name,
            type_name(f.annotation),
            default,
            str(extra.get("x-since", "legacy")),
            f.description or "",
        )


def _fingerprint_rows() -> Iterator[Row]:
    hints = get_type_hints(Fingerprint, include_extras=True)
    for f in dataclasses.fields(Fingerprint):
        tp = hints[f.name]
        yield Row(f.name, type_name(tp), "required", "pdwire/2", _meta(tp)["description"])


def rows(name: str) -> list[Row]:
    """The field rows of a message or document; a V2 message lists only its extension fields."""
    if name == "Fingerprint":
        return list(_fingerprint_rows())
    if name == "QueryResponse":
        return [Row("<dp_rank>", "EngineEntry", "required", "legacy", _QUERY_KEY)]
    if name in MSGPACK_MESSAGES:
        base = _EXTENDS.get(name)
        skip = base.__struct_fields__ if base else ()
        return list(_struct_rows(MSGPACK_MESSAGES[name], skip))
    return list(_model_rows(_MODELS[name]))


def field_table(name: str) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        f"Sent by: {SENDERS[name]}.",
        "",
        "| field | type | default | since | meaning |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{r.name}` | `{cell(r.type)}` | `{cell(r.default)}` | {r.since} | {cell(r.meaning)} |"
        for r in rows(name)
    ]
    return "\n".join(lines) + "\n"


def negotiation_table() -> str:
    lines = [
        "| our role | our profile | what we know of the peer | we send | we announce | why |",
        "|---|---|---|---|---|---|",
    ]
    for (role, profile, peer), rule in NEGOTIATION_TABLE.items():
        announce = "yes" if rule.announce else "no"
        lines.append(
            f"| {LETTER[role]} | {profile} | {peer} | {rule.profile} | {announce} | {rule.why} |"
        )
    return "\n".join(lines) + "\n"


def transition_table(machine: str) -> str:
    """The transition table of ``machine`` ("transfer" on P, "load" on D) in Markdown."""
    table: dict[tuple[Any, Any], Any] = (
        dict(TRANSFER_TRANSITIONS) if machine == "transfer" else dict(LOAD_TRANSITIONS)
    )
    lines = ["| state | event | next state |", "|---|---|---|"]
    for (state, event), nxt in table.items():
        before = "(none)" if state is None else state.value
        lines.append(f"| {before} | {event.value} | {nxt.value} |")
    return "\n".join(lines) + "\n"


def fill(text: str) -> str:
    """``text`` with every generated table between its markers brought up to date."""
    text = _FIELDS.sub(lambda m: m[1] + field_table(m[2]) + m[4], text)
    text = _TRANSITIONS.sub(lambda m: m[1] + transition_table(m[2]) + m[4], text)
    return _NEGOTIATION.sub(lambda m: m[1] + negotiation_table() + m[3], text)


def substitute(
    text: str,
    fields: Callable[[str], str],
    transitions: Callable[[str], str],
    negotiation: Callable[[], str],
) -> str:
    """``text`` with every generated block, markers included, replaced by what ``fields(name)``,
    ``transitions(machine)`` or ``negotiation()`` returns: how the published site puts the
    code's own tables where the spec has them."""
    text = _FIELDS.sub(lambda m: fields(m[2]), text)
    text = _TRANSITIONS.sub(lambda m: transitions(m[2]), text)
    return _NEGOTIATION.sub(lambda m: negotiation(), text)


def status_table() -> str:
    """Every ``XferResponseStatus`` with the integer it travels as (§3.3)."""
    lines = ["| value | status |", "|---|---|"]
    lines += [f"| {s.value} | `{s.name}` |" for s in XferResponseStatus]
    return "\n".join(lines) + "\n"


def error_code_table() -> str:
    """Every pdwire/2 error code (§7.2), in declaration order."""
    lines = ["| code | on the wire |", "|---|---|"]
    lines += [f'| `{c.name}` | `"{c.value}"` |' for c in ErrorCode]
    return "\n".join(lines) + "\n"


def error_strings() -> dict[str, str]:
    """Every string of ``pdwire.error_strings`` by its constant's name, in declaration order."""
    return {
        name: value
        for name, value in vars(error_strings_module).items()
        if name.isupper() and isinstance(value, str)
    }


def error_string_table() -> str:
    """Every ``err_msg`` and bootstrap error detail (§4.1, §7.1) with its placeholders."""
    lines = ["| constant | text | placeholders |", "|---|---|---|"]
    for name, text in error_strings().items():
        names = [f"`{f}`" for _, f, _, _ in string.Formatter().parse(text) if f]
        shown = text.replace("|", "\\|")
        lines.append(f"| `{name}` | `{shown}` | {', '.join(names) or '-'} |")
    return "\n".join(lines) + "\n"
