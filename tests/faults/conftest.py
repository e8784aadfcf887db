"""Fixtures of the fault tests: what a test starts itself (``deployment``), its timed requests
(``requests``), and healthy nodes that every module shares (``shared``), which each test leaves
with empty pools and which stop once the last fault test is over."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import httpx
import pytest

from conformance import stacks
from conformance.testees import Testee
from pdwire.roles import Role

from .deployment import Deployment, Requests, Service, stats

#: Lines of each process's log in a failed test's report: its warnings, then its stacks.
LOG_LINES = 120


class Shared:
    """Nodes started on first use and kept for the session, by the options they start with."""

    def __init__(self) -> None:
        self._deployment = Deployment()
        self._nodes: dict[tuple[Any, ...], Testee] = {}

    def get(self, *specs: tuple[Role, dict[str, Any]]) -> list[Testee]:
        """The nodes of ``specs`` (role, options of ``deployment.node``); the missing ones are
        started together."""
        keys = [(role, *sorted(options.items())) for role, options in specs]
        missing = [(k, s) for k, s in zip(keys, specs, strict=True) if k not in self._nodes]
        if missing:
            started = self._deployment.nodes(*(s for _, s in missing))
            self._nodes.update((k, t) for (k, _), t in zip(missing, started, strict=True))
        for key in keys:
            assert self._nodes[key].alive(), f"shared node {key} exited"
        return [self._nodes[k] for k in keys]

    def started(self) -> list[Testee]:
        return list(self._nodes.values())

    def stop(self) -> None:
        self._deployment.stop()


def _title(part: Testee | Service) -> str:
    name = f"{part.role} node" if isinstance(part, Testee) else part.name
    return f"log of the {name} at {part.url}"


def failure_evidence(funcargs: dict[str, Any]) -> list[tuple[str, str]]:
    """What a test's fixtures hold: its requests, each with how long it took or has waited;
    then, in a few lines per process of ``deployment`` and ``shared``, its counters and where
    each of its threads waits; then a section per process: its whole counters and the end of
    its log, ending with the stacks of its threads when it still runs."""
    sections = []
    if isinstance(requests := funcargs.get("requests"), Requests):
        sections.append(("requests", "\n".join(t.state() for t in requests.tracked)))
    parts: list[Testee | Service] = []
    if isinstance(deployment := funcargs.get("deployment"), Deployment):
        parts += deployment.parts
    if isinstance(shared := funcargs.get("shared"), Shared):
        parts += shared.started()
    read = [(p, _stats(p), p.evidence(LOG_LINES)) for p in parts]
    short = ["\n".join([_title(p), *_counters(body), *stacks.digest(log)]) for p, body, log in read]
    sections.append(("where each process waits", "\n".join(short)))
    return sections + [(_title(p), f"stats: {_json(body)}\n{log}") for p, body, log in read]


def _stats(part: Testee | Service) -> dict[str, Any] | str:
    """A live node's ``/pdwire/stats`` (pulls sent, received, answered; blocks held), or why
    there is none."""
    if not isinstance(part, Testee):
        return "none (not a node)"
    if not part.alive():
        return "none (exited)"
    try:
        return stats(part)
    except (httpx.HTTPError, ValueError) as exc:
        return f"not read ({type(exc).__name__}: {exc})"


#: The counters of a node and of each of its workers that the short report shows.
NODE_COUNTERS: Final = ("blocks_in_use", "transfers_held", "oldest_held_s", "requests")
WORKER_COUNTERS: Final = ("pid", "alive", "pulls_sent", "open_sockets", "pulls_received", "writes")


def _json(body: dict[str, Any] | str) -> str:
    return body if isinstance(body, str) else json.dumps(body)


def _counters(node: dict[str, Any] | str) -> list[str]:
    """The lines of the short report for the stats ``node`` (``_stats``)."""
    if isinstance(node, str):
        return [f"  stats: {node}"]
    lines = ["  " + " ".join(f"{k}={node[k]}" for k in NODE_COUNTERS if k in node)]
    for worker in node.get("workers", []):
        counters = " ".join(f"{k}={worker[k]}" for k in WORKER_COUNTERS if k in worker)
        lines.append(f"  {worker.get('name', 'worker')}: {counters}")
    return lines


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report ends with the log of every process it used: a fault that shows
    once in many runs is diagnosed from CI's output, and the logs go when the processes stop."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        report.sections += failure_evidence(getattr(item, "funcargs", {}))


@pytest.fixture(scope="package")  # stopped once the fault tests are over, not with the session
def shared() -> Iterator[Shared]:
    nodes = Shared()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def deployment() -> Iterator[Deployment]:
    parts = Deployment()
    try:
        yield parts
    finally:
        parts.stop()


@pytest.fixture
def requests() -> Iterator[Requests]:
    calls = Requests()
    try:
        yield calls
    finally:
        calls.close()
