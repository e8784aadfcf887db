"""The extras of the pdwire distribution (``pip install 'pdwire[node]'``): which packages one
brings and which of them are missing here. Read from the installed metadata, so that
pyproject.toml stays the one list of them."""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, distribution, requires
from typing import Final

DISTRIBUTION: Final = "pdwire"
#: The extras each command of the ``pdwire.commands`` entry points needs (pyproject.toml).
COMMANDS: Final[dict[str, tuple[str, ...]]] = {
    "bootstrap": ("runtime",),
    "conformance": ("runtime", "mooncake"),
    "node": ("node",),
    "proxy": ("runtime",),
    "run": ("node",),
    "tap": ("runtime",),
}
_EXTRA: Final = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")
_REQUIREMENT: Final = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def named(extras: Iterable[str]) -> str:
    """``pdwire[extras]``, as pip is given it."""
    return f"{DISTRIBUTION}[{','.join(extras)}]"


def install_hint(extras: Iterable[str]) -> str:
    return f"pip install '{named(extras)}'"


def requirements(extras: Iterable[str]) -> set[str]:
    """The distributions that ``pdwire[extras]`` installs itself, an extra that names other
    extras of pdwire unfolded; none when pdwire is not installed (a source tree on the path)."""
    todo = list(extras)
    if not todo:  # every command without an extra runs this: no metadata to read
        return set()
    try:
        lines = requires(DISTRIBUTION) or []
    except PackageNotFoundError:
        return set()
    by_extra: dict[str, list[tuple[str, list[str]]]] = {}
    for line in lines:
        spec, _, marker = line.partition(";")
        marked = _EXTRA.search(marker)
        parsed = _REQUIREMENT.match(spec)
        if marked and parsed:
            inner = [e.strip() for e in (parsed[2] or "").split(",") if e.strip()]
            by_extra.setdefault(marked[1], []).append((parsed[1], inner))
    found: set[str] = set()
    seen: set[str] = set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for name, inner in by_extra.get(extra, []):
            if _canonical(name) == DISTRIBUTION:
                todo.extend(inner)
            else:
                found.add(name)
    return found


def missing(extras: Iterable[str]) -> list[str]:
    """The distributions of ``pdwire[extras]`` that are not installed, sorted."""
    absent = []
    for name in requirements(extras):
        try:
            distribution(name)
        except PackageNotFoundError:
            absent.append(name)
    return sorted(absent)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
