"""Conformance cases: an id tied to a spec section, the quoted requirement, a level, a timeout,
and a verdict.

A case is an async function over its suite's context, registered with ``@case``. It checks with
``expect`` (or raises ``CaseFailed``); it raises ``Unsupported`` when the testee does not
implement what the case needs (a legacy P for a pdwire/2 case: not a failure), and ``Skip`` when
the run lacks what the case needs (a timer value it was not told). The verdict follows from what
it raised and the level of its requirement:

=================  ==========================================================================
pass               the case returned
fail               a MUST check failed, or the case timed out (the timeout is an observation)
non-strict         a SHOULD check failed (``fail`` under ``--strict``)
informational      a MAY check failed: the testee chose not to; never a failure
unsupported        the testee does not implement what the case needs
skipped            not run: deselected, or the run lacks what the case needs
=================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

from .requirements import Level, Requirement, get


class Verdict(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NON_STRICT = "non-strict"
    INFORMATIONAL = "informational"
    UNSUPPORTED = "unsupported"
    SKIPPED = "skipped"
    BLOCKED = "blocked"  # not run: the testee stopped serving, or the run could not start


class Suite(enum.StrEnum):
    PRODUCER = "producer"  # the harness is the client and D; the testee is a P
    CONSUMER = "consumer"  # the harness is P and its bootstrap server; the testee is a D
    PAIR = "pair"  # the harness is the client and the proxy; the testee is a P and a D
    PROXY = "proxy"  # the harness is the client, P and D; the testee is a proxy
    REGISTRATION = "registration"  # the harness is P's bootstrap server; the testee is a P


class CaseFailed(Exception):
    """A check failed: what was expected and what was seen."""

    def __init__(self, detail: str, *, expected: Any = None, actual: Any = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.expected = expected
        self.actual = actual


class Unsupported(Exception):
    """The testee does not implement what the case needs (not a failure)."""


T = TypeVar("T")


class Skip(Exception):
    """The run lacks what the case needs (a timer value, an option)."""


def given(value: T | None, what: str, flag: str) -> T:
    """``value``, which the run was told with ``flag``; skips the case when it was not."""
    if value is None:
        raise Skip(f"{what} is unknown: pass {flag}")
    return value


def limits_from_file(path: str | None) -> dict[str, int]:
    """The testee's limits in the JSON file ``path`` (``--limits``), by the names of chapter
    13; none without a path. ``ValueError`` says what is wrong with the file."""
    from pdwire.limits import Limits

    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--limits {path}: {exc}") from None
    if not isinstance(doc, dict) or not all(type(v) is int for v in doc.values()):
        raise ValueError(f"--limits {path} must hold a JSON object of integers")
    known = set(Limits().as_dict())
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(
            f"--limits {path} names no limit {', '.join(unknown)}; known: "
            f"{', '.join(sorted(known))}"
        )
    return doc


def declared_limit(limits: Mapping[str, int], name: str, whose: str) -> int:
    """The testee's limit ``name`` (chapter 13), which the run was told with ``--limits``;
    skips the case when it was not."""
    return given(limits.get(name), f"{whose} limit {name}", "--limits")


def expect(ok: bool, detail: str, *, expected: Any = None, actual: Any = None) -> None:
    """Fail the case with ``detail`` unless ``ok``."""
    if not ok:
        raise CaseFailed(detail, expected=expected, actual=actual)


def expect_equal(actual: Any, expected: Any, what: str) -> None:
    expect(
        actual == expected,
        f"{what}: expected {expected!r}, got {actual!r}",
        expected=expected,
        actual=actual,
    )


@dataclasses.dataclass
class WireEntry:
    t: float  # seconds since the case started
    direction: str  # "->" harness to testee, "<-" testee to harness, "--" an observation
    channel: str  # "zmq tcp://127.0.0.1:5555", "http POST /v1/completions", "mooncake"
    what: str  # a one-line summary
    data: Any = None  # JSON-able detail (a decoded message, an HTTP body)


class WireLog:
    """Everything a case sent and saw, in order, for its report."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.entries: list[WireEntry] = []

    def add(self, direction: str, channel: str, what: str, data: Any = None) -> None:
        self.entries.append(
            WireEntry(time.monotonic() - self.start, direction, channel, what, data)
        )

    def sent(self, channel: str, what: str, data: Any = None) -> None:
        self.add("->", channel, what, data)

    def received(self, channel: str, what: str, data: Any = None) -> None:
        self.add("<-", channel, what, data)

    def note(self, what: str, data: Any = None) -> None:
        self.add("--", "", what, data)


Ctx = TypeVar("Ctx")
CaseFunc = Callable[[Any], Awaitable[None]]

_ID: Final = re.compile(r"^(producer|consumer|pair|proxy|registration)/(\d+(?:\.\d+)*)/(\d+)$")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str  # "<suite>/<section>/<n>", e.g. "producer/3.4/2"
    suite: Suite
    requirement: Requirement  # the one quoted; its level is the case's
    covers: tuple[str, ...]  # every requirement id the case checks, the quoted one first
    title: str
    timeout: float
    func: CaseFunc
    risk: int | None = None  # the known risk (facts file section 10) it guards against
    #: the case may leave a testee that follows the legacy profile unable to serve (vLLM's P
    #: stops its listener for good on a message of three frames; vLLM 0.32's D engine dies on a
    #: D leg without remote_bootstrap_addr, 5.2-R2): a run puts it last
    breaks_testee: bool = False

    @property
    def section(self) -> str:
        return self.requirement.section

    @property
    def level(self) -> Level:
        return self.requirement.level


REGISTRY: dict[str, Case] = {}


def case(
    case_id: str,
    requirement: str,
    *,
    covers: tuple[str, ...] = (),
    timeout: float = 10.0,
    risk: int | None = None,
    breaks_testee: bool = False,
) -> Callable[[Callable[[Ctx], Awaitable[None]]], Callable[[Ctx], Awaitable[None]]]:
    """Register the decorated coroutine function as the case ``case_id``, which checks
    ``requirement`` (quoted in its report) and also ``covers``. Its docstring's first line is
    its title (its first paragraph)."""
    m = _ID.match(case_id)
    if m is None:
        raise ValueError(
            f"case id {case_id!r} is not <producer|consumer|pair|proxy|registration>/<section>/<n>"
        )
    req = get(requirement)
    if m[2] != req.section:
        raise ValueError(
            f"case {case_id} is in section {m[2]}, its requirement {req.id} in {req.section}"
        )

    def register(func: Callable[[Ctx], Awaitable[None]]) -> Callable[[Ctx], Awaitable[None]]:
        if case_id in REGISTRY:
            raise ValueError(f"case {case_id} is defined twice")
        for extra in covers:
            get(extra)
        title = " ".join((func.__doc__ or func.__name__).strip().split("\n\n")[0].split())
        REGISTRY[case_id] = Case(
            id=case_id,
            suite=Suite(m[1]),
            requirement=req,
            covers=(req.id, *(c for c in covers if c != req.id)),
            title=title,
            timeout=timeout,
            func=func,
            risk=risk,
            breaks_testee=breaks_testee,
        )
        return func

    return register


def _sort_key(case_id: str) -> tuple[Any, ...]:
    suite, section, n = case_id.split("/")
    return (suite, tuple(int(p) for p in section.split(".")), int(n))


def all_cases() -> list[Case]:
    """Every registered case, by suite, section and number."""
    from . import suites  # noqa: F401  (registers the cases)

    return [REGISTRY[i] for i in sorted(REGISTRY, key=_sort_key)]
