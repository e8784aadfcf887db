"""Shared builders and drivers for the sans-IO session tests (producer, consumer, machines).

Everything runs in virtual time: a ``Driver`` feeds a session events at explicit times and steps
through its timers with ``advance``. Pulls and cancels are built from a ``Geometry`` side, encoded
with pdwire's own codec, and replies are read back with ``decode_response``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

import msgspec

from pdwire import (
    Fingerprint,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponse,
    XferResponseStatus,
    XferResponseV2,
    decode_response,
    encode_cancel,
    encode_pull,
    sign,
)
from pdwire.consumer import ConsumerConfig, ConsumerSession
from pdwire.events import SendReply, TimePassed
from pdwire.http_models import EngineEntry
from pdwire.planning import Side, layout_of
from pdwire.producer import ProducerConfig, ProducerSession
from pdwire.sim.geometry import Geometry
from pdwire.versions import ALL_CAPS, LEGACY, PDWIRE_2, Profile

#: A small model: 4 layers, 8 KV heads, K and V regions per layer.
GEOM = Geometry(num_layers=4, num_kv_heads=8, head_dim=16, block_size=16, num_blocks=64)
FP = GEOM.fingerprint("tiny")
T = 480.0  # VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
CAPS = tuple(sorted(ALL_CAPS))
LEGACY_PULL_KEYS = frozenset(XferMetadata.__struct_fields__)
LEGACY_REPLY_KEYS = frozenset(XferResponse.__struct_fields__)

Blocks = list[list[int]]


def p_side(tp: int = 1, rank: int = 0, pp: int = 1, pp_rank: int = 0) -> Side:
    """A P worker's side; each (rank, stage) gets its own address space."""
    return GEOM.side(tp, rank, pp, pp_rank, worker=pp_rank * 16 + rank)


def d_side(tp: int = 1, rank: int = 0, pp: int = 1, pp_rank: int = 0) -> Side:
    """A D worker's side, in address spaces disjoint from every P worker's."""
    return GEOM.side(tp, rank, pp, pp_rank, worker=1000 + pp_rank * 16 + rank)


def producer(
    tp: int = 1, rank: int = 0, pp: int = 1, pp_rank: int = 0, **config: Any
) -> ProducerSession:
    return ProducerSession(ProducerConfig(side=p_side(tp, rank, pp, pp_rank), **config))


# -- D as P sees it: pulls and cancels -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DPeer:
    """One D worker, as far as its pulls and cancels show it to P."""

    side: Side = dataclasses.field(default_factory=d_side)
    hostname: str = "d0"
    port: int = 1
    pp_rank: int = 0
    v2: bool = True  # announce pdwire/2
    caps: tuple[str, ...] = CAPS
    fingerprint: Fingerprint | None = None
    layout_id: int = 0
    auth_key: bytes | None = None

    @property
    def profile(self) -> Profile:
        return PDWIRE_2 if self.v2 else LEGACY

    def pull_message(
        self,
        reqs: Mapping[str, tuple[str, Blocks]],
        *,
        with_layout: bool = True,
        deadline_ms: int = 0,
        remote_pp_size: int | None = None,
    ) -> XferMetadata:
        regions = self.side.regions if with_layout else ()
        fields: dict[str, Any] = {
            "remote_hostname": self.hostname,
            "remote_port": self.port,
            "remote_tp_size": self.side.tp_size,
            "remote_tp_rank": self.side.tp_rank,
            "req_blocks": {d: (t, b) for d, (t, b) in reqs.items()},
            **layout_of(regions),
            "remote_pp_size": self.side.pp_size if remote_pp_size is None else remote_pp_size,
            "layout_id": self.layout_id,
        }
        if not self.v2:
            return XferMetadata(**fields)
        msg = XferMetadataV2(
            **fields,
            pdwire_version=2,
            pdwire_caps=list(self.caps),
            fingerprint=self.fingerprint if with_layout else None,
            deadline_ms=deadline_ms,
        )
        return sign(msg, self.auth_key) if self.auth_key is not None else msg

    def pull(self, reqs: Mapping[str, tuple[str, Blocks]], **kw: Any) -> bytes:
        return encode_pull(self.pull_message(reqs, **kw), self.profile)

    def cancel(self, reqs: Mapping[str, str], *, reason: str = "test") -> bytes:
        msg = XferCancel(
            pdwire_version=2,
            remote_hostname=self.hostname,
            remote_port=self.port,
            remote_tp_size=self.side.tp_size,
            remote_tp_rank=self.side.tp_rank,
            cancel_reqs=dict(reqs),
            remote_pp_size=self.side.pp_size,
            remote_pp_rank=self.pp_rank,
            reason=reason,
        )
        if self.auth_key is not None:
            msg = sign(msg, self.auth_key)
        return encode_cancel(msg, PDWIRE_2)


# -- P as D sees it ---------------------------------------------------------------------------


def entry(
    engine_id: str = "e0",
    tp: int = 1,
    pp: int = 1,
    *,
    v2: bool = True,
    caps: Iterable[str] = CAPS,
) -> EngineEntry:
    """A /query entry for a P engine of ``tp`` x ``pp`` workers at ``tcp://p-<tp>-<pp>:<port>``."""
    workers = {
        t: {p: f"tcp://p-{engine_id}-{t}-{p}:{5000 + 16 * p + t}" for p in range(pp)}
        for t in range(tp)
    }
    return EngineEntry(
        engine_id=engine_id,
        worker_addr=workers,
        pdwire_version=2 if v2 else None,
        pdwire_caps=sorted(caps) if v2 else None,
        tp_size=tp if v2 else None,
        pp_size=pp if v2 else None,
    )


def consumer(
    tp: int = 1, rank: int = 0, pp: int = 1, pp_rank: int = 0, **config: Any
) -> ConsumerSession:
    config.setdefault("hostname", "d0")
    config.setdefault("port", 1)
    return ConsumerSession(
        ConsumerConfig(side=d_side(tp, rank, pp, pp_rank), pp_rank=pp_rank, **config)
    )


def reply_bytes(
    status: int,
    ok: Iterable[str] | None = None,
    err: Iterable[str] | None = None,
    *,
    err_msg: str | None = None,
    layout_id: int = 0,
    err_code: str | None = None,
    err_codes: Mapping[str, str] | None = None,
    v2: bool = False,
    caps: Iterable[str] = CAPS,
    auth_key: bytes | None = None,
    answers: bytes | None = None,
) -> bytes:
    """What P would send on a pull: a reply, encoded as a legacy or a pdwire/2 P sends it
    (signed, with ``auth_key``, for the pull whose tag is ``answers``)."""
    ok_list, err_list = list(ok or ()), list(err or ())
    if not v2:
        reply = XferResponse(
            XferResponseStatus(status),
            ok_list or None,
            err_list or None,
            err_msg=err_msg,
            layout_id=layout_id,
        )
        return msgspec.msgpack.encode(reply)
    reply2 = XferResponseV2(
        XferResponseStatus(status),
        ok_list or None,
        err_list or None,
        err_msg=err_msg,
        layout_id=layout_id,
        pdwire_version=2,
        pdwire_caps=sorted(caps),
        err_code=err_code,
        err_codes=dict(err_codes) if err_codes else None,
    )
    if auth_key is not None:
        reply2 = sign(reply2, auth_key, answers)
    return msgspec.msgpack.encode(reply2)


# -- outputs ----------------------------------------------------------------------------------

Out = TypeVar("Out")


def of_type(out: Iterable[object], cls: type[Out]) -> list[Out]:
    return [o for o in out if isinstance(o, cls)]


def decoded(out: Iterable[object], identity: bytes | None = None) -> list[XferResponseV2]:
    """The replies among ``out`` (on ``identity`` only, when given), decoded from their bytes."""
    return [
        decode_response(o.data)
        for o in of_type(out, SendReply)
        if identity is None or o.identity == identity
    ]


def wire_keys(data: bytes) -> set[str]:
    obj = msgspec.msgpack.decode(data)
    assert isinstance(obj, dict)
    return set(obj)


# -- driving in virtual time --------------------------------------------------------------------

S = TypeVar("S", ProducerSession, ConsumerSession)


class Driver(Generic[S]):
    """Feeds one session events at explicit virtual times and keeps every output."""

    def __init__(self, session: S) -> None:
        self.session: S = session
        self.now = 0.0
        self.log: list[Any] = []

    def __call__(self, event: Any, at: float | None = None) -> list[Any]:
        if at is not None:
            assert at >= self.now, "virtual time only moves forward"
            self.now = at
        out: list[Any] = self.session.handle(event, self.now)
        self.log.extend(out)
        return out

    def advance(self, to: float) -> list[Any]:
        """Fire every timer due up to ``to``, each at its own time; end at ``to``."""
        out: list[Any] = []
        while (due := self.session.next_deadline()) is not None and due <= to:
            out += self(TimePassed(), max(due, self.now))
        out += self(TimePassed(), to)
        return out
