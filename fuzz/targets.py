"""Every fuzz target by name: a function of one input's bytes that raises only on a bug."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from . import decoders
from .consumer_target import consumer_session
from .producer_target import producer_session

Target = Callable[[bytes], None]

TARGETS: Final[dict[str, Target]] = {
    "pull": decoders.pull,
    "response": decoders.response,
    "cancel": decoders.cancel,
    "message": decoders.message,
    "register": decoders.register,
    "query": decoders.query,
    "kv_params": decoders.kv_params,
    "negotiation": decoders.negotiation,
    "producer": producer_session,
    "consumer": consumer_session,
}
