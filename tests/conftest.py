"""The order of the suite. ``make test`` has pytest-xdist share the modules out among two
workers (``TEST_WORKERS``; ``--dist loadfile``: each module runs whole on one worker, so that its
fixtures start once; the vLLM servers of ``tests/vllm_connector/test_e2e.py`` would otherwise
start on both). The modules that take minutes run first, in the chains of ``CHAINS``; the
Makefile passes ``--no-loadscope-reorder``, else xdist would run the modules with the most tests
first.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

import pytest

from conformance import ports
from tests.vllm_connector import fleet

if TYPE_CHECKING:
    from xdist.remote import Producer
    from xdist.scheduler import LoadFileScheduling

#: The modules that take minutes, and the fault tests, in chains of paths from the repository
#: root (a folder, ending in "/", stands for each module under it): each chain is one unit of
#: xdist's work, so its modules run one after another on one worker, and the first two chains
#: start at once, one on each worker. The six vLLM servers of test_e2e.py start with their
#: chain, at the lowest CPU priority (``tests/vllm_connector/fleet.py``), but serve only after
#: the mutant check and only once the release tier's vLLM nodes have stopped
#: (``worker_lock.VLLM``, which both hold): serving beside both on CI's slower machine, vLLM's
#: own D stopped answering, a pair's D held a block past the idle wait, and a release-tier
#: suite failed. The fault tests, whose timers are seconds, run first, beside the release tier:
#: beside the servers, they took 238 s here against 70 s alone, and on CI a node's answer due
#: in milliseconds did not come for 4 to 5 s, three times in two runs. Run before the release
#: tier instead, they held the servers back by the lock: pytest took 1 154 s, against 1 032 s
#: and 1 053 s the same day with the fault tests after the release tier and in this chain.
CHAINS: Final = (
    ("tests/interop/test_vllm_conformance.py",),
    (
        "tests/faults/",
        "tests/harness/test_mutants.py",
        "tests/harness/test_self.py",
        "tests/vllm_connector/test_e2e.py",
    ),
)
#: Modules that run next, before the rest in their order: long ones whose tests mostly wait,
#: so that they run beside the busy middle of the run, not alone at its end. Each test of
#: vLLM's worker code in one process (``test_worker.py``) waits about a second for each
#: transfer engine it destroys: 35 s for the module, which ran last, its worker alone for its
#: last 35 s.
NEXT: Final = ("tests/vllm_connector/test_worker.py",)
_RANK: Final = {path: i for i, path in enumerate(p for chain in CHAINS for p in chain)}
_CHAIN_OF: Final = {path: i for i, chain in enumerate(CHAINS) for path in chain}
_NEXT_RANK: Final = {path: len(_RANK) + i for i, path in enumerate(NEXT)}


def _chained(module: str) -> str | None:
    """The path of ``CHAINS`` that holds ``module``: itself, or a folder above it."""
    if module in _RANK:
        return module
    return next((p for p in _RANK if p.endswith("/") and module.startswith(p)), None)


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker, and what it starts, picks free ports from a slice of its own: a port
    picked for a server that binds it minutes later is never picked by the other worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit():
        os.environ[ports.SHARE_ENV] = f"{worker[2:]}/{count}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _rank(_module(item.nodeid)))


def _rank(module: str) -> int:
    """Where ``module`` runs: by its chain, then ``NEXT``, then every other module."""
    chained = _chained(module)
    if chained is not None:
        return _RANK[chained]
    return _NEXT_RANK.get(module, len(_RANK) + len(NEXT))


@pytest.fixture(autouse=True)
def _vllm_servers_ahead(request: pytest.FixtureRequest) -> None:
    """The first test of the chain that ends in the vLLM servers' module starts those servers."""
    if unit_of(request.node.nodeid) == unit_of(fleet.MODULE):
        fleet.start_ahead(request)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The unit of xdist's work that the test ``nodeid`` belongs to: its chain, or its module."""
    module = _module(nodeid)
    path = _chained(module)
    return module if path is None else f"chain {_CHAIN_OF[path]}"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    """``--dist loadfile`` with the modules of a chain as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ChainedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ChainedFiles(config, log)
