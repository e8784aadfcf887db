"""What every registered case must carry, checked without a testee: a quoted requirement of its
section, the requirements it covers, and at least one mutant of the reference testee that it
catches (which must exist, and whose catching ``test_mutants`` shows)."""

from __future__ import annotations

from conformance.case import all_cases
from conformance.requirements import catalogue
from reference_connector import mutants


def test_every_case_names_a_mutant_that_exists() -> None:
    cases = all_cases()
    assert cases
    without = [c.id for c in cases if not c.caught_by]
    assert not without, f"cases that name no mutant proving they can fail: {without}"
    unknown = {m for c in cases for m in c.caught_by} - set(mutants.MUTANTS)
    assert not unknown, f"cases name mutants that do not exist: {sorted(unknown)}"


def test_every_mutant_is_caught_by_a_case() -> None:
    claimed = {m for c in all_cases() for m in c.caught_by}
    assert set(mutants.MUTANTS) <= claimed, sorted(set(mutants.MUTANTS) - claimed)


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
