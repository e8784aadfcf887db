"""Reports of a run: JSON (the machine-readable record), JUnit XML (for CI) and one
self-contained HTML file (for people), each with every case's verdict, requirement and wire log."""

from __future__ import annotations

import dataclasses
import datetime
import html
import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from .case import Verdict
from .runner import Result, summary


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def case_record(r: Result) -> dict[str, Any]:
    c = r.case
    return {
        "id": c.id,
        "suite": c.suite.value,
        "section": c.section,
        "level": c.level.value,
        "verdict": r.verdict.value,
        "requirement": c.requirement.text,
        "requirement_id": c.requirement.id,
        "covers": list(c.covers),
        "title": c.title,
        "duration_s": r.duration_s,
        "detail": r.detail,
        "known_failing": r.known_failing,
        "known_flaky": r.known_flaky,
        "unexpected": r.unexpected,
        "risk": c.risk,
        "breaks_testee": c.breaks_testee,
        "wirelog": [
            {**dataclasses.asdict(e), "t": round(e.t, 4), "data": _jsonable(e.data)}
            for e in r.log.entries
        ],
    }


def document(results: Sequence[Result], testee: dict[str, Any]) -> dict[str, Any]:
    return {
        "harness": f"pdwire-conformance {__version__}",
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "testee": testee,
        "summary": summary(results),
        "unexpected": [r.case.id for r in results if r.unexpected],
        "cases": [case_record(r) for r in results],
    }


def write_json(path: str | Path, results: Sequence[Result], testee: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(document(results, testee), indent=1) + "\n", encoding="utf-8")


def write_junit(path: str | Path, results: Sequence[Result], testee: dict[str, Any]) -> None:
    suites = ET.Element("testsuites", name="pdwire conformance")
    by_suite: dict[str, list[Result]] = {}
    for r in results:
        by_suite.setdefault(r.case.suite.value, []).append(r)
    for name, rs in by_suite.items():
        failures = sum(r.unexpected for r in rs)
        skipped = sum(r.verdict in (Verdict.SKIPPED, Verdict.UNSUPPORTED) for r in rs)
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=name,
            tests=str(len(rs)),
            failures=str(failures),
            skipped=str(skipped),
            time=f"{sum(r.duration_s for r in rs):.3f}",
        )
        for r in rs:
            tc = ET.SubElement(
                suite,
                "testcase",
                classname=f"{name}.{r.case.section}",
                name=f"{r.case.id} {r.case.title}",
                time=f"{r.duration_s:.3f}",
            )
            text = f"[{r.case.level.value}] {r.case.requirement.id}: {r.case.requirement.text}"
            if r.unexpected:
                failure = ET.SubElement(tc, "failure", message=r.detail or r.verdict.value)
                failure.text = f"{text}\n{_wirelog_text(r)}"
            elif r.verdict in (Verdict.SKIPPED, Verdict.UNSUPPORTED):
                ET.SubElement(tc, "skipped", message=f"{r.verdict.value}: {r.detail}")
            elif r.verdict is not Verdict.PASS:
                ET.SubElement(tc, "system-out").text = f"{r.verdict.value}: {r.detail}"
    ET.indent(suites)
    Path(path).write_bytes(ET.tostring(suites, encoding="utf-8", xml_declaration=True))


def wirelog_line(entry: Mapping[str, Any]) -> str:
    """One wire-log entry (an item of a case's ``wirelog``) as a line: when, which way, where,
    what."""
    return f"{entry['t']:8.3f}s {entry['direction']} {entry['channel']} {entry['what']}"


def _wirelog_text(r: Result) -> str:
    return "\n".join(wirelog_line(vars(e)) for e in r.log.entries)


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:4px 6px;
text-align:left;vertical-align:top}th{background:#f4f4f4}.v{font-weight:600;white-space:nowrap}
.pass{color:#176b2c}.fail{color:#b00020}.non-strict{color:#a15c00}.informational{color:#35618f}
.unsupported,.skipped{color:#666}.unexpected{background:#fde8ea}pre{white-space:pre-wrap;
font-size:12px;background:#fafafa;padding:6px;margin:4px 0}details summary{cursor:pointer}
.sum span{margin-right:1.5em}
"""


def write_html(path: str | Path, results: Sequence[Result], testee: dict[str, Any]) -> None:
    doc = document(results, testee)
    e = html.escape
    rows = []
    for c in doc["cases"]:
        log = "\n".join(
            wirelog_line(w)
            + (f"\n           {json.dumps(w['data'])[:2000]}" if w["data"] is not None else "")
            for w in c["wirelog"]
        )
        cls = "unexpected" if c["unexpected"] else ""
        rows.append(
            f"<tr class='{cls}'><td><code>{e(c['id'])}</code></td>"
            f"<td class='v {e(c['verdict'])}'>{e(c['verdict'])}</td><td>{e(c['level'])}</td>"
            f"<td>{e(c['title'])}<details><summary>requirement {e(c['requirement_id'])}"
            f"</summary><blockquote>{e(c['requirement'])}</blockquote>"
            f"<p>covers {e(', '.join(c['covers']))}</p><pre>{e(log)}</pre></details>"
            f"{'<pre>' + e(c['detail']) + '</pre>' if c['detail'] else ''}</td>"
            f"<td>{c['duration_s']:.2f}s</td></tr>"
        )
    counts = "".join(f"<span class='{e(k)}'>{e(k)}: {v}</span>" for k, v in doc["summary"].items())
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>pdwire conformance: {e(str(testee.get('name', 'report')))}</title>"
        f"<style>{_CSS}</style></head><body><h1>pdwire conformance report</h1>"
        f"<p>{e(doc['harness'])}, {e(doc['finished'])}</p>"
        f"<pre>{e(json.dumps(testee, indent=1))}</pre><p class='sum'>{counts}</p>"
        f"<p>unexpected: {e(', '.join(doc['unexpected']) or 'none')}</p>"
        "<table><tr><th>case</th><th>verdict</th><th>level</th><th>what</th><th>time</th></tr>"
        + "".join(rows)
        + "</table></body></html>"
    )
    Path(path).write_text(page, encoding="utf-8")
