"""``pdwire conformance matrix FILE``: the pair suite over every P x D combination of the
implementations a manifest lists, like the QUIC interop runner's matrix.

The manifest (JSON) names each implementation, the roles it plays and how to start it in each:
a command (an argument list, or one string split like a shell would) whose ``{port}``,
``{bootstrap_port}``, ``{host}`` and ``{python}`` are filled in, its URL templates and the URLs
that must answer HTTP 200 before it counts as ready. For each combination the runner starts P and
D, runs the pair suite, stops both, and prints an N x M matrix of pass / fail / unsupported
counts: "unsupported" is not "failed".

::

    {"implementations": [
      {"name": "pdwire-legacy", "roles": ["prefill", "decode"],
       "prefill": {"command": ["{python}", "-m", "pdwire", "node", "--role", "prefill",
                               "--port", "{port}", "--bootstrap-port", "{bootstrap_port}",
                               "--profile", "legacy"],
                   "url": "http://{host}:{port}", "bootstrap": "http://{host}:{bootstrap_port}",
                   "ready": ["{url}/health", "{bootstrap}/query"]},
       "decode": {...}}],
     "cases": ["pair/*"], "timeout": 10, "start_timeout": 120, "gate": "pair/5.2/1"}

``gate`` (optional) names a case each cell runs first: when the pair fails it, the cell's other
cases are blocked, each naming the gate and what the gate saw (the last side-channel messages
between the pair with their error texts), so a pair that cannot transfer at all costs one case's
timeout, not every case's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from .case import Case, Suite, Verdict, all_cases
from .peers.http import client, probe
from .ports import free_port
from .runner import (
    DEFAULT_REQUEST_TIMEOUT,
    Progress,
    Result,
    RunOptions,
    blocked,
    scale_for,
    select,
    summary,
)
from .testees import reap_killed, tail_of

ROLES: Final = ("prefill", "decode")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_POLL_S: Final = 0.2


class ManifestError(ValueError):
    """The manifest cannot be used; the message says where."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """How to start an implementation in one role."""

    command: tuple[str, ...]
    url: str
    bootstrap: str = ""  # prefill only
    ready: tuple[str, ...] = ("{url}/health",)
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    launches: dict[str, Launch]  # role -> how

    def plays(self, role: str) -> bool:
        return role in self.launches


@dataclasses.dataclass(frozen=True)
class Manifest:
    implementations: tuple[Implementation, ...]
    cases: tuple[str, ...] = ("pair/*",)
    timeout: float = DEFAULT_REQUEST_TIMEOUT  # per reply or answer, as --timeout
    start_timeout: float = 120.0
    gate: str = ""  # a case run first; when it fails, the cell's other cases are blocked


def _launch(where: str, role: str, doc: Any) -> Launch:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}.{role}: expected an object")
    command = doc.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise ManifestError(f"{where}.{role}.command: expected a string or a list of strings")
    url = doc.get("url")
    if not isinstance(url, str):
        raise ManifestError(f"{where}.{role}.url: expected a string")
    bootstrap = doc.get("bootstrap", "")
    if role == "prefill" and not bootstrap:
        raise ManifestError(f"{where}.prefill.bootstrap: a P needs its bootstrap server's URL")
    ready = doc.get("ready", ["{url}/health"])
    ready = [ready] if isinstance(ready, str) else ready
    env = doc.get("env", {})
    if not isinstance(ready, list) or not isinstance(env, dict):
        raise ManifestError(f"{where}.{role}: ready must be URLs, env an object")
    return Launch(
        tuple(command),
        url,
        str(bootstrap),
        tuple(map(str, ready)),
        tuple((str(k), str(v)) for k, v in env.items()),
    )


def load_manifest(path: str | Path) -> Manifest:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: {exc}") from None
    items = doc.get("implementations") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise ManifestError(f"{path}: expected {{'implementations': [...]}}")
    impls = []
    for i, item in enumerate(items):
        where = f"implementations[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ManifestError(f"{where}: expected an object with a name")
        roles = item.get("roles", [r for r in ROLES if r in item])
        if not isinstance(roles, list) or not roles or not set(roles) <= set(ROLES):
            raise ManifestError(f"{where}.roles: expected some of {list(ROLES)}")
        impls.append(
            Implementation(item["name"], {r: _launch(where, r, item.get(r)) for r in roles})
        )
    names = [i.name for i in impls]
    if len(set(names)) != len(names):
        raise ManifestError(f"{path}: implementation names repeat: {names}")
    cases = doc.get("cases", ["pair/*"])
    gate = doc.get("gate", "")
    if gate and not any(c.id == gate and c.suite is Suite.PAIR for c in all_cases()):
        raise ManifestError(f"{path}: gate {gate!r} is not a case of the pair suite")
    return Manifest(
        tuple(impls),
        tuple([cases] if isinstance(cases, str) else cases),
        float(doc.get("timeout", DEFAULT_REQUEST_TIMEOUT)),
        float(doc.get("start_timeout", 120.0)),
        str(gate),
    )


# -- running one implementation --------------------------------------------------------------


@dataclasses.dataclass
class Running:
    name: str
    role: str
    url: str
    bootstrap: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        return tail_of(self.log, lines)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL of its process group (its workers) if it does not exit."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                reap_killed(self.process)
        self.log.unlink(missing_ok=True)


class StartError(RuntimeError):
    pass


async def start(impl: Implementation, role: str, start_timeout: float, host: str) -> Running:
    """Start ``impl`` as ``role`` and wait until every ready URL answers HTTP 200."""
    launch = impl.launches[role]
    values = {
        "host": host,
        "python": sys.executable,
        "port": str(free_port(host)),
        "bootstrap_port": str(free_port(host)),
    }
    try:
        argv = [a.format_map(values) for a in launch.command]
        url = launch.url.format_map(values).rstrip("/")
        bootstrap = launch.bootstrap.format_map(values).rstrip("/")
        ready = [r.format_map({**values, "url": url, "bootstrap": bootstrap}) for r in launch.ready]
    except (KeyError, ValueError) as exc:
        raise StartError(f"{impl.name} as {role}: bad placeholder {exc}") from None
    fd, name = tempfile.mkstemp(prefix=f"pdwire-matrix-{role}-", suffix=".log")
    env = {**os.environ, **dict(launch.env)}
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    running = Running(impl.name, role, url, bootstrap, process, Path(name))
    deadline = time.monotonic() + start_timeout
    try:
        async with client(2.0) as http:
            for target in ready:
                while not await _answers(http, target):
                    if process.poll() is not None:
                        raise StartError(
                            f"{impl.name} as {role} exited with {process.returncode}:\n"
                            f"{running.tail()}"
                        )
                    if time.monotonic() >= deadline:
                        raise StartError(
                            f"{impl.name} as {role}: {target} did not answer 200 within "
                            f"{start_timeout}s:\n{running.tail()}"
                        )
                    await asyncio.sleep(_POLL_S)  # polling a child for readiness
    except BaseException:
        await asyncio.to_thread(running.stop)
        raise
    return running


async def _answers(http: httpx.AsyncClient, url: str) -> bool:
    got = await probe(url, http)
    return got is not None and got.status_code == 200


# -- the matrix ------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    prefill: str
    decode: str
    results: list[Result] = dataclasses.field(default_factory=list)
    error: str = ""  # the pair could not be started or reached
    duration_s: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        return summary(self.results)

    @property
    def failed(self) -> bool:
        return bool(self.error) or any(r.unexpected for r in self.results)

    def text(self) -> str:
        if self.error:
            return "error"
        c = self.counts
        return f"{c['pass']}/{c['fail']}/{c['unsupported']}"


async def run_cell(
    p_impl: Implementation,
    d_impl: Implementation,
    manifest: Manifest,
    cases: Sequence[Case],
    run_options: RunOptions,
    quiet: bool,
    host: str = "127.0.0.1",
) -> Cell:
    from .suites.pair_env import PairOptions, run_pair

    cell = Cell(p_impl.name, d_impl.name)
    began = time.monotonic()
    started = await asyncio.gather(
        start(p_impl, "prefill", manifest.start_timeout, host),
        start(d_impl, "decode", manifest.start_timeout, host),
        return_exceptions=True,
    )
    running = [s for s in started if isinstance(s, Running)]
    try:
        errors = [s for s in started if isinstance(s, BaseException)]
        if errors:
            cell.error = "; ".join(str(e) for e in errors)
            return cell
        p, d = started
        assert isinstance(p, Running) and isinstance(d, Running)
        options = PairOptions(
            prefill=p.url,
            prefill_bootstrap=p.bootstrap,
            decode=d.url,
            request_timeout=manifest.timeout,
            observer_host=host,
        )
        progress = Progress(len(cases), quiet=quiet)
        first = [c for c in cases if c.id == manifest.gate]
        rest = [c for c in cases if c.id != manifest.gate]
        try:
            cell.results = await run_pair(options, first, run_options, progress)
            if any(r.verdict is Verdict.FAIL for r in cell.results):
                saw = gate_detail(cell.results[0])
                why = f"the pair failed the gate {manifest.gate}: {saw}"
                cell.results += [blocked(c, why) for c in rest]
            else:
                cell.results += await run_pair(options, rest, run_options, progress)
        except RuntimeError as exc:
            cell.error = str(exc)
    finally:
        await asyncio.gather(*(asyncio.to_thread(r.stop) for r in running))
        cell.duration_s = round(time.monotonic() - began, 2)
    return cell


def gate_detail(result: Result, last: int = 3) -> str:
    """What a failed gate saw: its detail, and the error texts of the side-channel messages it
    relayed last."""
    seen = []
    for entry in result.log.entries:
        data = entry.data
        if isinstance(data, str):
            with contextlib.suppress(ValueError):
                data = json.loads(data)
        text = data.get("err_msg") if isinstance(data, dict) else None
        said = f"{entry.channel.split(' via ')[0]} {entry.what}: {text}" if text else ""
        if entry.what.startswith("PROBLEM"):
            said = entry.what
        if said and said not in seen:
            seen.append(said)
    tail = "; ".join(seen[-last:])
    return f"{result.detail.splitlines()[0] if result.detail else ''}" + (
        f" ({tail})" if tail else ""
    )


def render(cells: Sequence[Cell], prefills: Sequence[str], decodes: Sequence[str]) -> str:
    """The N x M table (rows P, columns D), then what failed in each cell."""
    by = {(c.prefill, c.decode): c for c in cells}
    head = ["P \\ D", *decodes]
    rows = [[p, *(by[(p, d)].text() if (p, d) in by else "-" for d in decodes)] for p in prefills]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line]
    for i, row in enumerate([head, *rows]):
        out.append("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            out.append(line)
    out += [line, "cells: pass/fail/unsupported cases (unsupported is not failed)"]
    for c in cells:
        if c.error:
            out.append(f"{c.prefill} x {c.decode}: error: {c.error.splitlines()[0]}")
        failed = [r.case.id for r in c.results if r.unexpected]
        if failed:
            out.append(f"{c.prefill} x {c.decode}: failed {', '.join(failed)}")
    return "\n".join(out)


def to_json(manifest: Manifest, cells: Sequence[Cell], began: str, ended: str) -> dict[str, Any]:
    return {
        "start_time": began,
        "end_time": ended,
        "prefill": [i.name for i in manifest.implementations if i.plays("prefill")],
        "decode": [i.name for i in manifest.implementations if i.plays("decode")],
        "results": [
            {
                "prefill": c.prefill,
                "decode": c.decode,
                "summary": c.counts,
                "error": c.error,
                "duration_s": c.duration_s,
                "cases": [
                    {"id": r.case.id, "verdict": r.verdict.value, "detail": r.detail}
                    for r in c.results
                ],
            }
            for c in cells
        ],
    }


async def run_matrix(
    manifest: Manifest, cases: Sequence[Case], run_options: RunOptions, quiet: bool
) -> list[Cell]:
    cells = []
    for p in (i for i in manifest.implementations if i.plays("prefill")):
        for d in (i for i in manifest.implementations if i.plays("decode")):
            print(f"== P {p.name} x D {d.name}", file=sys.stderr, flush=True)
            cells.append(await run_cell(p, d, manifest, cases, run_options, quiet))
    return cells


def add_matrix_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``matrix`` to ``pdwire conformance``'s subcommands."""
    p: argparse.ArgumentParser = sub.add_parser(
        "matrix",
        help="run the pair suite over every P x D combination of a manifest's implementations",
        description="Start each P x D combination of the implementations FILE lists (JSON: "
        "name, roles, and per role a command with {port}/{bootstrap_port}/{host}/{python} "
        "placeholders, URL templates and ready URLs), run the pair suite against it, stop it, "
        "and print the N x M matrix of pass/fail/unsupported counts.",
    )
    p.add_argument(
        "file", metavar="FILE", help="the manifest (see conformance/matrix.example.json)"
    )
    p.add_argument("--cases", action="append", metavar="GLOB", help="override the manifest's cases")
    p.add_argument("--timeout", type=float, metavar="S", help="override the manifest's timeout")
    p.add_argument("--json", metavar="PATH", help="write the matrix and every verdict as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no line per case")
    p.set_defaults(func=cmd_matrix)
    return p


def cmd_matrix(args: argparse.Namespace) -> int:
    try:
        manifest = load_manifest(args.file)
    except ManifestError as exc:
        print(f"pdwire conformance matrix: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.timeout is not None:
        manifest = dataclasses.replace(manifest, timeout=args.timeout)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    cases = [c for c in select(all_cases(), args.cases or manifest.cases) if c.suite is Suite.PAIR]
    began = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    options = RunOptions(timeout_scale=scale_for(manifest.timeout))
    cells = asyncio.run(run_matrix(manifest, cases, options, args.quiet))
    ended = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    prefills = [i.name for i in manifest.implementations if i.plays("prefill")]
    decodes = [i.name for i in manifest.implementations if i.plays("decode")]
    print(render(cells, prefills, decodes))
    if args.json:
        doc = to_json(manifest, cells, began, ended)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return EXIT_FAILED if any(c.failed for c in cells) else EXIT_OK
