"""The spec's numbered requirements (``spec/*.md``), as data the cases quote.

A requirement is one bullet that starts with its bold identifier (``**3.2-R1**`` or, in chapter
10, ``**10.3.2**``) and its tag, the roles it binds and its profile (``*[P, D; both]*``, spec
README, "Requirement tags"). Its level is its first RFC 2119 keyword; a bullet without one (a
withdrawn requirement) carries no requirement and no tag. ``requirements.json`` beside this module
holds them, so an installed harness quotes the spec it was built from; ``pdwire conformance
requirements --write`` regenerates it from ``spec/`` and a test fails when it drifts.
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
#: The roles a requirement can bind, in the order its tag lists them.
ROLES: Final = ("P", "D", "proxy", "bootstrap")
#: The profiles a requirement can bind: only the legacy profile, only pdwire/2, or both.
PROFILES: Final = ("legacy", "pdwire/2", "both")
_TAG: Final = re.compile(r"^\*\[(?P<roles>[^;\]]*); (?P<profile>[^\]]*)\]\*\s*")


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
    text: str  # the sentence as the spec states it, whitespace folded, without its tag
    roles: tuple[str, ...]  # the roles it binds, of ROLES, in that order
    profile: str  # the profile it binds, one of PROFILES

    @property
    def pdwire2(self) -> bool:
        """Binds only pdwire/2 (in chapter 10: a fix of pdwire/2 over vLLM)."""
        return self.profile == "pdwire/2"


def section_of(req_id: str) -> str:
    """``3.2-R1`` -> ``3.2``; ``10.3.2`` -> ``10.3``."""
    if "-R" in req_id:
        return req_id.split("-R")[0]
    return req_id.rsplit(".", 1)[0]


def parse_tag(req_id: str, text: str) -> tuple[tuple[str, ...], str, str]:
    """The roles and profile of the tag that opens ``text``, and the text after it; a
    ``ValueError`` naming ``req_id`` when the tag is missing or not valid."""
    m = _TAG.match(text)
    if m is None:
        raise ValueError(f"requirement {req_id} has no tag *[roles; profile]* after its id")
    roles = tuple(m["roles"].split(", "))
    if any(r not in ROLES for r in roles) or list(roles) != sorted(set(roles), key=ROLES.index):
        raise ValueError(
            f"requirement {req_id}: roles {m['roles']!r} are not some of {', '.join(ROLES)}, "
            "in that order, comma-separated"
        )
    if m["profile"] not in PROFILES:
        raise ValueError(
            f"requirement {req_id}: profile {m['profile']!r} is not one of {', '.join(PROFILES)}"
        )
    return roles, m["profile"], text[m.end() :]


def parse(markdown: str) -> list[Requirement]:
    """Every numbered requirement of one chapter, in order; a ``ValueError`` for a requirement
    without a valid tag."""
    found = []
    for m in _BULLET.finditer(markdown):
        text = " ".join(m["body"].split())
        keyword = _KEYWORD.search(text)
        if keyword is None:
            continue  # a numbered note without a keyword carries no requirement
        roles, profile, text = parse_tag(m["id"], text)
        level = _LEVELS[keyword[1]]
        found.append(Requirement(m["id"], section_of(m["id"]), level, text, roles, profile))
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
            row["id"],
            row["section"],
            Level(row["level"]),
            row["text"],
            tuple(row["roles"]),
            row["profile"],
        )
        for row in rows
    }


def get(req_id: str) -> Requirement:
    try:
        return catalogue()[req_id]
    except KeyError:
        raise KeyError(f"no requirement {req_id!r} in the spec") from None
