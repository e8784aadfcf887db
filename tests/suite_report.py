"""Running ``pdwire conformance`` in the test's own process and reading its JSON report: the
helpers the tests that run a suite share. A run's report is ``tmp_path/NAME.json``; ``doc`` is
that report as parsed, its ``cases`` a list of objects with ``id``, ``verdict`` and ``detail``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance import cli, report


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


def unexpected(doc: dict[str, Any]) -> str:
    """Each unexpected case (a failure nobody expected, a known-failing case that passed, a case
    that was not run), "" when there is none: a line with its verdict and whole detail, and
    under a case that ran, its wire log's timeline. Cases blocked for one reason share a line."""
    lines: list[str] = []
    blocked: dict[str, list[str]] = {}
    for c in doc["cases"]:
        if not c["unexpected"]:
            continue
        if c["verdict"] == "blocked":
            blocked.setdefault(c["detail"], []).append(c["id"])
            continue
        lines.append(f"{c['id']}: {c['verdict']}: {c['detail']}")
        lines += [f"    {report.wirelog_line(w)}" for w in c["wirelog"]]
    lines += [f"blocked ({len(ids)}: {', '.join(ids)}): {why}" for why, ids in blocked.items()]
    return "\n".join(lines)


def only(doc: dict[str, Any]) -> dict[str, Any]:
    """The case of a report of one case (it fails unless there is exactly one)."""
    case: dict[str, Any]
    (case,) = doc["cases"]
    return case
