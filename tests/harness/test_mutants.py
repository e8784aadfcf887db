"""Every mutant of the reference testee is caught: with it, each case that names it fails
(``pdwire conformance mutants --check``: one testbed, mutants switched on and off in it, one
at a time: some cases check an order of events that load on two cores can change)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance import cli
from reference_connector import mutants

pytestmark = pytest.mark.conformance


def test_every_mutant_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "mutants.json"
    code = cli.main(["mutants", "--check", "--json", str(report)])
    out, err = capsys.readouterr()
    assert report.exists(), err  # the check ran to its end
    rows = json.loads(report.read_text())
    assert {r["name"] for r in rows} == set(mutants.NAMES)
    survived = {r["name"]: r["verdicts"] for r in rows if not r["caught"]}
    assert not survived, err
    assert code == cli.EXIT_OK, out
