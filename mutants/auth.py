"""Mutants of authentication (§8.6), on both sides: caught by the cases that run with a shared
key (``*/8.6/*``). Each replaces what one module sees as ``pdwire.auth`` or one check."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import types
from typing import Any

import msgspec

from pdwire import auth, codec, sections
from pdwire import consumer as consumer_module
from pdwire import producer as producer_module
from pdwire.consumer import ConsumerSession
from pdwire.errors import RemoteProtocolError
from pdwire.producer import ProducerSession
from reference_connector import bootstrap

from . import mutant, replace


def _auth_with(**changed: Any) -> types.SimpleNamespace:
    """``pdwire.auth`` with some of its functions changed."""
    return types.SimpleNamespace(
        **{"sign": auth.sign, "verify": auth.verify, "tag": auth.tag, **changed}
    )


def _as_it_is(msg: Any, key: bytes, answers: bytes | None = None) -> Any:
    return msg


def _unbound(original: Any) -> Any:
    """``original`` (``auth.sign`` or ``auth.verify``) with a reply's tag not covering the tag
    of the message it answers."""
    return lambda msg, key, answers=None: original(msg, key)


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
    replace(bootstrap, "registration_is_signed", lambda body, keys: True)


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

    replace(auth, "register_tag", register_tag)


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
    replace(consumer_module, "auth", _auth_with(verify=lambda msg, key, answers=None: None))


@mutant(
    "p-reply-not-bound",
    "prefill",
    "signs its replies without the tag of the pull they answer",
    cases=("producer/8.6/3",),
)
def _p_reply_not_bound() -> None:
    replace(producer_module, "auth", _auth_with(sign=_unbound(auth.sign)))


@mutant(
    "d-reply-not-bound",
    "decode",
    "checks a reply's tag without the tag of the pull it answers",
    cases=("consumer/8.6/2",),
)
def _d_reply_not_bound() -> None:
    replace(consumer_module, "auth", _auth_with(verify=_unbound(auth.verify)))


@mutant(
    "p-keyed-serves-legacy",
    "prefill",
    "serves a pull that does not announce pdwire/2 though it has a key",
    cases=("producer/8.6/7",),
)
def _p_keyed_serves_legacy() -> None:
    original = ProducerSession._authentic

    def authentic(self: ProducerSession, msg: Any) -> bool:
        return getattr(msg, "pdwire_version", 2) < 2 or original(self, msg)

    replace(ProducerSession, "_authentic", authentic)


@mutant(
    "d-keyed-speaks-legacy",
    "decode",
    "speaks legacy, unsigned, to a P whose /query entry says legacy, though it has a key",
    cases=("consumer/8.6/3",),
)
def _d_keyed_speaks_legacy() -> None:
    original = ConsumerSession._agreement

    def agreement(self: ConsumerSession, addr: str, engine_id: str) -> Any:
        config, self.config = self.config, dataclasses.replace(self.config, auth_key=None)
        try:
            return original(self, addr, engine_id)
        finally:
            self.config = config

    replace(ConsumerSession, "_agreement", agreement)


@mutant(
    "p-signs-maps-as-sent",
    "prefill",
    "computes tags over maps in the order their keys came, not sorted",
    cases=("producer/8.6/8",),
)
def _p_signs_maps_as_sent() -> None:
    replace(codec, "_canonical_encoder", msgspec.msgpack.Encoder())


def _any_id_verify(msg: Any, keys: auth.Keys, answers: bytes | None = None) -> None:
    """``auth.verify`` that checks the tag under the first key whatever ``auth_key_id`` says."""
    first = keys if isinstance(keys, bytes) else keys[0]
    if msg.auth_tag is None or not hmac.compare_digest(msg.auth_tag, auth.tag(msg, first, answers)):
        raise RemoteProtocolError("auth_tag does not match", section=sections.AUTHENTICATION)


@mutant(
    "p-ignores-key-id",
    "prefill",
    "checks a tag under its key whatever key auth_key_id names",
    cases=("producer/8.6/9",),
)
def _p_ignores_key_id() -> None:
    replace(producer_module, "auth", _auth_with(verify=_any_id_verify))


@mutant(
    "d-ignores-key-id",
    "decode",
    "checks a reply's tag under its key whatever key auth_key_id names",
    cases=("consumer/8.6/2",),
)
def _d_ignores_key_id() -> None:
    replace(consumer_module, "auth", _auth_with(verify=_any_id_verify))
