"""The reference testee with one deliberate defect: what proves that a conformance case can fail.

A mutant is a patch of one behaviour of pdwire's reference code, applied in a process from
outside: a process started with ``preload.environ(NAME)`` (``PYTHONPATH`` with the preload's
``sitecustomize``, ``PDWIRE_MUTANT``) applies it before it runs anything, and so does every
process it starts, such as a node's workers. With ``PDWIRE_MUTANT_SWITCH`` the check switches
mutants on and off in running processes instead (``preload``). Every patch goes through
``replace``, which keeps what it replaced, so ``restore`` puts the reference back. A mutant whose
patch reaches only what starts after it (``at_start``: a constructor, a loop already running, a
node's configuration) needs a process of its own. Each mutant names the conformance cases that
catch it (``cases``); ``python -m mutants check`` shows that they do. This package is not
installed with pdwire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, Literal

Role = Literal["prefill", "decode", "proxy"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    role: Role  # the testee the defect is in: a node of that role, or ``pdwire proxy``
    defect: str  # what is broken, in one line
    patch: Callable[[], None]  # applies the defect in the calling process
    cases: tuple[str, ...]  # the ids of the conformance cases that catch it
    at_start: bool = False  # the patch reaches only what is made after it

    @property
    def switchable(self) -> bool:
        """Whether the mutant can be switched on in a running node, not only started with it."""
        return not self.at_start and self.role != "proxy"


MUTANTS: dict[str, Mutant] = {}
#: What the applied patches replaced: (owner, name, whether owner held it itself, the value).
_journal: list[tuple[object, str, bool, object]] = []
_active = ""


def mutant(
    name: str, role: Role, defect: str, *, cases: tuple[str, ...], at_start: bool = False
) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register the decorated function as the patch of mutant ``name``, caught by ``cases``."""

    def register(patch: Callable[[], None]) -> Callable[[], None]:
        if name in MUTANTS:
            raise ValueError(f"mutant {name} is defined twice")
        if not cases:
            raise ValueError(f"mutant {name} names no case that catches it")
        MUTANTS[name] = Mutant(name, role, defect, patch, cases, at_start)
        return patch

    return register


def configure(**overrides: Any) -> None:
    """Start every node of this process with ``overrides`` of its ``NodeConfig``: the defect
    of a mutant that is a setting (``at_start``)."""
    from reference_connector.node_api import NodeServer

    original = NodeServer.__init__

    def init(self: NodeServer, config: Any) -> None:
        original(self, dataclasses.replace(config, **overrides))

    replace(NodeServer, "__init__", init)


def producer_limits(**changes: int) -> None:
    """Make P's sessions enforce their limits with ``changes`` (chapter 13), at once."""
    from pdwire.producer import ProducerSession

    reference: Any = vars(ProducerSession)["limits"].fget
    changed = property(lambda self: dataclasses.replace(reference(self), **changes))
    replace(ProducerSession, "limits", changed)


def replace(owner: object, name: str, value: object) -> None:
    """Put ``value`` in the place of ``owner.name``: how every patch applies its defect."""
    if not hasattr(owner, name):
        raise AttributeError(f"{owner!r} has no {name!r} to replace")
    own = vars(owner)
    held = name in own
    # The raw entry, not getattr's: a staticmethod must come back as one.
    _journal.append((owner, name, held, own[name] if held else None))
    setattr(owner, name, value)


def restore() -> None:
    """Undo every patch applied in this process, last first: the reference again."""
    global _active
    while _journal:
        owner, name, held, value = _journal.pop()
        if held:
            setattr(owner, name, value)
        else:
            delattr(owner, name)
    _active = ""


def get(name: str) -> Mutant:
    try:
        return MUTANTS[name]
    except KeyError:
        raise KeyError(f"no mutant {name!r}; known: {', '.join(sorted(MUTANTS))}") from None


def apply(name: str) -> None:
    """Make mutant ``name`` the one applied in this process ("" = none); another one applied
    before is restored first."""
    global _active
    if name == _active:
        return
    m = get(name) if name else None
    restore()
    if m is not None:
        m.patch()
        _active = name


from . import (  # noqa: E402, F401  (register the mutants)
    auth,
    consumer,
    consumer_cancel,
    lease,
    limits,
    pair,
    producer,
    proxy,
    registration,
)

NAMES: Final = tuple(sorted(MUTANTS))
