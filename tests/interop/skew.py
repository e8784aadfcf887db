"""The version-skew matrix: the pair suite, legacy profile, for every P release x D release of
vLLM's MooncakeConnector (``releases``), each side the release's own worker code hosted by an
engine node (``vllm_agent``), run by ``pdwire conformance matrix``.

``python -m tests.interop.skew`` runs it and prints the table; ``--write-docs`` puts it in
``docs/compatibility.md`` between the markers there (``make matrix``). ``--releases`` narrows it
(``--prefill 0.20.0 --decode 0.34.0``: one cell). The JSON of every verdict goes to
``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from conformance import warm_start

from . import releases, vllm_agent

REPO: Final = Path(__file__).resolve().parents[2]
DOC: Final = REPO / "docs" / "compatibility.md"
BEGIN: Final = "<!-- version-skew matrix: make matrix writes what follows -->"
END: Final = "<!-- end of the version-skew matrix -->"
#: vLLM's CPU attention backend takes blocks of a multiple of 32 tokens.
GEOMETRY: Final = ("--layers", "4", "--kv-heads", "4", "--head-dim", "16", "--block-size", "32")
ABORT_S: Final = 5
TIMEOUT_S: Final = 10.0
#: The plain transfer each cell runs first: a pair that fails it skips the rest.
GATE: Final = "pair/5.2/1"
GATE_FAILED: Final = f"not run: the pair failed the gate {GATE}"


def _name(release: str) -> str:
    return f"vllm-{release}"


def _node(role: str, release: str) -> dict[str, Any]:
    command = [
        "{python}", "-m", "pdwire", "node", "--role", role, "--host", "{host}",
        "--port", "{port}", "--profile", "legacy", *GEOMETRY, "--num-blocks", "256",
        "--abort-timeout", str(ABORT_S),
        "--agent", f"tests.interop.vllm_agent:{vllm_agent.name(release)}",
    ]  # fmt: skip
    launch: dict[str, Any] = {
        "command": command,
        "url": "http://{host}:{port}",
        "ready": ["{url}/health"],
        # the node's worker processes import the agent from the repository
        "env": {
            "PYTHONPATH": str(REPO),
            "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(ABORT_S),
            warm_start.MODULES_ENV: vllm_agent.WARM_MODULES,
        },
    }
    if role == "prefill":
        if releases.takes_bootstrap_address(release):  # the node serves one, vLLM registers
            command += ["--bootstrap-port", "{bootstrap_port}", "--bootstrap-host", "{host}"]
        else:  # vLLM's own, which the release serves on the port the node names
            command += ["--bootstrap", "http://{host}:{bootstrap_port}"]
        launch["bootstrap"] = "http://{host}:{bootstrap_port}"
        launch["ready"] = ["{url}/health", "{bootstrap}/query"]
    if releases.engine_blocks_first(release):
        launch["env"][releases.BLOCKS_FIRST_ENV] = "1"
    return launch


def manifest(prefills: Sequence[str], decodes: Sequence[str]) -> dict[str, Any]:
    """The ``pdwire conformance matrix`` manifest of these releases in these roles."""
    impls = []
    for release in releases.RELEASES:
        roles = [
            r for r, chosen in (("prefill", prefills), ("decode", decodes)) if release in chosen
        ]
        if roles:
            impls.append(
                {"name": _name(release), "roles": roles, **{r: _node(r, release) for r in roles}}
            )
    return {
        "implementations": impls,
        "cases": ["pair/*"],
        "timeout": TIMEOUT_S,
        "start_timeout": 180,
        "gate": GATE,
    }


def run(prefills: Sequence[str], decodes: Sequence[str], json_path: Path) -> dict[str, Any]:
    """Run the matrix; its JSON document (``conformance.matrix.to_json``)."""
    for release in {*prefills, *decodes} - {releases.INSTALLED}:
        releases.source_dir(release)  # fetched once, before any node loads it
    with tempfile.TemporaryDirectory(prefix="pdwire-skew-") as tmp:
        path = Path(tmp) / "manifest.json"
        path.write_text(json.dumps(manifest(prefills, decodes), indent=1))
        from conformance import cli

        cli.main(["matrix", str(path), "-q", "--json", str(json_path)])
    return json.loads(json_path.read_text())


def _verdicts(cell: dict[str, Any]) -> dict[str, str]:
    return {c["id"]: c["verdict"] for c in cell["cases"]}


def gate_failure(cell: dict[str, Any]) -> str:
    """What the cell's gate saw when the pair failed it ("" when it passed)."""
    for case in cell["cases"]:
        if case["verdict"] == "blocked" and case["detail"].startswith(GATE_FAILED):
            return case["detail"].split(": ", 2)[-1]
    return ""


def cell_text(cell: dict[str, Any]) -> str:
    """A cell of the table: ✓ with its counts, ✗ with the cases that failed, or ✗ no transfer
    when the pair failed the gate."""
    if cell["error"]:
        return "✗ did not start"
    if gate_failure(cell):
        return "✗ no transfer"
    s = cell["summary"]
    failed = [i for i, v in _verdicts(cell).items() if v == "fail"]
    counts = f"{s['pass']} pass, {s['unsupported']} unsupported"
    if not failed:
        return f"✓ {counts}"
    return f"✗ {', '.join(f'`{i}`' for i in failed)} ({counts})"


def table(doc: dict[str, Any]) -> list[list[str]]:
    """Rows of P releases, columns of D releases, each cell its ``cell_text``."""
    cells = {(c["prefill"], c["decode"]): c for c in doc["results"]}
    return [[cell_text(cells[(p, d)]) for d in doc["decode"]] for p in doc["prefill"]]


def _minutes(doc: dict[str, Any]) -> float:
    began, ended = (datetime.datetime.fromisoformat(doc[k]) for k in ("start_time", "end_time"))
    return (ended - began).total_seconds() / 60


def markdown(doc: dict[str, Any]) -> str:
    """The table (rows P, columns D) and the cause of every failure in it."""
    lines = [
        "| P \\ D | " + " | ".join(doc["decode"]) + " |",
        "|---" * (len(doc["decode"]) + 1) + "|",
    ]
    for p, row in zip(doc["prefill"], table(doc), strict=True):
        lines.append(f"| **{p}** | " + " | ".join(row) + " |")
    causes = []
    for c in doc["results"]:
        pair = f"P {c['prefill']} x D {c['decode']}"
        if c["error"]:
            causes.append(f"- {pair}: did not start: {c['error'].splitlines()[0][:300]}")
        elif why := gate_failure(c):
            causes.append(f"- {pair}: `{GATE}` failed, the other cases were not run: {why}")
        else:
            causes += [
                f"- {pair}, `{case['id']}`: {case['detail'].splitlines()[0][:300]}"
                for case in c["cases"]
                if case["verdict"] == "fail"
            ]
    lines += [
        "",
        f"Measured here (2 cores), {doc['start_time']} to {doc['end_time']}: "
        f"{len(doc['results'])} cells in {_minutes(doc):.1f} minutes.",
    ]
    if causes:
        lines += ["", "What each failing cell saw:", "", *causes]
    return "\n".join(lines)


def write_docs(text: str, doc: Path = DOC) -> None:
    """Put ``text`` between the markers of ``doc``."""
    page = doc.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise SystemExit(f"{doc} has no markers {BEGIN!r} ... {END!r}")
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", page), encoding="utf-8")


def documented(doc: Path = DOC) -> str:
    """What ``docs/compatibility.md`` holds between the markers."""
    page = doc.read_text(encoding="utf-8")
    return page.split(BEGIN, 1)[1].split(END, 1)[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.interop.skew", description=__doc__)
    parser.add_argument("--prefill", nargs="+", default=list(releases.RELEASES), metavar="REL")
    parser.add_argument("--decode", nargs="+", default=list(releases.RELEASES), metavar="REL")
    parser.add_argument("--json", type=Path, default=REPO / ".whl" / "skew.json", metavar="PATH")
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOC.name}")
    parser.add_argument(
        "--from-json", action="store_true", help="render the JSON of an earlier run, run nothing"
    )
    args = parser.parse_args(argv)
    unknown = {*args.prefill, *args.decode} - set(releases.RELEASES)
    if unknown:
        parser.error(f"not a release the tier knows: {sorted(unknown)}; known: {releases.RELEASES}")
    from_run = json.loads(args.json.read_text()) if args.from_json else None
    doc = from_run or run(args.prefill, args.decode, args.json)
    text = markdown(doc)
    print(text)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
