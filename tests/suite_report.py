"""Running ``pdwire conformance`` in the test's own process and reading its JSON report: the
helpers the tests that run a suite share. A run's report is ``tmp_path/NAME.json``; ``doc`` is
that report as parsed, its ``cases`` a list of objects with ``id``, ``verdict`` and ``detail``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance import cli


def run(
    tmp_path: Path, name: str, args: Sequence[str], *, quiet: bool = True
) -> tuple[int, dict[str, Any]]:
    """Run ``pdwire conformance ARGS`` (with ``-q`` unless not ``quiet``) in this process, its
    JSON report at ``tmp_path/NAME.json``: the exit status and the report."""
    code = cli.main([*args, *(["-q"] if quiet else []), "--json", str(tmp_path / f"{name}.json")])
    return code, read(tmp_path, name)


def read(tmp_path: Path, name: str) -> dict[str, Any]:
    """The report of the earlier run ``name``."""
    doc: dict[str, Any] = json.loads((tmp_path / f"{name}.json").read_text())
    return doc


def cases(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each case of the report by its id."""
    return {c["id"]: c for c in doc["cases"]}


def verdicts(doc: dict[str, Any]) -> dict[str, str]:
    """Each case's verdict by its id."""
    return {c["id"]: c["verdict"] for c in doc["cases"]}


def unexpected(doc: dict[str, Any]) -> dict[str, str]:
    """The verdict and detail of each unexpected case by its id: a failure nobody expected, a
    known-failing case that passed, or a case that was not run (blocked), with the reason."""
    return {c["id"]: f"{c['verdict']}: {c['detail']}" for c in doc["cases"] if c["unexpected"]}


def only(doc: dict[str, Any]) -> dict[str, Any]:
    """The case of a report of one case (it fails unless there is exactly one)."""
    case: dict[str, Any]
    (case,) = doc["cases"]
    return case
