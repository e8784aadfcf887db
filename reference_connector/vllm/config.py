"""The connector's settings: the keys of ``kv_connector_extra_config``, and the environment.

============================ ====================== ===========================================
key                          default                what it sets
============================ ====================== ===========================================
``mooncake_protocol``        ``"rdma"``             the Mooncake transfer engine's protocol
                                                    (``"tcp"`` where there is no RDMA)
``device_name``              ``""`` (any)           the RDMA devices the engine may use
``bootstrap_server_address`` unset                  ``host:port`` of a bootstrap server run
                                                    elsewhere; unset, the P worker of TP rank
                                                    0 and PP rank 0 starts one, on port
                                                    ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (8998)
``bootstrap_host``           ``"0.0.0.0"``          the address that server binds
``profile``                  ``"pdwire/2"``         ``"legacy"``: speak exactly what vLLM
                                                    0.34's MooncakeConnector speaks;
                                                    ``"pdwire/2"``: negotiate the extensions
                                                    with peers that announce them
``abort_timeout``            ``VLLM_MOONCAKE_ABORT  P: seconds a pull waits for its request's
                             _REQUEST_TIMEOUT``     prefill, and a finished request's blocks
                             (480)                  wait for D's pulls
                                                    (``ProducerConfig.abort_timeout``)
``receive_timeout``          ``abort_timeout`` + 60 D: seconds a pull waits for P's next reply
                                                    (``ConsumerConfig.receive_timeout``)
``deadline``                 60                     D, pdwire/2: seconds a request waits for
                                                    its KV before D gives up and cancels
                                                    (``ConsumerConfig.deadline``)
``bootstrap_timeout``        ``VLLM_MOONCAKE_CONNE  seconds per HTTP phase of ``/register``
                             CTOR_TIMEOUT`` (30)    and ``/query``
``auth_key_file``            unset                  a file whose bytes (less a trailing
                                                    newline) are the key every P and D shares:
                                                    side-channel messages and registrations
                                                    carry an HMAC tag; pdwire/2 only
                                                    (``ProducerConfig.auth_key``,
                                                    ``ConsumerConfig.auth_key``)
``accepted_key_files``       ``[]``                 files of older keys still accepted from
                                                    peers and registrations while a key is
                                                    rotated (8.6-R16; ``accepted_keys``)
``num_workers``              10                     P: batch writes that may run at once
``kv_lease_duration``        unset (no lease)       vLLM 0.34's lease, seconds: P holds a
                                                    finished request's blocks this long and
                                                    accepts renewals; D renews every 1/6 of
                                                    it while a request waits (§6.4;
                                                    ``ProducerConfig.lease``,
                                                    ``ConsumerConfig.lease``)
============================ ====================== ===========================================

Unknown keys are an error, so that a misspelt key does not silently keep its default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Final

from pdwire import http_models
from pdwire.auth import read_key_file
from pdwire.consumer import LOAD_DEADLINE
from pdwire.errors import LocalProtocolError
from pdwire.http_models import DEFAULT_BOOTSTRAP_PORT
from pdwire.producer import ABORT_REQUEST_TIMEOUT
from pdwire.session import check_lease
from pdwire.versions import PDWIRE_2, Profile, check_profile

DEFAULT_BOOTSTRAP_TIMEOUT: Final = 30.0
#: vLLM's margin of D's receive timeout over P's ready wait (3.1-R8).
RECEIVE_MARGIN: Final = 60.0

KEYS: Final = frozenset(
    {
        "mooncake_protocol",
        "device_name",
        "bootstrap_server_address",
        "bootstrap_host",
        "profile",
        "abort_timeout",
        "receive_timeout",
        "deadline",
        "bootstrap_timeout",
        "auth_key_file",
        "accepted_key_files",
        "num_workers",
        "kv_lease_duration",
    }
)


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` value the connector cannot use; names the key."""


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not a number") from None


def _number(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a positive number: {value!r}")
    return float(value)


def _lease(extra: Mapping[str, Any]) -> float | None:
    """``kv_lease_duration``, read as vLLM 0.34 reads it: a float, positive, or unset."""
    value = extra.get("kv_lease_duration")
    if value is None:
        return None
    try:
        duration = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.kv_lease_duration: {value!r}") from None
    try:
        return check_lease(duration)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _text(extra: Mapping[str, Any], key: str, default: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a string: {value!r}")
    return value


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) of ``bootstrap_server_address``."""
    try:
        return http_models.split_host_port(address)
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config.{exc}") from None


def _auth_key(extra: Mapping[str, Any], profile: Profile) -> bytes | None:
    path = extra.get("auth_key_file")
    if path is None:
        return None
    if profile != PDWIRE_2:
        raise ConfigError("kv_connector_extra_config.auth_key_file needs profile pdwire/2")
    return _key_in(path, "auth_key_file")


def _accepted_keys(extra: Mapping[str, Any], key: bytes | None) -> tuple[bytes, ...]:
    paths = extra.get("accepted_key_files", [])
    name = "accepted_key_files"
    if not isinstance(paths, list):
        raise ConfigError(f"kv_connector_extra_config.{name} must be a list of paths: {paths!r}")
    if paths and key is None:
        raise ConfigError(f"kv_connector_extra_config.{name} needs auth_key_file")
    return tuple(_key_in(path, name) for path in paths)


def _key_in(path: object, name: str) -> bytes:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"kv_connector_extra_config.{name} must be a path: {path!r}")
    try:
        return read_key_file(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"kv_connector_extra_config.{name}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the scheduler and worker halves read, resolved once from the extra config."""

    protocol: str = "rdma"
    device_name: str = ""
    bootstrap_address: tuple[str, int] | None = None  # an external server
    bootstrap_host: str = "0.0.0.0"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    profile: Profile = PDWIRE_2
    abort_timeout: float = ABORT_REQUEST_TIMEOUT
    receive_timeout: float = ABORT_REQUEST_TIMEOUT + RECEIVE_MARGIN
    deadline: float = LOAD_DEADLINE
    bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT
    auth_key: bytes | None = None
    accepted_keys: tuple[bytes, ...] = ()
    num_workers: int = 10
    lease: float | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> Settings:
        unknown = sorted(set(extra) - KEYS)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(KEYS)}"
            )
        profile_name = _text(extra, "profile", PDWIRE_2)
        try:
            profile = check_profile(profile_name)
        except LocalProtocolError as exc:
            raise ConfigError(f"kv_connector_extra_config.profile: {exc}") from None
        abort = _number(
            extra,
            "abort_timeout",
            _env_float("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", ABORT_REQUEST_TIMEOUT),
        )
        address = extra.get("bootstrap_server_address")
        workers = extra.get("num_workers", 10)
        key = _auth_key(extra, profile)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(
                f"kv_connector_extra_config.num_workers must be a positive integer: {workers!r}"
            )
        return cls(
            protocol=_text(extra, "mooncake_protocol", "rdma"),
            device_name=_text(extra, "device_name", ""),
            bootstrap_address=None if address is None else split_host_port(str(address)),
            bootstrap_host=_text(extra, "bootstrap_host", "0.0.0.0"),
            bootstrap_port=int(_env_float("VLLM_MOONCAKE_BOOTSTRAP_PORT", DEFAULT_BOOTSTRAP_PORT)),
            profile=profile,
            abort_timeout=abort,
            receive_timeout=_number(extra, "receive_timeout", abort + RECEIVE_MARGIN),
            deadline=_number(extra, "deadline", LOAD_DEADLINE),
            bootstrap_timeout=_number(
                extra,
                "bootstrap_timeout",
                _env_float("VLLM_MOONCAKE_CONNECTOR_TIMEOUT", DEFAULT_BOOTSTRAP_TIMEOUT),
            ),
            auth_key=key,
            accepted_keys=_accepted_keys(extra, key),
            num_workers=workers,
            lease=_lease(extra),
        )
