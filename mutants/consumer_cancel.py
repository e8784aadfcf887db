"""Mutants of D that reuse a withdrawn request's blocks while P may still write into them
(3.5-R17)."""

from __future__ import annotations

from typing import Any

from pdwire.consumer import ConsumerSession, _Pull
from pdwire.messages import ErrorCode, XferResponseV2
from pdwire.messages import XferResponseStatus as Status

from . import mutant, replace

_ORIGINAL_ON_CANCEL_REPLY = ConsumerSession._on_cancel_reply


def _settle_withdrawn(session: ConsumerSession, cancel: _Pull) -> None:
    """Settle every request ``cancel`` withdrew, as if P had confirmed each."""
    confirmed = XferResponseV2(status=Status.FINISH, ok_reqs=list(cancel.reqs))
    _ORIGINAL_ON_CANCEL_REPLY(session, cancel, confirmed)


def _frees_on(status: Status) -> Any:
    """``_on_cancel_reply`` that settles every request the cancel withdrew on a reply of
    ``status``, listed or not."""

    def on_reply(self: ConsumerSession, cancel: _Pull, reply: XferResponseV2) -> None:
        if reply.status is status:
            _settle_withdrawn(self, cancel)
        else:
            _ORIGINAL_ON_CANCEL_REPLY(self, cancel, reply)

    return on_reply


@mutant(
    "d-cancel-error-frees",
    "decode",
    "reuses a withdrawn request's blocks when P answers the cancel with ERROR",
    cases=("consumer/3.5/2",),
)
def _cancel_error_frees() -> None:
    replace(ConsumerSession, "_on_cancel_reply", _frees_on(Status.ERROR))


@mutant(
    "d-cancel-finish-frees-all",
    "decode",
    "reuses the blocks of every request a cancel withdrew on its FINISH, listed or not",
    cases=("consumer/3.5/3",),
)
def _cancel_finish_frees_all() -> None:
    replace(ConsumerSession, "_on_cancel_reply", _frees_on(Status.FINISH))


@mutant(
    "d-cancel-timeout-frees",
    "decode",
    "reuses a withdrawn request's blocks when its cancel's receive timeout passes",
    cases=("consumer/3.5/4",),
)
def _cancel_timeout_frees() -> None:
    original = ConsumerSession._fail_pull

    def fail_pull(self: ConsumerSession, pull: _Pull, code: ErrorCode, reason: str) -> None:
        if pull.cancel and code is ErrorCode.DEADLINE_EXCEEDED:
            _settle_withdrawn(self, pull)
        else:
            original(self, pull, code, reason)

    replace(ConsumerSession, "_fail_pull", fail_pull)
