"""State diagrams drawn from ``pdwire.transitions`` with Graphviz (``sphinx.ext.graphviz``), so
they render offline and change with the tables the sessions run on."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from pdwire.transitions import HOLDS_BLOCKS, LOAD_TRANSITIONS, TRANSFER_TRANSITIONS

from .markdown import MarkdownDirective
from .tables import MACHINES

_TITLES = {
    "transfer": "P, per transfer_id: the life of one transfer on a P worker",
    "load": "D, per request: the life of one load on a D worker",
}
_START = "(none)"


def _table(machine: str) -> Mapping[tuple[Any, Any], Any]:
    return TRANSFER_TRANSITIONS if machine == "transfer" else LOAD_TRANSITIONS


def _node(state: str, loops: list[str], attrs: list[str]) -> str:
    """A state; the events that leave it where it is are listed inside it, not drawn as loops."""
    label = f"<b>{html.escape(state)}</b>" + "".join(
        f'<br/><font point-size="8">&#8634; {html.escape(e)}</font>' for e in loops
    )
    return f'  "{state}" [label=<{label}>{"".join(", " + a for a in attrs)}];'


def state_dot(machine: str) -> str:
    """The Graphviz source of ``machine``: one node per state, one edge per pair of states
    labelled with every event that moves between them; an event that keeps the state is
    listed in its node. States without a way out are drawn double, states that hold P's blocks
    filled."""
    edges: dict[tuple[str, str], list[str]] = {}
    for (state, event), nxt in _table(machine).items():
        source = _START if state is None else str(state.value)
        edges.setdefault((source, str(nxt.value)), []).append(str(event.value))
    states = {s for pair in edges for s in pair} - {_START}
    exits = {a for a, b in edges if a != b}
    held = {str(s.value) for s in HOLDS_BLOCKS} if machine == "transfer" else set()
    lines = [
        f"digraph {machine} {{",
        '  graph [rankdir=TB, nodesep=0.3, ranksep=0.45, fontname="Helvetica"];',
        '  node [shape=box, style="rounded", fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=9, color="#555555"];',
        f'  "{_START}" [shape=point, width=0.12, xlabel="{_START}"];',
    ]
    for name in sorted(states):
        attrs = []
        if name not in exits:
            attrs.append("peripheries=2")
        if name in held:
            attrs.append('style="rounded,filled", fillcolor="#dbe8f6"')
        lines.append(_node(name, edges.get((name, name), []), attrs))
    for (a, b), events in edges.items():
        if a != b:
            label = "\\n".join(events)
            lines.append(f'  "{a}" -> "{b}" [label="{label}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


class StateDiagram(MarkdownDirective):
    """The diagram of one machine of ``pdwire.transitions``, through the ``graphviz`` directive."""

    required_arguments = 1

    def markdown(self) -> str:
        machine = self.arguments[0]
        if machine not in MACHINES:
            raise self.error(f"unknown state machine {machine!r}; one of {MACHINES}")
        return (
            "```{graphviz}\n"
            f":caption: {_TITLES[machine]} (drawn from `pdwire.transitions`)\n"
            f":alt: state diagram of the {machine} machine\n"
            f"{state_dot(machine)}```\n"
        )
