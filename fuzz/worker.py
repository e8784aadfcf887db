"""One fuzz target under atheris, in its own process (``atheris.Fuzz`` runs once per process).

``python -m fuzz.worker TARGET [libFuzzer flags and corpus dirs]``; TARGET is a name of
``fuzz.targets.TARGETS`` or ``module:function``. pdwire and the target are imported under
atheris's instrumentation, so libFuzzer sees the coverage of their Python code.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

import atheris  # type: ignore[import-untyped]

#: The module name a target given by file path is loaded under.
EXTERNAL: Final = "fuzz_external_target"


def load(spec: str) -> Callable[[bytes], None]:
    """The target named ``spec``: a registered name, ``module:function`` or ``file.py:function``."""
    if ":" not in spec:
        from fuzz.targets import TARGETS

        return TARGETS[spec]
    where, _, function = spec.rpartition(":")
    if where.endswith(".py"):
        found = importlib.util.spec_from_file_location(EXTERNAL, where)
        assert found is not None and found.loader is not None, where
        module = importlib.util.module_from_spec(found)
        sys.modules[EXTERNAL] = module
        found.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    target: Callable[[bytes], None] = getattr(module, function)
    return target


def _self_command(spec: str) -> str:
    """An executable that runs this worker on ``spec``: libFuzzer starts it again to merge."""
    path = Path(tempfile.gettempdir()) / f"pdwire-fuzz-{hashlib.sha1(spec.encode()).hexdigest()}"
    path.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m fuzz.worker {shlex.quote(spec)} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


def main(argv: list[str]) -> None:
    spec, flags = argv[1], argv[2:]
    with atheris.instrument_imports(include=["pdwire", "fuzz", spec.partition(":")[0]]):
        target = load(spec)
    if spec.partition(":")[0].endswith(".py"):  # loaded past the import hook: instrument it here
        target = atheris.instrument_func(target)
    atheris.Setup([_self_command(spec), *flags], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
