"""A node's front process (its HTTP API, scheduler and block allocator) loads no torch: only its
worker processes hold KV memory. Each node start would otherwise pay torch's import once more."""

from __future__ import annotations

import subprocess
import sys

FRONT_MODULES = ("reference_connector.cli_node", "reference_connector.node", "pdwire.cli")


def _stdout(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.strip()


def test_the_node_front_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in FRONT_MODULES)
        + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    loaded = _stdout(code)
    assert loaded == "[]", loaded[:500]


def test_the_worker_process_does_import_torch() -> None:
    """The check above can fail: the worker's module is the one that loads torch."""
    code = "import sys, reference_connector.worker_process\nprint('torch' in sys.modules)"
    assert _stdout(code) == "True"
