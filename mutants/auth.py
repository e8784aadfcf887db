"""Mutants of authentication (§8.6), on both sides: caught by the cases that run with a shared
key (``*/8.6/*``). Each replaces what one module sees as ``pdwire.auth`` or one check."""

from __future__ import annotations

import hashlib
import hmac
import json
import types
from typing import Any

from pdwire import auth
from pdwire import consumer as consumer_module
from pdwire import producer as producer_module
from pdwire.producer import ProducerSession
from reference_connector import bootstrap

from . import mutant, replace


def _auth_with(**changed: Any) -> types.SimpleNamespace:
    """``pdwire.auth`` with some of its functions changed."""
    return types.SimpleNamespace(
        **{"sign": auth.sign, "verify": auth.verify, "tag": auth.tag, **changed}
    )


def _as_it_is(msg: Any, key: bytes) -> Any:
    return msg


@mutant(
    "p-accepts-unsigned",
    "prefill",
    "acts on pulls and cancels whatever their auth_tag",
    cases=(
        "producer/8.6/1",
        "producer/8.6/2",
        "producer/8.6/4",
    ),
)
def _p_accepts_unsigned() -> None:
    replace(ProducerSession, "_authentic", lambda self, msg: True)


@mutant(
    "p-tag-presence-only",
    "prefill",
    "accepts any auth_tag without comparing it",
    cases=("producer/8.6/2",),
)
def _p_tag_presence_only() -> None:
    replace(ProducerSession, "_authentic", lambda self, msg: msg.auth_tag is not None)


@mutant(
    "p-unsigned-reply",
    "prefill",
    "sends its replies without auth_tag though it has a key",
    cases=("producer/8.6/3",),
)
def _p_unsigned_reply() -> None:
    replace(producer_module, "auth", _auth_with(sign=_as_it_is))


@mutant(
    "bootstrap-accepts-unsigned",
    "prefill",
    "its bootstrap server takes any registration",
    cases=("producer/8.6/5",),
)
def _bootstrap_accepts_unsigned() -> None:
    replace(bootstrap, "tag_is_valid", lambda body, key: True)


@mutant(
    "bootstrap-unsorted-canonical-json",
    "prefill",
    "its bootstrap server signs the body in the order sent, its keys not sorted",
    cases=("producer/8.6/6",),
)
def _bootstrap_unsorted() -> None:
    def register_tag(payload: dict[str, Any], key: bytes) -> str:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=True)
        return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()

    replace(bootstrap, "register_tag", register_tag)


@mutant(
    "d-unsigned-pull",
    "decode",
    "sends its pulls without auth_tag though it has a key",
    cases=("consumer/8.6/1",),
)
def _d_unsigned_pull() -> None:
    replace(consumer_module, "auth", _auth_with(sign=_as_it_is))


@mutant(
    "d-ignores-reply-tag",
    "decode",
    "trusts replies whatever their auth_tag",
    cases=("consumer/8.6/2",),
)
def _d_ignores_reply_tag() -> None:
    replace(consumer_module, "auth", _auth_with(verify=lambda msg, key: None))
