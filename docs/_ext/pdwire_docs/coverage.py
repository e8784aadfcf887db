"""The check that the built site covers the spec: every field of every message and document,
every status, bootstrap route, timer, error code and error string, and every chapter of
``spec/``. Each gap is a Sphinx warning, so a ``-W`` build fails on it.

What must be covered comes from the code (fields, statuses, codes, strings), from ``spec/``
(its chapters) and from the spec's chapters as built (the routes are the headings of §4, the
timers the rows of §6's tables). Where it must be covered: fields in the generated table of
their message; statuses, codes and strings anywhere on the site; routes and timers in the
operations chapter; each chapter as a page of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

from docutils import nodes

from pdwire import spectables
from pdwire.messages import ErrorCode, XferResponseStatus

SPEC_DIR: Final = Path(__file__).resolve().parents[3] / "spec"
ROUTES_DOC: Final = "spec/04-bootstrap"
TIMERS_DOC: Final = "spec/06-timers"
OPERATIONS_DOC: Final = "operations"
#: The attribute the field-table directive sets on its table: the message it describes.
MESSAGE_ATTR: Final = "pdwire_message"
_ROUTE_TITLE: Final = re.compile(r"^[\d.]+ (GET|POST|PUT|PATCH|DELETE) (/\S*)$")


@dataclasses.dataclass
class Found:
    """What one built document shows."""

    rows: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    fields: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    titles: list[str] = dataclasses.field(default_factory=list)
    literals: set[str] = dataclasses.field(default_factory=set)


def collect(doctree: nodes.Node) -> Found:
    """The table rows (body rows, as cell texts), generated field tables, section titles and
    literal texts of one document."""
    found = Found()
    for table in doctree.findall(nodes.table):
        message = table.get(MESSAGE_ATTR)
        for body in table.findall(nodes.tbody):
            for row in body.children:
                cells = tuple(entry.astext().strip() for entry in row.children)
                found.rows.append(cells)
                if message and cells:
                    found.fields.setdefault(message, set()).add(cells[0])
    found.titles = [title.astext() for title in doctree.findall(nodes.title)]
    found.literals = {lit.astext() for lit in doctree.findall(nodes.literal)}
    return found


def chapter_docname(path: Path) -> str:
    """The document of the site that includes the spec file ``path``."""
    return "spec/index" if path.stem == "README" else f"spec/{path.stem}"


def required(docs: Mapping[str, Found]) -> dict[str, set[str]]:
    """What the site must cover, by category."""
    routes = docs.get(ROUTES_DOC, Found()).titles
    return {
        "spec chapter": {chapter_docname(p) for p in SPEC_DIR.glob("*.md")},
        "field": {
            f"{name}.{row.name}" for name in spectables.SENDERS for row in spectables.rows(name)
        },
        "status": {f"{s.value} {s.name}" for s in XferResponseStatus},
        "bootstrap route": {f"{m[1]} {m[2]}" for t in routes if (m := _ROUTE_TITLE.match(t))},
        "timer": {row[0] for row in docs.get(TIMERS_DOC, Found()).rows if row},
        "error code": {code.value for code in ErrorCode},
        "error string": set(spectables.error_strings().values()),
    }


def covered(docs: Mapping[str, Found]) -> dict[str, set[str]]:
    """What the site covers, by category, in the same terms as ``required``."""
    rows = [row for found in docs.values() for row in found.rows]
    operations = docs.get(OPERATIONS_DOC, Found())
    first_cells = {row[0] for row in operations.rows if row}
    return {
        "spec chapter": set(docs),
        "field": {
            f"{m}.{f}" for found in docs.values() for m, fs in found.fields.items() for f in fs
        },
        "status": {f"{a} {b}" for row in rows for a, b in itertools.pairwise(row)},
        "bootstrap route": first_cells,
        "timer": first_cells,
        "error code": {row[0] for row in rows if row},
        "error string": {lit for found in docs.values() for lit in found.literals},
    }


def gaps(docs: Mapping[str, Found]) -> list[str]:
    """One line per item the site does not cover; empty when it covers everything."""
    need, have = required(docs), covered(docs)
    out: list[str] = []
    for category, items in need.items():
        if not items:
            out.append(f"the spec as built lists no {category}: is its chapter missing?")
        for item in sorted(items - have[category]):
            if category == "error string" and _contained(item, have[category]):
                continue
            out.append(f"the site does not cover the {category} {item!r}")
    return out


def _contained(text: str, literals: Iterable[str]) -> bool:
    return any(text in lit for lit in literals)
