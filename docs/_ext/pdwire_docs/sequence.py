"""The request sequence of the seeds' case (``docs/_data/sequence.toml``), drawn at build time as
an SVG sequence diagram by plain Python: no browser, no network, no other tool."""

from __future__ import annotations

import dataclasses
import html
import tomllib
from pathlib import Path
from typing import Any, Final

from docutils import nodes

from .markdown import MarkdownDirective

COLUMN: Final = 92  # px between lifelines
ROW: Final = 24
PHASE: Final = 28
LOOP: Final = 14  # extra height of a step framed as a loop
HEAD: Final = 38
MARGIN: Final = 12
CHAR: Final = 6.3  # mean advance of one character at FONT px, to place labels
FONT: Final = 11.5
INK: Final = "#24292f"


@dataclasses.dataclass(frozen=True)
class Step:
    n: int
    source: str
    target: str
    text: str
    reply: bool = False
    loop: str = ""


@dataclasses.dataclass(frozen=True)
class Sequence:
    participants: dict[str, tuple[str, str]]  # id -> (name, detail), left to right
    phases: dict[int, str]  # first step -> title
    steps: list[Step]
    note: str


def load(path: Path) -> Sequence:
    """Read and check the data file; any inconsistency is a ``ValueError``."""
    data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    participants = {p["id"]: (p["name"], p.get("detail", "")) for p in data["participants"]}
    steps = [
        Step(s["n"], s["from"], s["to"], s["text"], s.get("reply", False), s.get("loop", ""))
        for s in data["steps"]
    ]
    if [s.n for s in steps] != list(range(1, len(steps) + 1)):
        raise ValueError(f"{path}: steps must be numbered 1, 2, ... in order")
    for s in steps:
        unknown = {s.source, s.target} - participants.keys()
        if unknown:
            raise ValueError(f"{path}: step {s.n} names unknown participants {sorted(unknown)}")
    phases = {p["first"]: p["title"] for p in data["phases"]}
    if not phases.keys() <= {s.n for s in steps}:
        raise ValueError(f"{path}: a phase starts at a step that does not exist")
    return Sequence(participants, phases, steps, data.get("note", ""))


def _text(x: float, y: float, text: str, anchor: str = "middle", weight: str = "normal") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-weight="{weight}" '
        f'class="halo">{html.escape(text)}</text>'
    )


def _width(text: str) -> float:
    return len(text) * CHAR


def svg(seq: Sequence) -> str:
    """The diagram as one self-contained SVG document."""
    ids = list(seq.participants)
    x = {pid: MARGIN + COLUMN / 2 + i * COLUMN for i, pid in enumerate(ids)}
    width = MARGIN * 2 + COLUMN * len(ids)
    back: list[str] = []
    front: list[str] = []
    y = MARGIN + HEAD + 10.0
    for step in seq.steps:
        if step.n in seq.phases:
            back.append(
                f'<rect x="4" y="{y + 2:.1f}" width="{width - 8}" height="{PHASE - 6}" rx="3" '
                'fill="#eef2f7"/>'
            )
            front.append(_text(12, y + 17, seq.phases[step.n], anchor="start", weight="bold"))
            y += PHASE
        if step.loop:
            y += LOOP
        label = f"{step.n}  {step.text}"
        a, b = x[step.source], x[step.target]
        dash = ' stroke-dasharray="5 3"' if step.reply else ""
        if a == b:
            path = f"M{a:.1f},{y + 9:.1f} h18 v10 h-16"
            front.append(f'<path d="{path}" class="arrow"{dash}/>')
            right = a + 24 + _width(label) <= width - 4
            lx = a + 24 if right else a - 8
            front.append(_text(lx, y + 18, label, anchor="start" if right else "end"))
            left, right_edge = (
                (a - 8, lx + _width(label)) if right else (lx - _width(label), a + 22)
            )
        else:
            front.append(f'<path d="M{a:.1f},{y + 17:.1f} H{b:.1f}" class="arrow"{dash}/>')
            half = _width(label) / 2
            mid = min(max((a + b) / 2, half + 4), width - half - 4)
            front.append(_text(mid, y + 12, label))
            left, right_edge = min(a, b, mid - half), max(a, b, mid + half)
        if step.loop:
            top = y - LOOP + 2
            back.append(
                f'<rect x="{left - 6:.1f}" y="{top:.1f}" width="{right_edge - left + 12:.1f}" '
                f'height="{ROW + LOOP:.1f}" fill="none" stroke="#8c959f"/>'
            )
            front.append(_text(left, top + 11, f"loop: {step.loop}", anchor="start"))
        y += ROW
    height = y + HEAD + MARGIN
    for pid in ids:
        back.append(
            f'<line x1="{x[pid]:.1f}" y1="{MARGIN + HEAD}" x2="{x[pid]:.1f}" '
            f'y2="{height - MARGIN - HEAD}" stroke="#afb8c1" stroke-dasharray="3 3"/>'
        )
        for top in (MARGIN, height - MARGIN - HEAD):
            front.append(
                f'<rect x="{x[pid] - COLUMN / 2 + 6:.1f}" y="{top}" width="{COLUMN - 12}" '
                f'height="{HEAD}" rx="4" fill="#f6f8fa" stroke="{INK}"/>'
            )
            name, detail = seq.participants[pid]
            if detail:
                front.append(_text(x[pid], top + 16, name, weight="bold"))
                front.append(_text(x[pid], top + 30, detail))
            else:
                front.append(_text(x[pid], top + HEAD / 2 + 4, name, weight="bold"))
    style = (
        f"text{{font-family:Helvetica,Arial,sans-serif;font-size:{FONT}px;fill:{INK}}}"
        ".halo{paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round}"
        f".arrow{{fill:none;stroke:{INK};stroke-width:1.2;marker-end:url(#pdwire-seq-head)}}"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height:.0f}" '
        f'width="100%" style="max-width:{width}px;height:auto" role="img" '
        'aria-label="sequence diagram of one request">'
        f"<style>{style}</style>"
        '<defs><marker id="pdwire-seq-head" viewBox="0 0 10 10" refX="10" refY="5" '
        'markerWidth="7" markerHeight="7" orient="auto">'
        f'<path d="M0,0 L10,5 L0,10 z" fill="{INK}"/></marker></defs>'
        f'<rect width="{width}" height="{height:.0f}" fill="#fff"/>'
        + "".join(back)
        + "".join(front)
        + "</svg>"
    )


def step_table(seq: Sequence) -> str:
    """The steps as a Markdown table, phase by phase."""
    lines = ["| step | from | to | what happens |", "|---|---|---|---|"]
    for s in seq.steps:
        if s.n in seq.phases:
            lines.append(f"| | | | **{seq.phases[s.n]}** |")
        text = f"{s.text} (repeated: {s.loop})" if s.loop else s.text
        source, target = seq.participants[s.source][0], seq.participants[s.target][0]
        lines.append(f"| {s.n} | {source} | {target} | {text} |")
    return "\n".join(lines) + "\n"


class SequenceDiagram(MarkdownDirective):
    """The diagram, its note and its step list, from the data file named by the argument
    (relative to the document)."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        rel, path = self.env.relfn2path(self.arguments[0])
        self.env.note_dependency(rel)
        try:
            seq = load(Path(path))
        except (OSError, ValueError, KeyError, tomllib.TOMLDecodeError) as exc:
            raise self.error(f"cannot read the sequence: {exc}") from exc
        figure = nodes.raw(
            "",
            f'<div class="pdwire-sequence">{svg(seq)}</div>',
            format="html",
        )
        return [figure, *self.parse(f"{seq.note}\n\n{step_table(seq)}")]
