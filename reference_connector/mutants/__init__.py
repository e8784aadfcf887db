"""The reference testee with one deliberate defect: what proves that a conformance case can fail.

``pdwire node --mutant NAME`` starts a node whose every process (the front and each worker) first
applies the mutant: a patch of one behaviour of pdwire's own code, made in that process only.
``pdwire node --mutant-control`` lets the harness switch mutants on and off in a running node
instead (``POST /pdwire/mutant``): every patch goes through ``replace``, which keeps what it
replaced, so ``restore`` puts the reference back. A mutant that changes the node's configuration
(``node``), or whose patch reaches only what starts after it (``at_start``: a constructor, a loop
already running), needs a node of its own. Each mutant is caught by at least one conformance case
(``caught_by`` in ``conformance``), and the test suite shows it. Never use a mutant for anything
but testing the harness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

Role = Literal["prefill", "decode", "proxy"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    role: Role  # the node role the defect is in; proxy: ``pdwire proxy --mutant``
    defect: str  # what is broken, in one line
    patch: Callable[[], None]  # applies the defect in the calling process
    node: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # NodeConfig overrides
    at_start: bool = False  # the patch reaches only what is made after it

    @property
    def own_node(self) -> bool:
        """Whether the mutant needs a node started with it, not switched on in a running one."""
        return bool(self.node) or self.at_start


MUTANTS: dict[str, Mutant] = {}
#: What the applied patches replaced: (owner, name, whether owner held it itself, the value).
_journal: list[tuple[object, str, bool, object]] = []
_active = ""


def mutant(
    name: str, role: Role, defect: str, *, at_start: bool = False, **node: Any
) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register the decorated function as the patch of mutant ``name``."""

    def register(patch: Callable[[], None]) -> Callable[[], None]:
        if name in MUTANTS:
            raise ValueError(f"mutant {name} is defined twice")
        MUTANTS[name] = Mutant(name, role, defect, patch, node, at_start)
        return patch

    return register


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


def apply_for(name: str, role: str) -> Mutant:
    """Apply mutant ``name`` in a process of ``role``; ``ValueError`` when there is no such
    mutant, or it is a defect of another role."""
    try:
        m = get(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    if m.role != role:
        raise ValueError(f"mutant {m.name} is a {m.role} defect")
    apply(m.name)
    return m


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


from . import auth, consumer, lease, pair, producer, proxy, registration  # noqa: E402, F401  (register the mutants)

NAMES: Final = tuple(sorted(MUTANTS))
