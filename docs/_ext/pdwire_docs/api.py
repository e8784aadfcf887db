"""Readable signatures for the API reference: a message struct, HTTP model or dataclass is shown
with its fields' types as the spec writes them (``list[int] | None``), without the ``Annotated``
metadata (descriptions, bounds) or the quoted annotations of ``from __future__ import
annotations``."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

import msgspec
from pydantic import BaseModel
from pydantic_core import PydanticUndefined
from sphinx.application import Sphinx

from pdwire.spectables import type_name


def default_text(value: Any) -> str:
    """``repr(value)``, with a set's members sorted so that pages do not change between builds."""
    if isinstance(value, frozenset | set):
        return "{" + ", ".join(repr(v) for v in sorted(value)) + "}"
    return repr(value)


def _param(name: str, tp: Any, default: str | None) -> str:
    return f"{name}: {type_name(tp)}" + ("" if default is None else f" = {default}")


def _struct(cls: type[msgspec.Struct]) -> list[str]:
    out = []
    for f in msgspec.structs.fields(cls):
        if f.required:
            default = None
        elif f.default_factory is not msgspec.NODEFAULT:
            default = default_text(f.default_factory())
        else:
            default = default_text(f.default)
        out.append(_param(f.name, f.type, default))
    return out


def _model(cls: type[BaseModel]) -> list[str]:
    return ["*"] + [
        _param(
            name, f.annotation, None if f.default is PydanticUndefined else default_text(f.default)
        )
        for name, f in cls.model_fields.items()
    ]


def _dataclass(cls: type) -> list[str]:
    hints = get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default: str | None = default_text(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = default_text(f.default_factory())
        else:
            default = None
        out.append(_param(f.name, hints[f.name], default))
    return out


def clean_signature(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str, str | None] | None:
    if what != "class" or not isinstance(obj, type):
        return None
    try:
        if issubclass(obj, msgspec.Struct):
            params = _struct(obj)
        elif issubclass(obj, BaseModel):
            params = _model(obj)
        elif dataclasses.is_dataclass(obj):
            params = _dataclass(obj)
        else:
            return None
    except (NameError, TypeError):  # an annotation that cannot be resolved: autodoc's own text
        return None
    return f"({', '.join(params)})", return_annotation
