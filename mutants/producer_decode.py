"""Mutants of how P decodes a pull (caught by the producer suite's codec cases). Each replaces
the decoder the producer session calls, or one of its steps in ``pdwire.codec``."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import msgspec

from pdwire import codec, sections
from pdwire import producer as producer_module
from pdwire.errors import DecodeError
from pdwire.messages import Fingerprint, XferMetadataV2
from pdwire.versions import ALL_CAPS, CURRENT_VERSION

from . import mutant, producer_limits, replace


def _wrap_decode(check: Any) -> None:
    """Make P's decoder run ``check(data, msg)`` on each pull it decoded."""
    original = codec.decode_pull

    def decode(data: bytes, *, max_size: int = codec.DEFAULT_MAX_MESSAGE_BYTES) -> Any:
        msg = original(data, max_size=max_size)
        check(data, msg)
        return msg

    replace(producer_module, "decode_pull", decode)


def _reject(message: str) -> DecodeError:
    return DecodeError(message, section=sections.PULL, kind="pull")


@mutant(
    "unvalidated-pull",
    "prefill",
    "builds a pull from the raw map: no type, range, key check",
    cases=(
        "producer/2.1/5",
        "producer/2.2/1",
        "producer/2.2/2",
        "producer/2.2/3",
        "producer/2.3/2",
        "producer/2.3/4",
    ),
)
def _unvalidated_pull() -> None:
    def decode(data: bytes, *, max_size: int = codec.DEFAULT_MAX_MESSAGE_BYTES) -> Any:
        return XferMetadataV2(**msgspec.msgpack.decode(data))

    replace(producer_module, "decode_pull", decode)


@mutant(
    "ignores-trailing",
    "prefill",
    "decodes the first value of a pull, ignores the rest",
    cases=("producer/2.3/3",),
)
def _ignores_trailing() -> None:
    original = codec.decode_pull

    def decode(data: bytes, *, max_size: int = codec.DEFAULT_MAX_MESSAGE_BYTES) -> Any:
        try:
            return original(data, max_size=max_size)
        except DecodeError as exc:
            end = re.search(r"trailing characters \(byte (\d+)\)", str(exc))
            if end is None:
                raise
            return original(data[: int(end[1])], max_size=max_size)

    replace(producer_module, "decode_pull", decode)


@mutant(
    "no-cross-field-checks",
    "prefill",
    "skips the cross-field rules of a pull (3.2-R1, R2)",
    cases=(
        "producer/3.2/1",
        "producer/3.2/2",
    ),
)
def _no_cross_field_checks() -> None:
    replace(codec, "_check_pull", lambda msg: None)


@mutant(
    "no-older-variants",
    "prefill",
    "rejects the older pull variants of §3.8",
    cases=("producer/3.8/1",),
)
def _no_older_variants() -> None:
    def refuse(data: Any, first_error: msgspec.ValidationError) -> Any:
        raise codec._invalid(first_error, "pull")

    replace(codec, "_decode_older_pull", refuse)


@mutant(
    "order-sensitive",
    "prefill",
    "rejects a pull whose fields are not in declaration order",
    cases=("producer/2.1/1",),
)
def _order_sensitive() -> None:
    fields = XferMetadataV2.__struct_fields__

    def check(data: bytes, msg: Any) -> None:
        keys = list(msgspec.msgpack.decode(data))
        if keys != [f for f in fields if f in keys]:
            raise _reject("fields out of order")

    _wrap_decode(check)


@mutant(
    "rejects-unknown-keys",
    "prefill",
    "rejects a pull with a key it does not know",
    cases=("producer/2.1/3",),
)
def _rejects_unknown_keys() -> None:
    known = set(XferMetadataV2.__struct_fields__)
    fp_known = {f.name for f in dataclasses.fields(Fingerprint)}

    def check(data: bytes, msg: Any) -> None:
        obj = msgspec.msgpack.decode(data)
        fp = obj.get("fingerprint")
        if set(obj) - known or (isinstance(fp, dict) and set(fp) - fp_known):
            raise _reject("unknown key")

    _wrap_decode(check)


@mutant(
    "narrow-map-headers",
    "prefill",
    "rejects a pull whose map header is map 32",
    cases=("producer/2.1/4",),
)
def _narrow_map_headers() -> None:
    def check(data: bytes, msg: Any) -> None:
        if data[:1] == b"\xdf":
            raise _reject("map 32 header")

    _wrap_decode(check)


@mutant(
    "version-key-announces",
    "prefill",
    "takes a pull with a pdwire_version key (even 0 or 1) as announcing pdwire/2",
    cases=("producer/2.1/2",),
)
def _version_key_announces() -> None:
    def check(data: bytes, msg: Any) -> None:
        if b"pdwire_version" in data and msg.pdwire_version < 2:
            msg.pdwire_version, msg.pdwire_caps = CURRENT_VERSION, sorted(ALL_CAPS)

    _wrap_decode(check)


@mutant(
    "small-size-limit",
    "prefill",
    "rejects every message longer than 1 MiB",
    cases=("producer/2.3/1",),
)
def _small_size_limit() -> None:
    producer_limits(message_bytes=1 << 20)


@mutant(
    "no-size-limit",
    "prefill",
    "decodes a message of any length",
    cases=("producer/2.3/5",),
)
def _no_size_limit() -> None:
    producer_limits(message_bytes=1 << 40)


@mutant(
    "payload-past-stride",
    "prefill",
    "serves a pull whose payload is longer than its stride",
    cases=("producer/3.2/2",),
)
def _payload_past_stride() -> None:
    replace(codec, "_payload_past_stride", lambda m: None)


@mutant(
    "two-kinds-as-a-pull",
    "prefill",
    "takes a message that decodes as a pull as one, whatever other kind's key it carries",
    cases=("producer/3.1/4",),
)
def _two_kinds_as_a_pull() -> None:
    replace(producer_module, "_OTHER_KEYS", ())
