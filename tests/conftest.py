"""The order of the suite: the longest modules first. ``make test`` has pytest-xdist share
the modules out among two workers (``TEST_WORKERS``; ``--dist loadfile``: each module runs
whole on one worker, so that its fixtures start once; the vLLM servers of
``tests/vllm_connector/test_e2e.py`` would otherwise start on both), and no long module starts
near the end to run alone (the Makefile passes ``--no-loadscope-reorder``, else xdist would run
the modules with the most tests first).
"""

from __future__ import annotations

from typing import Final

import pytest

#: The modules that take minutes (paths from the repository root). xdist gives the first two to
#: the two workers, and the third to the first worker after the first: the vLLM servers of
#: test_e2e.py start only once the mutant check has ended, since the two at once overload two
#: cores (a node of the check once took over 120 s to start).
LONGEST: Final = (
    "tests/harness/test_mutants.py",
    "tests/harness/test_self.py",
    "tests/vllm_connector/test_e2e.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: i for i, module in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST)))
