"""What every registered case must carry, checked without a testee: a quoted requirement of its
section, the requirements it covers, and at least one mutant of the reference testee that names
it as a case that catches it (whose catching ``test_mutants`` shows)."""

from __future__ import annotations

import mutants
from conformance.case import all_cases
from conformance.requirements import catalogue


def test_every_case_catches_a_mutant() -> None:
    cases = all_cases()
    assert cases
    named = {c for m in mutants.MUTANTS.values() for c in m.cases}
    without = [c.id for c in cases if c.id not in named]
    assert not without, f"cases that no mutant shows can fail: {without}"


def test_every_mutant_names_cases_that_exist() -> None:
    ids = {c.id for c in all_cases()}
    unknown = {m.name: set(m.cases) - ids for m in mutants.MUTANTS.values() if set(m.cases) - ids}
    assert not unknown, f"mutants name cases that do not exist: {unknown}"


def test_every_case_quotes_a_requirement_of_its_section() -> None:
    reqs = catalogue()
    for c in all_cases():
        assert c.id.split("/")[1] == c.requirement.section
        assert c.requirement.text == reqs[c.requirement.id].text
        assert all(r in reqs for r in c.covers)


def test_the_issue_names_these_mutants() -> None:
    named = {
        "early-free", "omits-remote-pp-size", "stall-on-stop", "duplicate-overwrites",
        "ignores-layout-miss", "wrong-offset", "v2-to-legacy", "crash-on-malformed",
    }  # fmt: skip
    assert named <= set(mutants.MUTANTS)
