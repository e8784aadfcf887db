"""The reference testee with one deliberate defect: what proves that a conformance case can fail.

``pdwire node --mutant NAME`` starts a node whose every process (the front and each worker) first
applies the mutant: a patch of one behaviour of pdwire's own code, made in that process only.
Each mutant is caught by at least one conformance case (``caught_by`` in ``conformance``), and the
test suite shows it. Never use a mutant for anything but testing the harness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

Role = Literal["prefill", "decode"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    role: Role  # the node role the defect is in
    defect: str  # what is broken, in one line
    patch: Callable[[], None]  # applies the defect in the calling process
    node: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # NodeConfig overrides


MUTANTS: dict[str, Mutant] = {}
_applied: set[str] = set()


def mutant(
    name: str, role: Role, defect: str, **node: Any
) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register the decorated function as the patch of mutant ``name``."""

    def register(patch: Callable[[], None]) -> Callable[[], None]:
        if name in MUTANTS:
            raise ValueError(f"mutant {name} is defined twice")
        MUTANTS[name] = Mutant(name, role, defect, patch, node)
        return patch

    return register


def replace(owner: object, name: str, value: object) -> None:
    """Put ``value`` in the place of ``owner.name``: how every patch applies its defect."""
    if not hasattr(owner, name):
        raise AttributeError(f"{owner!r} has no {name!r} to replace")
    setattr(owner, name, value)


def get(name: str) -> Mutant:
    try:
        return MUTANTS[name]
    except KeyError:
        raise KeyError(f"no mutant {name!r}; known: {', '.join(sorted(MUTANTS))}") from None


def apply(name: str) -> None:
    """Apply mutant ``name`` in this process (once)."""
    if name and name not in _applied:
        get(name).patch()
        _applied.add(name)


from . import consumer, producer  # noqa: E402, F401  (register the mutants)

NAMES: Final = tuple(sorted(MUTANTS))
