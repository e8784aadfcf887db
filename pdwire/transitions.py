"""The protocol's state machines as data (spec §10): the life of a transfer on P and of a load
request on D. The sessions move states only through these tables, and the spec's diagrams are
drawn from them. A pair missing from a table is a protocol error."""

from __future__ import annotations

import enum
from typing import Final


class TransferState(enum.Enum):
    """P's state for one transfer_id."""

    PLACEHOLDER = "placeholder"  # named by a pull before P's scheduler recorded it
    RECORDED = "recorded"  # P's request is running; no blocks yet
    READY = "ready"  # prefill done; blocks held for the pulls
    # Remembered for the retention timer, so later messages get an answer at once:
    CANCELLED = "cancelled"  # D withdrew pulls before P recorded the request
    SERVED = "served"  # every required pull settled; blocks freed
    EXPIRED = "expired"  # retention or placeholder timer fired; blocks freed
    NOT_SENT = "not-sent"  # P's request will not send; blocks freed
    FORGOTTEN = "forgotten"  # the remembered state is dropped


class TransferEvent(enum.Enum):
    PULL_NAMED = "pull named it"
    STARTED = "request started"
    FINISHED = "request finished"
    WILL_NOT_SEND = "request will not send"
    ALL_SETTLED = "all pulls settled"
    CANCELLED = "pull cancelled"
    TIMER_FIRED = "timer fired"


S, E = TransferState, TransferEvent

#: (state, event) -> next state. ``None`` is "P holds nothing for this transfer_id".
TRANSFER_TRANSITIONS: Final[dict[tuple[TransferState | None, TransferEvent], TransferState]] = {
    (None, E.PULL_NAMED): S.PLACEHOLDER,
    (None, E.STARTED): S.RECORDED,
    (None, E.FINISHED): S.READY,
    (None, E.WILL_NOT_SEND): S.NOT_SENT,
    (None, E.CANCELLED): S.CANCELLED,
    (S.PLACEHOLDER, E.PULL_NAMED): S.PLACEHOLDER,
    (S.PLACEHOLDER, E.STARTED): S.RECORDED,
    (S.PLACEHOLDER, E.FINISHED): S.READY,
    (S.PLACEHOLDER, E.WILL_NOT_SEND): S.NOT_SENT,
    (S.PLACEHOLDER, E.CANCELLED): S.PLACEHOLDER,
    (S.PLACEHOLDER, E.TIMER_FIRED): S.EXPIRED,
    (S.RECORDED, E.PULL_NAMED): S.RECORDED,
    (S.RECORDED, E.FINISHED): S.READY,
    (S.RECORDED, E.WILL_NOT_SEND): S.NOT_SENT,
    (S.RECORDED, E.CANCELLED): S.RECORDED,
    (S.READY, E.PULL_NAMED): S.READY,
    (S.READY, E.CANCELLED): S.READY,
    (S.READY, E.ALL_SETTLED): S.SERVED,
    (S.READY, E.TIMER_FIRED): S.EXPIRED,
    (S.CANCELLED, E.PULL_NAMED): S.CANCELLED,
    (S.CANCELLED, E.STARTED): S.RECORDED,
    (S.CANCELLED, E.FINISHED): S.READY,
    (S.CANCELLED, E.WILL_NOT_SEND): S.NOT_SENT,
    (S.CANCELLED, E.CANCELLED): S.CANCELLED,
    (S.CANCELLED, E.TIMER_FIRED): S.FORGOTTEN,
    **{
        (done, event): done
        for done in (S.SERVED, S.EXPIRED, S.NOT_SENT)
        for event in (E.PULL_NAMED, E.CANCELLED)
    },
    **{(done, E.TIMER_FIRED): S.FORGOTTEN for done in (S.SERVED, S.EXPIRED, S.NOT_SENT)},
    **{
        (done, event): nxt
        for done in (S.SERVED, S.EXPIRED, S.NOT_SENT)
        for event, nxt in (
            (E.STARTED, S.RECORDED),
            (E.FINISHED, S.READY),
            (E.WILL_NOT_SEND, S.NOT_SENT),
        )
    },
}

#: States in which P holds the request's blocks.
HOLDS_BLOCKS: Final = frozenset({S.READY})
#: States that answer a pull at once instead of waiting.
TERMINAL: Final = frozenset({S.SERVED, S.EXPIRED, S.NOT_SENT})


class LoadState(enum.Enum):
    """D's state for one request it loads."""

    RESOLVING = "resolving"  # waiting for the bootstrap query of its engine
    PULLING = "pulling"  # pulls sent; some not settled
    TIMED_OUT = "timed-out"  # deadline passed; failed, pulls still settling (pdwire/2)
    LOADED = "loaded"  # every pull listed it in ok_reqs
    FAILED = "failed"  # some pull failed it; every pull settled


class LoadEvent(enum.Enum):
    ENGINE_KNOWN = "engine known"
    ENGINE_UNKNOWN = "engine unknown"
    PULL_SETTLED = "a pull settled"
    ALL_LOADED = "every pull settled, all ok"
    ALL_SETTLED_FAILED = "every pull settled, some failed"
    DEADLINE = "deadline passed"


L, LE = LoadState, LoadEvent

#: (state, event) -> next state for a D request.
LOAD_TRANSITIONS: Final[dict[tuple[LoadState | None, LoadEvent], LoadState]] = {
    (None, LE.ENGINE_KNOWN): L.PULLING,
    (None, LE.ENGINE_UNKNOWN): L.RESOLVING,
    (L.RESOLVING, LE.ENGINE_KNOWN): L.PULLING,
    (L.RESOLVING, LE.ALL_SETTLED_FAILED): L.FAILED,
    (L.RESOLVING, LE.DEADLINE): L.FAILED,
    (L.PULLING, LE.PULL_SETTLED): L.PULLING,
    (L.PULLING, LE.ALL_LOADED): L.LOADED,
    (L.PULLING, LE.ALL_SETTLED_FAILED): L.FAILED,
    (L.PULLING, LE.DEADLINE): L.TIMED_OUT,
    (L.TIMED_OUT, LE.PULL_SETTLED): L.TIMED_OUT,
    (L.TIMED_OUT, LE.ALL_LOADED): L.FAILED,
    (L.TIMED_OUT, LE.ALL_SETTLED_FAILED): L.FAILED,
    (L.TIMED_OUT, LE.DEADLINE): L.TIMED_OUT,
}
