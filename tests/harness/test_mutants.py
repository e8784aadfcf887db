"""Every mutant of the reference testee is caught: with it, each case that names it fails
(``python -m mutants check --jobs 6``: six groups of mutants side by side, each
switched on and off in testbeds of its own; a mutant that survives that is run again on a node of
its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mutants
from mutants.__main__ import EXIT_OK, main

pytestmark = pytest.mark.conformance


def test_every_mutant_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "mutants.json"
    code = main(["check", "--jobs", "6", "--json", str(report)])
    out, err = capsys.readouterr()
    assert report.exists(), err  # the check ran to its end
    rows = json.loads(report.read_text())
    assert {r["name"] for r in rows} == set(mutants.NAMES)
    survived = {r["name"]: r["verdicts"] for r in rows if not r["caught"]}
    assert not survived, err
    assert code == EXIT_OK, out
