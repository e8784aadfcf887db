"""The limits of chapter 13: how much state one peer may make a receiver hold, the minimum every
implementation supports, and the text of ``LIMIT_EXCEEDED``."""

from __future__ import annotations

import dataclasses
from typing import Final

from . import error_strings as msgs
from .codec import DEFAULT_MAX_MESSAGE_BYTES
from .http_models import MAX_REGISTER_BODY_BYTES

MiB: Final = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    """One implementation's limits (§13.1). The defaults are the reference's; ``MINIMUM`` holds
    the least every implementation supports."""

    #: Entries of one pull's ``req_blocks``, cancel's ``cancel_reqs`` or renewal's
    #: ``lease_transfer_ids`` (13.2).
    requests_per_message: int = 4096
    #: Pulls of one D worker that one P worker holds open at once (13.3).
    open_pulls_per_peer: int = 256
    #: Placeholders one D worker's pulls made that one P worker holds at once (13.4).
    placeholders_per_peer: int = 4096
    #: Cancels of transfers it held nothing for that one P worker remembers per D worker (13.4).
    remembered_cancels_per_peer: int = 4096
    #: Layouts one P worker keeps under their ``layout_id``, over all D workers (13.5).
    cached_layouts: int = 1024
    #: Workers one bootstrap server holds registered (13.6).
    registrations: int = 1024
    #: Bytes of one side-channel message (§2.3).
    message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: Bytes of one ``/register`` body (4.1-R17).
    register_body_bytes: int = MAX_REGISTER_BODY_BYTES
    #: Bytes of one completion request's body, at the proxy and at P's and D's servers (13.7).
    completion_body_bytes: int = 32 * MiB

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


#: The least every implementation supports (§13.1).
MINIMUM: Final = Limits(
    requests_per_message=1024,
    open_pulls_per_peer=64,
    placeholders_per_peer=1024,
    remembered_cancels_per_peer=1024,
    cached_layouts=64,
    registrations=1024,
    message_bytes=16 * MiB,
    register_body_bytes=MAX_REGISTER_BODY_BYTES,
    completion_body_bytes=4 * MiB,
)
#: The reference implementation's limits.
REFERENCE: Final = Limits()


def exceeded(limit: str, value: int, maximum: int) -> str:
    """The ``err_msg`` (or HTTP detail) of a message that went past ``limit`` (13.1-R3)."""
    return msgs.LIMIT_EXCEEDED.format(limit=limit, value=value, maximum=maximum)
