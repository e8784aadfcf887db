"""The spec's numbered requirements (``spec/*.md``), as data the cases quote.

A requirement is one bullet that starts with its bold identifier (``**3.2-R1**`` or, in chapter
10, ``**10.3.2**``). Its level is its first RFC 2119 keyword. ``requirements.json`` beside this
module holds them, so an installed harness quotes the spec it was built from; ``pdwire
conformance requirements --write`` regenerates it from ``spec/`` and a test fails when it drifts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
from pathlib import Path
from typing import Final

CATALOGUE: Final = Path(__file__).with_name("requirements.json")
SPEC_DIR: Final = Path(__file__).resolve().parents[1] / "spec"

_BULLET: Final = re.compile(
    r"^- \*\*(?P<id>\d+(?:\.\d+)*(?:-R\d+)?)\*\*(?P<body>.*?)(?=^- |^\s*$|^#|\Z)", re.M | re.S
)
_KEYWORD: Final = re.compile(r"\b(MUST NOT|MUST|REQUIRED|SHALL NOT|SHALL|SHOULD NOT|SHOULD|MAY)\b")
_PDWIRE2: Final = "*(pdwire/2)*"


class Level(enum.StrEnum):
    """RFC 2119 level of a requirement (the NOT forms fold into their positive)."""

    MUST = "MUST"
    SHOULD = "SHOULD"
    MAY = "MAY"


_LEVELS: Final = {
    "MUST": Level.MUST,
    "MUST NOT": Level.MUST,
    "REQUIRED": Level.MUST,
    "SHALL": Level.MUST,
    "SHALL NOT": Level.MUST,
    "SHOULD": Level.SHOULD,
    "SHOULD NOT": Level.SHOULD,
    "MAY": Level.MAY,
}


@dataclasses.dataclass(frozen=True)
class Requirement:
    id: str  # "3.2-R1" or "10.3.2"
    section: str  # "3.2", "10.3"
    level: Level
    text: str  # the sentence as the spec states it, whitespace folded
    pdwire2: bool  # marked *(pdwire/2)*: a fix of pdwire/2 over vLLM 0.33


def section_of(req_id: str) -> str:
    """``3.2-R1`` -> ``3.2``; ``10.3.2`` -> ``10.3``."""
    if "-R" in req_id:
        return req_id.split("-R")[0]
    return req_id.rsplit(".", 1)[0]


def parse(markdown: str) -> list[Requirement]:
    """Every numbered requirement of one chapter, in order."""
    found = []
    for m in _BULLET.finditer(markdown):
        text = " ".join(m["body"].split())
        keyword = _KEYWORD.search(text)
        if keyword is None:
            continue  # a numbered note without a keyword carries no requirement
        pdwire2 = text.startswith(_PDWIRE2)
        if pdwire2:
            text = text[len(_PDWIRE2) :].strip()
        found.append(Requirement(m["id"], section_of(m["id"]), _LEVELS[keyword[1]], text, pdwire2))
    return found


def parse_spec(spec_dir: Path = SPEC_DIR) -> list[Requirement]:
    """Every requirement of the normative chapters, in chapter order."""
    chapters = sorted(spec_dir.glob("[0-9][0-9]-*.md"))
    return [r for chapter in chapters for r in parse(chapter.read_text(encoding="utf-8"))]


def dump(reqs: list[Requirement]) -> str:
    rows = [{**dataclasses.asdict(r), "level": str(r.level)} for r in reqs]
    return json.dumps(rows, indent=1, ensure_ascii=False) + "\n"


@functools.cache
def catalogue() -> dict[str, Requirement]:
    """The requirements this harness was built from, by id."""
    rows = json.loads(CATALOGUE.read_text(encoding="utf-8"))
    return {
        row["id"]: Requirement(
            row["id"], row["section"], Level(row["level"]), row["text"], row["pdwire2"]
        )
        for row in rows
    }


def get(req_id: str) -> Requirement:
    try:
        return catalogue()[req_id]
    except KeyError:
        raise KeyError(f"no requirement {req_id!r} in the spec") from None
