"""Fixtures of the fault tests: what a test starts itself (``deployment``), its timed requests
(``requests``), and healthy nodes that every module shares (``shared``), which each test leaves
with empty pools."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from conformance.testees import Testee
from pdwire.roles import Role

from .deployment import Deployment, Requests


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

    def stop(self) -> None:
        self._deployment.stop()


@pytest.fixture(scope="session")
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
