"""Every conformance case as a pytest test: ``pytest --pyargs conformance.pytest_cases`` with the
``--pdwire-*`` options of ``conformance.pytest_plugin`` naming the testees. Suites whose testee
is not named are skipped."""

from __future__ import annotations

import pytest

from conformance.case import Case
from conformance.pytest_plugin import Testee, cases


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_pdwire_case(case: Case, pdwire_testee: Testee) -> None:
    pdwire_testee.check(case)
