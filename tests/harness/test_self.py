"""``pdwire conformance self``: the reference testees pass every MUST case (what make test runs),
and the CLI's reports are written."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance import cli

pytestmark = pytest.mark.conformance


def test_self_passes_every_must_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = {k: tmp_path / f"report.{k}" for k in ("json", "junit", "html")}
    start = time.monotonic()
    code = cli.main(
        ["self", "-q", "--json", str(paths["json"]), "--junit", str(paths["junit"]),
         "--html", str(paths["html"])]
    )  # fmt: skip
    elapsed = time.monotonic() - start
    out = capsys.readouterr().out
    doc = json.loads(paths["json"].read_text())
    failed = {
        c["id"]: c["detail"]
        for c in doc["cases"]
        if c["level"] == "MUST" and c["verdict"] == "fail"
    }
    assert not failed, f"{out}\n{failed}"
    assert code == cli.EXIT_OK, out
    assert doc["summary"]["pass"] > 0 and not doc["unexpected"]
    assert ET.parse(paths["junit"]).getroot().tag == "testsuites"
    assert "pdwire conformance report" in paths["html"].read_text()
    print(f"self: {len(doc['cases'])} cases in {elapsed:.1f}s: {doc['summary']}")
