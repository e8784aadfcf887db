"""Sphinx extension of the pdwire site: tables and diagrams generated from the code at build
time, the spec's generated blocks refreshed where ``spec/`` is included, and a check that the
site covers every field, status, route, timer and error of the spec."""

from __future__ import annotations

from typing import Any, Final

from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging

from . import api, coverage, operations, sequence, spec_include, states, tables

logger = logging.getLogger(__name__)

DIRECTIVES: Final = {
    "pdwire-fields": tables.Fields,
    "pdwire-transitions": tables.Transitions,
    "pdwire-negotiation": tables.Negotiation,
    "pdwire-statuses": tables.Statuses,
    "pdwire-error-codes": tables.ErrorCodes,
    "pdwire-error-strings": tables.ErrorStrings,
    "pdwire-state-diagram": states.StateDiagram,
    "pdwire-sequence": sequence.SequenceDiagram,
    "pdwire-routes": operations.Routes,
    "pdwire-config": operations.ConfigFields,
    "pdwire-metrics": operations.Metrics,
}


def _found(env: BuildEnvironment) -> dict[str, coverage.Found]:
    if not hasattr(env, "pdwire_found"):
        env.pdwire_found = {}  # type: ignore[attr-defined]
    found: dict[str, coverage.Found] = env.pdwire_found  # type: ignore[attr-defined]
    return found


def _on_doctree_read(app: Sphinx, doctree: Any) -> None:
    _found(app.env)[app.env.docname] = coverage.collect(doctree)


def _on_purge(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
    _found(env).pop(docname, None)


def _on_merge(app: Sphinx, env: BuildEnvironment, docnames: set[str], other: Any) -> None:
    _found(env).update({d: f for d, f in _found(other).items() if d in docnames})


def _on_check(app: Sphinx, env: BuildEnvironment) -> None:
    for gap in coverage.gaps(_found(env)):
        logger.warning(gap, type="pdwire", subtype="coverage")


def setup(app: Sphinx) -> dict[str, Any]:
    for name, directive in DIRECTIVES.items():
        app.add_directive(name, directive)
    app.setup_extension("sphinx.ext.autodoc")
    app.connect("autodoc-process-signature", api.clean_signature)
    app.connect("include-read", spec_include.on_include_read)
    app.connect("doctree-read", _on_doctree_read)
    app.connect("env-purge-doc", _on_purge)
    app.connect("env-merge-info", _on_merge)
    app.connect("env-check-consistency", _on_check)
    return {"version": "1", "env_version": 1, "parallel_read_safe": True}
