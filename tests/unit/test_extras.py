"""Which extras each command needs, and which of their packages are missing (pdwire.extras)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pdwire import extras

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
#: As the installed metadata lists them (Requires-Dist).
REQUIRES = [
    "msgspec>=0.18",
    'pyzmq>=25; extra == "runtime"',
    'httpx>=0.25; extra == "runtime"',
    'mooncake-transfer-engine-non-cuda>=0.3.13; extra == "mooncake"',
    'pdwire[mooncake,runtime]; extra == "node"',
    'torch==2.13.0+cpu; extra == "node"',
    "no-such-distribution-of-pdwire; python_version >= '3' and extra == 'ghost'",
    'Pdwire[node] ; extra == "loop"',
    'pdwire[loop]; extra == "node"',
]


def test_every_command_and_extra_is_pyproject_s() -> None:
    project = PYPROJECT["project"]
    assert set(extras.COMMANDS) == set(project["entry-points"]["pdwire.commands"])
    for command, needed in extras.COMMANDS.items():
        assert set(needed) <= set(project["optional-dependencies"]), command


def test_requirements_unfold_the_extras_an_extra_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "requires", lambda name: REQUIRES)
    assert extras.requirements(["runtime"]) == {"pyzmq", "httpx"}
    assert extras.requirements(["node"]) == {
        "pyzmq",
        "httpx",
        "mooncake-transfer-engine-non-cuda",
        "torch",
    }
    assert extras.requirements(["loop"]) == extras.requirements(["node"])
    assert extras.requirements([]) == set()


def test_missing_names_only_what_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "requires", lambda name: [*REQUIRES, 'msgspec; extra == "ghost"'])
    assert extras.missing(["ghost"]) == ["no-such-distribution-of-pdwire"]


def test_nothing_is_missing_where_pdwire_is_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def absent(name: str) -> list[str]:
        raise extras.PackageNotFoundError(name)

    monkeypatch.setattr(extras, "requires", absent)
    assert extras.missing(["node"]) == []


def test_install_hint() -> None:
    assert extras.install_hint(["runtime", "mooncake"]) == "pip install 'pdwire[runtime,mooncake]'"
