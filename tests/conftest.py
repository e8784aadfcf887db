"""How ``make test`` shares the tests out among pytest-xdist's workers (``--dist loadgroup``).

Each module is one group, run by one worker, so that a module's fixtures start once (the vLLM
servers of ``tests/vllm_connector/test_e2e.py`` would otherwise start on both workers). The
modules that run the proxy suite are one group between them: its case proxy/5.4/16 binds the
fixed port 8998 (5.4-R16), which two of them running at once would contend for.
"""

from __future__ import annotations

from typing import Final

import pytest

#: The modules that run the proxy suite, by path from the repository root.
FIXED_PORT_MODULES: Final = frozenset(
    {
        "tests/harness/test_mutants.py",
        "tests/harness/test_proxy_suite.py",
        "tests/harness/test_self.py",
    }
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        group = "fixed-port-8998" if module in FIXED_PORT_MODULES else module
        item.add_marker(pytest.mark.xdist_group(group))
