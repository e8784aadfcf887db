"""Which cases check which requirement: the traceability table, and the MUSTs no case covers.

``pdwire conformance trace`` prints it (``--markdown`` for the docs); a test fails when a MUST of
the spec has no case, unless ``UNCOVERED`` names it with the reason no case can observe it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from .case import Case, all_cases
from .requirements import PROFILES, ROLES, Level, Requirement, catalogue

#: MUSTs that no case of this harness can observe, each with the reason. A MUST leaves this list
#: when a case covers it (a test fails on a stale entry).
UNCOVERED: Final[dict[str, str]] = {
    "2.1-R4": "whether a sender's list was empty or nil is the sender's own value: both decode "
    "alike; pdwire's encoder is checked against vLLM's bytes in tests/unit/test_vllm_bytes.py",
    "2.3-R4": "an engine sends a message this long only for a batch of about a million blocks, "
    "which no request to a testee here produces",
    "10.10.9": "what D reports to its own scheduler is inside D "
    "(tests/unit/test_consumer.py checks pdwire's D)",
}


@dataclasses.dataclass(frozen=True)
class Row:
    requirement: Requirement
    cases: tuple[str, ...]

    @property
    def covered(self) -> bool:
        return bool(self.cases)


def table(cases: Sequence[Case] | None = None) -> list[Row]:
    """Every requirement of the spec, in spec order, with the ids of the cases that cover it."""
    chosen = all_cases() if cases is None else cases
    by_req: dict[str, list[str]] = {}
    for c in chosen:
        for req in c.covers:
            by_req.setdefault(req, []).append(c.id)
    return [Row(r, tuple(by_req.get(r.id, ()))) for r in catalogue().values()]


def uncovered_musts(rows: Sequence[Row]) -> list[Requirement]:
    return [r.requirement for r in rows if r.requirement.level is Level.MUST and not r.covered]


def counts(cases: Sequence[Case] | None = None) -> dict[str, dict[str, int]]:
    """Cases per level and per chapter, and requirements and the covered ones per level, per
    profile and per role (a requirement that binds two roles counts for each)."""
    chosen = all_cases() if cases is None else cases
    by_level: dict[str, int] = {}
    by_chapter: dict[str, int] = {}
    for c in chosen:
        by_level[c.level.value] = by_level.get(c.level.value, 0) + 1
        chapter = c.section.split(".")[0]
        by_chapter[chapter] = by_chapter.get(chapter, 0) + 1
    covered: dict[str, int] = {}
    total: dict[str, int] = {}
    by_profile = dict.fromkeys(PROFILES, 0)
    covered_by_profile = dict.fromkeys(PROFILES, 0)
    by_role = dict.fromkeys(ROLES, 0)
    covered_by_role = dict.fromkeys(ROLES, 0)
    for row in table(chosen):
        r = row.requirement
        level = r.level.value
        total[level] = total.get(level, 0) + 1
        covered[level] = covered.get(level, 0) + row.covered
        by_profile[r.profile] += 1
        covered_by_profile[r.profile] += row.covered
        for role in r.roles:
            by_role[role] += 1
            covered_by_role[role] += row.covered
    return {
        "cases_by_level": by_level,
        "cases_by_chapter": dict(sorted(by_chapter.items(), key=lambda kv: int(kv[0]))),
        "requirements": total,
        "requirements_covered": covered,
        "requirements_by_profile": by_profile,
        "requirements_covered_by_profile": covered_by_profile,
        "requirements_by_role": by_role,
        "requirements_covered_by_role": covered_by_role,
    }


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| requirement | level | cases |", "|---|---|---|"]
    for row in rows:
        r = row.requirement
        cases = ", ".join(f"`{c}`" for c in row.cases)
        if not cases:
            cases = f"none: {UNCOVERED[r.id]}" if r.id in UNCOVERED else "none"
        lines.append(f"| {r.id} | {r.level.value} | {cases} |")
    return "\n".join(lines) + "\n"
