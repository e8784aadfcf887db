"""The spec's generated tables, as the site shows them: when a chapter of ``spec/`` is included,
each block between its markers is replaced by the directive that renders it from the code at
build time, so the site cannot show a table older than the code."""

from __future__ import annotations

from pathlib import Path

from sphinx.application import Sphinx

from pdwire import spectables

from .coverage import SPEC_DIR


def _block(directive: str, argument: str = "") -> str:
    return f"\n```{{{directive}}} {argument}".rstrip() + "\n```\n"


def directives_for_markers(text: str) -> str:
    """``text`` with each generated table replaced by its directive."""
    return spectables.substitute(
        text,
        fields=lambda name: _block("pdwire-fields", name),
        transitions=lambda machine: (
            _block("pdwire-state-diagram", machine) + _block("pdwire-transitions", machine)
        ),
        negotiation=lambda: _block("pdwire-negotiation"),
    )


def on_include_read(
    app: Sphinx, relative_path: Path, parent_docname: str, content: list[str]
) -> None:
    if (Path(app.srcdir) / relative_path).resolve().parent == SPEC_DIR:
        content[0] = directives_for_markers(content[0])
