"""The order of the suite: the longest modules first. ``make test`` has pytest-xdist share
the modules out among two workers (``TEST_WORKERS``; ``--dist loadfile``: each module runs
whole on one worker, so that its fixtures start once; the vLLM servers of
``tests/vllm_connector/test_e2e.py`` would otherwise start on both), and no long module starts
near the end to run alone (the Makefile passes ``--no-loadscope-reorder``, else xdist would run
the modules with the most tests first).
"""

from __future__ import annotations

import os
from typing import Final

import pytest

from conformance import ports

#: The modules that take minutes (paths from the repository root). xdist gives the first two to
#: the two workers, and the next ones to the first worker free: the release tier's vLLM nodes
#: follow the self run, and the vLLM servers of test_e2e.py follow them, so that those servers
#: start late in the mutant check and not beside the release tier (beside both, a node of the
#: check once took over 120 s to start, and a pair case of test_e2e.py waited out its 60 s).
LONGEST: Final = (
    "tests/harness/test_mutants.py",
    "tests/harness/test_self.py",
    "tests/interop/test_vllm_conformance.py",
    "tests/vllm_connector/test_e2e.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker, and what it starts, picks free ports from a slice of its own: a port
    picked for a server that binds it minutes later is never picked by the other worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit():
        os.environ[ports.SHARE_ENV] = f"{worker[2:]}/{count}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: i for i, module in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST)))
