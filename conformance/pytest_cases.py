"""Every conformance case as a pytest test: ``pytest --pyargs conformance.pytest_cases`` with the
``--pdwire-*`` options of ``conformance.pytest_plugin`` naming the testees (``--pdwire-cases`` to
choose). Suites whose testee is not named are skipped."""

from __future__ import annotations

from conformance.case import Case
from conformance.pytest_plugin import Testee


def test_pdwire_case(pdwire_case: Case, pdwire_testee: Testee) -> None:
    pdwire_testee.check(pdwire_case)
