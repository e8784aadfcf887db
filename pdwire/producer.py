"""The producer (P worker) side of the protocol as a sans-IO session (spec §3, §10).

Feed it what happened with ``handle(event, now)``; it returns what to do: replies to send, batch
writes to start, blocks to free, requests to reject. It owns no socket, thread or clock; call
``handle(TimePassed(), now)`` at ``next_deadline()`` for its timers.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from typing import Final, TypeVar

import msgspec

from . import auth, sections
from . import error_strings as msgs
from .codec import REQUEST_KINDS, decode_pull, decode_request, encode_response
from .errors import DecodeError, LocalProtocolError, RemoteProtocolError
from .events import (
    FreeBlocks,
    FreeReason,
    MessageReceived,
    ProducerInput,
    ProducerOutput,
    RejectRequest,
    SendReply,
    StartWrite,
    TimePassed,
    TransferFinished,
    TransferStarted,
    TransferWillNotSend,
    WriteCompleted,
)
from .limits import REFERENCE, Limits, exceeded
from .messages import ErrorCode, Fingerprint, LeaseHeartbeat, XferCancel, XferMetadataV2
from .messages import XferResponseStatus as Status
from .messages import XferResponseV2 as Reply
from .negotiation import LEGACY_PEER, Agreement, Offer, negotiate
from .planning import (
    Descriptors,
    Plan,
    PlanError,
    Side,
    descriptors,
    has_opaque_packed_row,
    prepare,
    regions_of_pull,
    target_ranks,
)
from .session import Session, Timer, check_keyed, check_lease
from .transitions import TERMINAL, TRANSFER_TRANSITIONS, TransferEvent, TransferState
from .versions import ALL_CAPS, PDWIRE_2, Capability, Profile

S, E = TransferState, TransferEvent

#: vLLM's default of VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, seconds (§6).
ABORT_REQUEST_TIMEOUT: Final = 480.0
#: The discriminator keys of the kinds other than the pull (3.1-R7), as msgpack writes them.
_OTHER_KEYS: Final = tuple(
    msgspec.msgpack.encode(k) for k, kind in REQUEST_KINDS.items() if kind != "pull"
)

Peer = tuple[str, int, int]  # D worker: (remote_hostname, remote_port, remote_tp_rank)
_K = TypeVar("_K")

#: The limit that counts each state P remembers for a D worker that made it (§13.4).
_MADE_LIMITS: Final = {
    S.PLACEHOLDER: "placeholders_per_peer",
    S.CANCELLED: "remembered_cancels_per_peer",
}

_TOMBSTONE_CODES: Final = {
    S.NOT_SENT: (ErrorCode.WILL_NOT_SEND, msgs.WILL_NOT_SEND),
    S.EXPIRED: (ErrorCode.EXPIRED, msgs.EXPIRED),
    S.SERVED: (ErrorCode.EXPIRED, msgs.EXPIRED),
}


@dataclasses.dataclass(frozen=True)
class ProducerConfig:
    side: Side
    profile: Profile = PDWIRE_2
    caps: frozenset[str] = ALL_CAPS
    fingerprint: Fingerprint | None = None
    abort_timeout: float = ABORT_REQUEST_TIMEOUT
    #: vLLM 0.34's ``kv_lease_duration``: a finished transfer is held this long, renewals move
    #: it on (§6.4); None holds it for ``abort_timeout`` and refuses renewals.
    lease: float | None = None
    auth_key: bytes | None = None  # signs what this side sends
    accepted_keys: tuple[bytes, ...] = ()  # accepted besides auth_key: older keys (8.6-R16)
    limits: Limits = REFERENCE  # chapter 13

    def __post_init__(self) -> None:
        check_lease(self.lease)
        check_keyed(self.profile, self.auth_key)

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The keys this side verifies with."""
        return () if self.auth_key is None else (self.auth_key, *self.accepted_keys)


@dataclasses.dataclass(slots=True)
class _Transfer:
    transfer_id: str
    state: TransferState | None = None
    p_req_id: str = ""
    blocks: list[list[int]] | None = None
    expire_at: float = float("inf")
    need_send: int = 0  # pulls that must settle; fixed by the first pull that finds it ready
    settled: set[Peer] = dataclasses.field(default_factory=set)
    writing: int = 0
    bound_d_req: str | None = None
    waiting: set[int] = dataclasses.field(default_factory=set)  # keys of pulls waiting on it
    # The D worker whose pull made this placeholder, or whose cancel P remembers (§13.4):
    # counted against that worker's limit while the state lasts.
    made_by: Peer | None = None


@dataclasses.dataclass(slots=True)
class _Round:
    write_id: int
    reqs: list[str]  # d_req_ids written in this round


@dataclasses.dataclass(slots=True)
class _Pull:
    key: int
    identity: bytes
    peer: Peer
    msg: XferMetadataV2
    agreement: Agreement
    plan: Plan
    need_send: int
    pending: dict[str, str]  # d_req_id -> transfer_id, still waiting
    wait_until: float  # ready wait (restarts after each round)
    d_deadline: float  # pdwire/2: when D stops waiting
    ok: list[str] = dataclasses.field(default_factory=list)
    err: dict[str, tuple[ErrorCode, str]] = dataclasses.field(default_factory=dict)
    round: _Round | None = None
    generation: int = 0  # bumps when wait_until moves, to drop stale timer entries


#: Codes of optional behaviours: sent only to a D that announced the capability (7.2-R3).
_CODE_CAPS: Final = {
    ErrorCode.WILL_NOT_SEND: Capability.WILL_NOT_SEND,
    ErrorCode.CANCELLED: Capability.CANCEL,
    ErrorCode.DEADLINE_EXCEEDED: Capability.DEADLINE,
    ErrorCode.FINGERPRINT_MISMATCH: Capability.FINGERPRINT,
}


def _drop_unagreed_codes(reply: Reply, agreement: Agreement) -> None:
    def agreed(code: str | None) -> bool:
        cap = _CODE_CAPS.get(ErrorCode(code)) if code and code in ErrorCode.__members__ else None
        return cap is None or agreement.allows(cap)

    if not agreed(reply.err_code):
        reply.err_code = None
    if reply.err_codes:
        reply.err_codes = {d: c for d, c in reply.err_codes.items() if agreed(c)} or None


class ProducerSession(Session[ProducerInput, ProducerOutput]):
    """One P worker's protocol state: its transfers, the pulls it serves, its layout cache."""

    def __init__(self, config: ProducerConfig) -> None:
        super().__init__()
        self.config = config
        self._offer = Offer.of(config.profile, config.caps)
        self._transfers: dict[str, _Transfer] = {}
        self._pulls: dict[int, _Pull] = {}
        self._writes: dict[int, int] = {}  # write_id -> pull key
        self._deferred_cancels: dict[int, list[MessageReceived]] = {}  # pull key -> cancels
        # The auth_tag of the pull or cancel each identity sent, until its terminal reply: the
        # tags of the replies cover it (8.6-R13).
        self._answering: dict[bytes, bytes] = {}
        self._plans: OrderedDict[tuple[object, ...], Plan | PlanError] = OrderedDict()
        self._peer_layouts: OrderedDict[tuple[object, ...], Plan | PlanError] = OrderedDict()
        self._open_per_peer: Counter[Peer] = Counter()
        self._made_per_peer: Counter[tuple[TransferState, Peer]] = Counter()

    # -- public ------------------------------------------------------------------------------

    def state_of(self, transfer_id: str) -> TransferState | None:
        t = self._transfers.get(transfer_id)
        return None if t is None else t.state

    @property
    def blocks_held(self) -> int:
        """Number of transfers whose blocks P holds now."""
        return sum(1 for t in self._transfers.values() if t.state is S.READY)

    @property
    def limits(self) -> Limits:
        """The limits this P enforces (chapter 13)."""
        return self.config.limits

    @property
    def open_pulls(self) -> int:
        return len(self._pulls)

    def transfers_by_state(self) -> dict[str, int]:
        """How many transfers P knows in each state, by the state's value."""
        counts: dict[str, int] = {}
        for t in self._transfers.values():
            if t.state is not None:
                counts[t.state.value] = counts.get(t.state.value, 0) + 1
        return counts

    # -- transfers ---------------------------------------------------------------------------

    def _move(self, t: _Transfer, event: TransferEvent) -> None:
        nxt = TRANSFER_TRANSITIONS.get((t.state, event))
        if nxt is None:
            raise LocalProtocolError(
                f"transfer {t.transfer_id}: no transition from {t.state} on {event.value}",
                section=sections.BEHAVIOUR,
            )
        if t.made_by is not None and nxt is not t.state:
            assert t.state is not None
            self._uncount(self._made_per_peer, (t.state, t.made_by))
            t.made_by = None
        t.state = nxt
        if nxt is S.FORGOTTEN:
            del self._transfers[t.transfer_id]

    def _remember(self, t: _Transfer) -> None:
        """Keep ``t`` for the retention timer (a placeholder, a tombstone, a pending cancel)."""
        t.expire_at = self._now + self.config.abort_timeout
        self._push(t.expire_at, "transfer", t.transfer_id)

    def _make(self, transfer_id: str, event: TransferEvent, peer: Peer) -> _Transfer:
        """A remembered state for a transfer P holds nothing for, made by ``peer``'s pull (a
        placeholder) or cancel, and counted against that peer's limit (§13.4)."""
        t = self._transfers[transfer_id] = _Transfer(transfer_id)
        self._remember(t)
        self._move(t, event)
        assert t.state is not None
        t.made_by = peer
        self._made_per_peer[(t.state, peer)] += 1
        return t

    def _past(self, limit: str, value: int) -> tuple[ErrorCode, str] | None:
        """The refusal of what would bring the count of ``limit`` to ``value``, when that is
        past this P's limit (13.1-R3)."""
        maximum: int = getattr(self.limits, limit)
        if value <= maximum:
            return None
        return ErrorCode.LIMIT_EXCEEDED, exceeded(limit, value, maximum)

    def _past_made(self, event: TransferEvent, peer: Peer) -> tuple[ErrorCode, str] | None:
        """The refusal of one more state ``event`` would make for ``peer`` (§13.4)."""
        state = TRANSFER_TRANSITIONS[(None, event)]
        return self._past(_MADE_LIMITS[state], self._made_per_peer[(state, peer)] + 1)

    @staticmethod
    def _uncount(counter: Counter[_K], key: _K) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]

    def _transfer(self, transfer_id: str) -> _Transfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            t = self._transfers[transfer_id] = _Transfer(transfer_id)
        return t

    def _dispatch(self, event: ProducerInput, now: float) -> None:
        match event:
            case MessageReceived():
                self._on_message(event, now)
            case TransferStarted():
                self._on_started(event, now)
            case TransferFinished():
                self._on_finished(event, now)
            case TransferWillNotSend():
                self._on_will_not_send(event, now)
            case WriteCompleted():
                self._on_write_completed(event, now)
            case TimePassed():
                self._on_time(event, now)
            case _:
                raise TypeError(f"not an input of P's session: {event!r}")

    def _on_started(self, ev: TransferStarted, now: float) -> None:
        t = self._transfers.get(ev.transfer_id)
        if t is not None and t.state in (S.RECORDED, S.READY) and t.p_req_id != ev.p_req_id:
            message = msgs.DUPLICATE_TRANSFER_ID.format(transfer_id=ev.transfer_id)
            self._out.append(
                RejectRequest(ev.p_req_id, ev.transfer_id, ErrorCode.DUPLICATE_TRANSFER_ID, message)
            )
            return
        t = self._transfer(ev.transfer_id)
        if t.state is S.RECORDED:
            return  # the same request again: nothing new
        self._reset_if_done(t)
        self._move(t, E.STARTED)
        t.p_req_id, t.expire_at = ev.p_req_id, float("inf")

    def _on_finished(self, ev: TransferFinished, now: float) -> None:
        t = self._transfers.get(ev.transfer_id)
        if t is not None and t.state is S.READY:
            raise LocalProtocolError(
                f"transfer {ev.transfer_id} finished twice", section=sections.BEHAVIOUR
            )
        if t is not None and t.p_req_id and t.p_req_id != ev.p_req_id and t.state is S.RECORDED:
            message = msgs.DUPLICATE_TRANSFER_ID.format(transfer_id=ev.transfer_id)
            self._out.append(
                RejectRequest(ev.p_req_id, ev.transfer_id, ErrorCode.DUPLICATE_TRANSFER_ID, message)
            )
            self._out.append(FreeBlocks(ev.p_req_id, ev.transfer_id, FreeReason.WILL_NOT_SEND))
            return
        t = self._transfer(ev.transfer_id)
        self._reset_if_done(t)
        self._move(t, E.FINISHED)
        t.p_req_id, t.blocks = ev.p_req_id, ev.blocks
        t.expire_at = now + (self.config.lease or self.config.abort_timeout)
        self._push(t.expire_at, "transfer", t.transfer_id)
        if t.need_send and len(t.settled) >= t.need_send:  # every pull was cancelled already
            self._settle_all(t, FreeReason.CANCELLED)
            return
        for key in list(t.waiting):
            self._try_round(self._pulls[key], now)

    def _on_will_not_send(self, ev: TransferWillNotSend, now: float) -> None:
        t = self._transfers.get(ev.transfer_id)
        if t is not None and t.state is S.READY:
            raise LocalProtocolError(
                f"transfer {ev.transfer_id} already finished; it cannot become will-not-send",
                section=sections.BEHAVIOUR,
            )
        if t is not None and t.p_req_id and t.p_req_id != ev.p_req_id:
            return  # a rejected duplicate ended; the transfer belongs to the other request
        t = self._transfer(ev.transfer_id)
        self._reset_if_done(t)
        self._move(t, E.WILL_NOT_SEND)
        t.p_req_id = ev.p_req_id
        self._remember(t)
        self._out.append(FreeBlocks(ev.p_req_id, ev.transfer_id, FreeReason.WILL_NOT_SEND))
        self._answer_waiting(t, now)

    def _reset_if_done(self, t: _Transfer) -> None:
        """A remembered end (served, expired, not sent) gives way to a new request."""
        if t.state in TERMINAL:
            t.need_send, t.settled, t.bound_d_req, t.blocks = 0, set(), None, None

    def _answer_waiting(self, t: _Transfer, now: float) -> None:
        for key in list(t.waiting):
            self._try_round(self._pulls[key], now)

    def _settle(self, t: _Transfer, peer: Peer, reason: FreeReason = FreeReason.SERVED) -> None:
        """``peer``'s pull is settled; ``reason`` says how, should it be the last one."""
        t.settled.add(peer)
        self._free_if_done(t, reason)

    def _free_if_done(self, t: _Transfer, reason: FreeReason) -> None:
        """Free once every required pull settled and no write reads the blocks (10.9.1-2)."""
        if t.state is S.READY and not t.writing and t.need_send and len(t.settled) >= t.need_send:
            self._settle_all(t, reason)

    def _settle_all(self, t: _Transfer, reason: FreeReason) -> None:
        self._move(t, E.ALL_SETTLED)
        t.blocks = None
        self._out.append(FreeBlocks(t.p_req_id, t.transfer_id, reason))
        self._remember(t)

    def _expire(self, t: _Transfer, now: float) -> None:
        if t.state is S.READY:
            if t.writing:
                return  # never while a write is in flight (§10.9.2); retried when it ends
            self._move(t, E.TIMER_FIRED)
            t.blocks = None
            self._out.append(FreeBlocks(t.p_req_id, t.transfer_id, FreeReason.EXPIRED))
            self._remember(t)
            self._answer_waiting(t, now)
        elif t.state is S.PLACEHOLDER:
            self._move(t, E.TIMER_FIRED)
            self._remember(t)
            self._answer_waiting(t, now)
        elif t.state is not S.RECORDED:
            self._move(t, E.TIMER_FIRED)

    # -- messages ----------------------------------------------------------------------------

    def _on_message(self, ev: MessageReceived, now: float) -> None:
        """A pull, a heartbeat or a cancel, told apart by the one discriminator key each
        carries (3.1-R7). Pulls are the common case: a message in which neither of the other
        kinds' keys occurs is decoded as a pull straight away."""
        limit = self.limits.message_bytes
        try:
            if any(key in ev.data for key in _OTHER_KEYS):
                msg = decode_request(ev.data, max_size=limit)[1]
            else:
                msg = decode_pull(ev.data, max_size=limit)
        except DecodeError as exc:
            self._reply_error(
                ev.identity, self._announced(ev.data), ErrorCode.BAD_MESSAGE, str(exc)
            )
            return
        if isinstance(msg, LeaseHeartbeat):
            self._on_heartbeat(ev, msg, now)
        elif isinstance(msg, XferCancel):
            self._on_cancel(ev, msg, now)
        else:
            self._on_pull(ev.identity, msg, now)

    def _announced(self, data: bytes) -> Agreement | None:
        """What a frame that did not decode announced, if its top level says pdwire/2: such a
        sender gets the error code too (2.4-R2)."""
        try:
            obj = msgspec.msgpack.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return None
        version = obj.get("pdwire_version") if isinstance(obj, dict) else None
        if type(version) is not int or version < 2:
            return None
        caps = obj.get("pdwire_caps")
        ok_caps = caps if isinstance(caps, list) and all(type(c) is str for c in caps) else []
        return self._agreement(version, ok_caps)

    def _agreement(self, version: int, caps: list[str]) -> Agreement:
        peer = Offer(version, frozenset(caps)) if version >= 2 else LEGACY_PEER
        return negotiate("prefill", self._offer, peer)

    def _reply(self, identity: bytes, agreement: Agreement | None, reply: Reply) -> None:
        if reply.status is Status.CONTINUE:
            answers = self._answering.get(identity)
        else:
            answers = self._answering.pop(identity, None)
        agreement = agreement or negotiate("prefill", self._offer, LEGACY_PEER)
        if agreement.announce:
            reply.pdwire_version = self._offer.version
            reply.pdwire_caps = sorted(self._offer.caps)
            _drop_unagreed_codes(reply, agreement)
        if self.config.auth_key is not None and agreement.allows(Capability.AUTH):
            reply = auth.sign(reply, self.config.auth_key, answers)
        self._out.append(SendReply(identity, reply, encode_response(reply, agreement)))

    def _reply_error(
        self,
        identity: bytes,
        agreement: Agreement | None,
        code: ErrorCode,
        message: str,
        status: Status = Status.ERROR,
        layout_id: int = 0,
    ) -> None:
        self._reply(
            identity, agreement, Reply(status, err_msg=message, err_code=code, layout_id=layout_id)
        )

    def _authentic(self, msg: XferMetadataV2 | XferCancel) -> bool:
        if self.config.auth_key is None:
            return True
        try:
            auth.verify(msg, self.config.keys)
        except RemoteProtocolError:
            return False
        return True

    def _on_pull(self, identity: bytes, msg: XferMetadataV2, now: float) -> None:
        if msg.auth_tag is not None:
            self._answering[identity] = msg.auth_tag
        agreement = self._agreement(msg.pdwire_version, msg.pdwire_caps)
        problem = self._check_pull(msg, agreement)
        if problem is not None:
            code, message, status = problem
            self._reply_error(identity, agreement, code, message, status)
            return
        plan_or_error = self._plan_for(msg)
        if plan_or_error is None:
            message = msgs.LAYOUT_NOT_CACHED.format(
                layout_id=msg.layout_id,
                remote_hostname=msg.remote_hostname,
                remote_port=msg.remote_port,
            )
            self._reply_error(
                identity, agreement, ErrorCode.LAYOUT_MISS, message, Status.LAYOUT_MISS
            )
            return
        if isinstance(plan_or_error, PlanError):
            self._reply_error(identity, agreement, plan_or_error.code, plan_or_error.message)
            return
        pull = self._open_pull(identity, msg, agreement, plan_or_error, now)
        seen: set[str] = set()
        for d_req, (transfer_id, _) in msg.req_blocks.items():
            if transfer_id in seen:
                pull.err[d_req] = self._duplicate(transfer_id)
                continue
            seen.add(transfer_id)
            t = self._transfers.get(transfer_id)
            if t is None:  # a placeholder, which expires (§10.11.4)
                refused = self._past_made(E.PULL_NAMED, pull.peer)
                if refused is not None:
                    pull.err[d_req] = refused
                    continue
                t = self._make(transfer_id, E.PULL_NAMED, pull.peer)
            else:
                self._move(t, E.PULL_NAMED)
            if not self._binds(t, d_req):
                pull.err[d_req] = self._duplicate(transfer_id)
                continue
            pull.pending[d_req] = transfer_id
            t.waiting.add(pull.key)
        self._try_round(pull, now)

    def _binds(self, t: _Transfer, d_req: str) -> bool:
        """Whether ``d_req`` may name ``t``: the first request to name a transfer binds it
        (10.11.9), but any may name one P will not send, since P writes nothing for it: each is
        answered will-not-send (10.11.10). vLLM's D names such a transfer again, under a new id,
        in the release-only pull for a request its server answered with an error."""
        if t.bound_d_req is None:
            t.bound_d_req = d_req
        return t.bound_d_req == d_req or t.state is S.NOT_SENT

    def _duplicate(self, transfer_id: str) -> tuple[ErrorCode, str]:
        message = msgs.DUPLICATE_TRANSFER_ID.format(transfer_id=transfer_id)
        return ErrorCode.DUPLICATE_TRANSFER_ID, message

    def _check_pull(
        self, msg: XferMetadataV2, agreement: Agreement
    ) -> tuple[ErrorCode, str, Status] | None:
        """The checks of §10.4.1 that come before the layout, in order."""
        if not self._authentic(msg):
            return ErrorCode.AUTH_FAILED, msgs.AUTH_FAILED, Status.ERROR
        peer = (msg.remote_hostname, msg.remote_port, msg.remote_tp_rank)
        over = self._past("requests_per_message", len(msg.req_blocks)) or self._past(
            "open_pulls_per_peer", self._open_per_peer[peer] + 1
        )
        if over is not None:
            return (*over, Status.ERROR)
        fp = self.config.fingerprint
        if fp is not None and msg.fingerprint is not None and msg.fingerprint != fp:
            fields = ", ".join(fp.differing_fields(msg.fingerprint))
            return (
                ErrorCode.FINGERPRINT_MISMATCH,
                msgs.FINGERPRINT_MISMATCH.format(fields=fields),
                Status.ERROR,
            )
        side = self.config.side
        try:
            paired = target_ranks(side.tp_size, side.tp_rank, msg.remote_tp_size)
        except ValueError as exc:  # TP sizes that do not divide: vLLM's own text (10.1.1)
            return ErrorCode.TP_RANK_NOT_PAIRED, str(exc), Status.ERROR
        if msg.remote_tp_rank not in paired:
            message = msgs.TP_RANK_NOT_PAIRED.format(
                d_tp_rank=msg.remote_tp_rank, p_tp_rank=side.tp_rank, expected=paired
            )
            return ErrorCode.TP_RANK_NOT_PAIRED, message, Status.ERROR
        return self._check_stages(msg)

    def _check_stages(self, msg: XferMetadataV2) -> tuple[ErrorCode, str, Status] | None:
        """The PP checks of a pull whose TP rank is paired: §10.2.8, then §10.11.11."""
        return self._check_packed_rows(msg) or self._check_pp_size(msg)

    def _check_packed_rows(self, msg: XferMetadataV2) -> tuple[ErrorCode, str, Status] | None:
        """§10.2.8: an opaque packed row hides the layers it holds from a PP-partial alignment."""
        side = self.config.side
        if msg.remote_pp_size == side.pp_size:
            return None
        if not (has_opaque_packed_row(side.regions) or has_opaque_packed_row(regions_of_pull(msg))):
            return None
        message = msgs.PP_PACKED_ROWS.format(p_pp_size=side.pp_size, d_pp_size=msg.remote_pp_size)
        return ErrorCode.PP_PACKED_ROWS, message, Status.ERROR

    def _check_pp_size(self, msg: XferMetadataV2) -> tuple[ErrorCode, str, Status] | None:
        """§10.11.11: a D stage that holds part of the model but says it has one stage."""
        if msg.remote_pp_size != 1 or not msg.registered_layer_names:
            return None
        fp, side = self.config.fingerprint, self.config.side
        total = fp.num_layers if fp else None
        if total is None and side.pp_size == 1:
            total = len({r.layer_name for r in side.regions})
        registered = len(set(msg.registered_layer_names))
        if total is None or registered >= total:
            return None
        if has_opaque_packed_row(regions_of_pull(msg)):
            return None  # its layer names do not count the layers it holds
        message = msgs.MISSING_REMOTE_PP_SIZE.format(registered=registered, total=total)
        return ErrorCode.MISSING_REMOTE_PP_SIZE, message, Status.ERROR

    def _plan_for(self, msg: XferMetadataV2) -> Plan | PlanError | None:
        """The plan for the pull's layout; None when the layout was omitted and is not cached."""
        peer_key = (
            msg.remote_hostname,
            msg.remote_port,
            msg.remote_tp_rank,
            msg.remote_pp_size,
            msg.remote_tp_size,
            msg.layout_id,
        )
        if msg.layout_id and not msg.kv_caches_base_addr:
            plan = self._peer_layouts.get(peer_key)
            if plan is not None:
                self._peer_layouts.move_to_end(peer_key)
            return plan
        layout_key = (
            msg.remote_tp_size,
            msg.remote_tp_rank,
            msg.remote_pp_size,
            tuple(msg.kv_caches_base_addr),
            tuple(msg.block_lens),
            tuple(msg.kv_block_lens),
            tuple(msg.registered_layer_names),
            tuple(msg.registered_layer_indices),
            tuple(msg.registered_group_indices),
            tuple(map(tuple, msg.registered_shared_group_ids)),
            tuple(msg.registered_row_offsets),
        )
        plan = self._plans.get(layout_key)
        if plan is not None:
            self._plans.move_to_end(layout_key)
        else:
            consumer = Side(
                tp_size=msg.remote_tp_size,
                tp_rank=msg.remote_tp_rank,
                pp_size=msg.remote_pp_size,
                regions=regions_of_pull(msg),
            )
            plan = self._plans[layout_key] = prepare(self.config.side, consumer)
            self._bound(self._plans)
        if msg.layout_id and not isinstance(plan, PlanError):
            self._peer_layouts[peer_key] = plan
            self._peer_layouts.move_to_end(peer_key)
            self._bound(self._peer_layouts)
        return plan

    def _bound(self, cache: OrderedDict[tuple[object, ...], Plan | PlanError]) -> None:
        """Drop the least recently used entries past ``cached_layouts`` (§13.5)."""
        while len(cache) > self.limits.cached_layouts:
            cache.popitem(last=False)

    def _open_pull(
        self, identity: bytes, msg: XferMetadataV2, agreement: Agreement, plan: Plan, now: float
    ) -> _Pull:
        side = self.config.side
        paired = len(target_ranks(side.tp_size, side.tp_rank, msg.remote_tp_size))
        pp = msg.remote_pp_size
        need_send = paired * (pp if pp > 1 and pp != side.pp_size else 1)
        d_deadline = float("inf")
        if msg.deadline_ms and agreement.allows(Capability.DEADLINE):
            d_deadline = now + msg.deadline_ms / 1000
        key = next(self._ids)
        pull = _Pull(
            key=key,
            identity=identity,
            peer=(msg.remote_hostname, msg.remote_port, msg.remote_tp_rank),
            msg=msg,
            agreement=agreement,
            plan=plan,
            need_send=need_send,
            pending={},
            wait_until=now + self.config.abort_timeout,
            d_deadline=d_deadline,
        )
        self._pulls[key] = pull
        self._open_per_peer[pull.peer] += 1
        self._push_pull_timer(pull)
        return pull

    # -- rounds ------------------------------------------------------------------------------

    def _try_round(self, pull: _Pull, now: float) -> None:
        """Serve what is ready of ``pull`` (§10.5); reply when nothing is left to write."""
        if pull.round is not None:
            return
        parts: list[Descriptors] = []
        written: list[str] = []
        for d_req, transfer_id in list(pull.pending.items()):
            t = self._transfers.get(transfer_id)
            if t is None or t.state is None:
                del pull.pending[d_req]
                pull.err[d_req] = _TOMBSTONE_CODES[S.EXPIRED]
            elif t.state is S.READY:
                self._take_for_round(pull, t, d_req, parts, written)
            elif t.state in _TOMBSTONE_CODES:
                del pull.pending[d_req]
                t.waiting.discard(pull.key)
                pull.err[d_req] = _TOMBSTONE_CODES[t.state]
        if parts and any(len(p) for p in parts):
            write_id = next(self._ids)
            pull.round = _Round(write_id, written)
            self._writes[write_id] = pull.key
            peer = f"{pull.msg.remote_hostname}:{pull.msg.remote_port}"
            self._out.append(StartWrite(write_id, peer, Descriptors.concat(parts), tuple(written)))
            return
        if written:
            pull.round = _Round(0, written)
            self._finish_round(pull, 0, now)
            return
        self._flush(pull)

    def _take_for_round(
        self, pull: _Pull, t: _Transfer, d_req: str, parts: list[Descriptors], written: list[str]
    ) -> None:
        del pull.pending[d_req]
        t.waiting.discard(pull.key)
        if not t.need_send:
            t.need_send = pull.need_send
        assert t.blocks is not None
        planned = descriptors(pull.plan, t.blocks, pull.msg.req_blocks[d_req][1])
        if isinstance(planned, PlanError):
            pull.err[d_req] = (planned.code, planned.message)
            return
        t.writing += 1
        parts.append(planned)
        written.append(d_req)

    def _on_write_completed(self, ev: WriteCompleted, now: float) -> None:
        key = self._writes.pop(ev.write_id, None)
        if key is None:
            raise LocalProtocolError(f"unknown write {ev.write_id}", section=sections.BEHAVIOUR)
        self._finish_round(self._pulls[key], ev.status, now)

    def _finish_round(self, pull: _Pull, status: int, now: float) -> None:
        assert pull.round is not None
        for d_req in pull.round.reqs:
            t = self._transfers[pull.msg.req_blocks[d_req][0]]
            t.writing -= 1
            if status == 0:
                pull.ok.append(d_req)
                t.settled.add(pull.peer)
            else:
                pull.err[d_req] = (ErrorCode.ENGINE_ERROR, msgs.ENGINE_RETURNED.format(ret=status))
            self._free_if_done(t, FreeReason.SERVED)
            if t.state is S.READY and not t.writing and t.expire_at <= now:
                self._expire(t, now)
        pull.round = None
        pull.wait_until = now + self.config.abort_timeout
        self._push_pull_timer(pull)
        cancels = self._deferred_cancels.pop(pull.key, [])
        self._flush(pull)
        for cancel in cancels:
            self._on_message(cancel, now)
        if pull.key in self._pulls:
            self._try_round(pull, now)

    def _flush(self, pull: _Pull) -> None:
        """Reply with what the pull has to report: CONTINUE, or FINISH once nothing is pending.
        Nothing while a round is being written: its end reports everything (3.4-R17)."""
        if pull.round is not None or (pull.pending and not (pull.ok or pull.err)):
            return
        status = Status.CONTINUE if pull.pending else Status.FINISH
        self._reply(pull.identity, pull.agreement, self._round_reply(pull, status))
        pull.ok, pull.err = [], {}
        if status is Status.FINISH:
            self._close(pull)

    def _round_reply(self, pull: _Pull, status: Status) -> Reply:
        err = pull.err
        first = next(iter(err.values()), None)
        layout_id = pull.msg.layout_id
        return Reply(
            status,
            ok_reqs=pull.ok or None,
            err_reqs=list(err) or None,
            err_msg="; ".join(dict.fromkeys(m for _, m in err.values())) or None,
            layout_id=layout_id,
            err_code=first[0] if first else None,
            err_codes={d: c for d, (c, _) in err.items()} or None,
        )

    def _close(self, pull: _Pull) -> None:
        for transfer_id in pull.pending.values():
            t = self._transfers.get(transfer_id)
            if t is not None:
                t.waiting.discard(pull.key)
        del self._pulls[pull.key]
        self._uncount(self._open_per_peer, pull.peer)

    # -- lease (vLLM 0.34, §3.9, §6.4) --------------------------------------------------------

    def _on_heartbeat(self, ev: MessageReceived, heartbeat: LeaseHeartbeat, now: float) -> None:
        """Renew the lease of each named transfer whose blocks P holds. A renewal never makes a
        transfer: one P does not hold yet gets its lease when it finishes, one P freed stays
        freed."""
        lease = self.config.lease
        if lease is None:
            self._reply_error(ev.identity, None, ErrorCode.BAD_MESSAGE, msgs.LEASE_NOT_SET)
            return
        over = self._past("requests_per_message", len(heartbeat.lease_transfer_ids))
        if over is not None:
            self._reply_error(ev.identity, None, *over)
            return
        renewed_until = now + lease * 2 / 3
        for transfer_id in heartbeat.lease_transfer_ids:
            t = self._transfers.get(transfer_id)
            if t is not None and t.state is S.READY and t.expire_at < renewed_until:
                t.expire_at = renewed_until
                self._push(t.expire_at, "transfer", t.transfer_id)
        self._reply(ev.identity, None, Reply(Status.FINISH))

    # -- cancel (pdwire/2, §3.5) -------------------------------------------------------------

    def _on_cancel(self, ev: MessageReceived, cancel: XferCancel, now: float) -> None:
        if cancel.auth_tag is not None:
            self._answering[ev.identity] = cancel.auth_tag
        agreement = self._agreement(cancel.pdwire_version, [])
        if not self._authentic(cancel):
            self._reply_error(ev.identity, agreement, ErrorCode.AUTH_FAILED, msgs.AUTH_FAILED)
            return
        if Capability.CANCEL.value not in self._offer.caps:
            message = "XferCancel is not accepted: this P did not announce 'cancel'."
            self._reply_error(ev.identity, agreement, ErrorCode.BAD_MESSAGE, message)
            return
        over = self._past("requests_per_message", len(cancel.cancel_reqs))
        if over is not None:
            self._reply_error(ev.identity, agreement, *over)
            return
        side = self.config.side
        try:
            paired = len(target_ranks(side.tp_size, side.tp_rank, cancel.remote_tp_size))
        except ValueError as exc:  # TP sizes that do not divide: that D pulled nothing (10.1.1)
            self._reply_error(ev.identity, agreement, ErrorCode.TP_RANK_NOT_PAIRED, str(exc))
            return
        peer = (cancel.remote_hostname, cancel.remote_port, cancel.remote_tp_rank)
        writing = [
            p
            for p in self._pulls.values()
            if p.peer == peer
            and p.round is not None
            and any(d in cancel.cancel_reqs for d in p.round.reqs)
        ]
        if writing:  # answer only once those writes are done (3.5-R10)
            self._deferred_cancels.setdefault(writing[0].key, []).append(ev)
            return
        pp = cancel.remote_pp_size
        need_send = paired * (pp if pp > 1 and pp != side.pp_size else 1)
        cancelled: list[str] = []
        refused: dict[str, tuple[ErrorCode, str]] = {}
        touched: list[_Pull] = []
        for d_req, transfer_id in cancel.cancel_reqs.items():
            t = self._transfers.get(transfer_id)
            if t is not None and t.bound_d_req not in (None, d_req):
                continue  # the transfer_id belongs to another request (10.11.9)
            held = t is not None and t.state in (S.PLACEHOLDER, S.RECORDED, S.READY)
            for p in self._pulls.values():
                if p.peer == peer and p.pending.get(d_req) == transfer_id:
                    del p.pending[d_req]
                    p.err[d_req] = (ErrorCode.CANCELLED, msgs.CANCELLED)
                    touched.append(p)
                    held = True
            if t is None:  # applied if P records the request later (3.5-R16)
                past = self._past_made(E.CANCELLED, peer)
                if past is not None:
                    refused[d_req] = past
                    continue
                t = self._make(transfer_id, E.CANCELLED, peer)
            else:
                t.waiting.difference_update(p.key for p in touched)
                self._move(t, E.CANCELLED)
            if not t.need_send:
                t.need_send = need_send
            self._settle(t, peer, FreeReason.CANCELLED)
            if held:
                cancelled.append(d_req)
        reply = Reply(
            Status.FINISH,
            ok_reqs=cancelled or None,
            err_reqs=list(refused) or None,
            err_msg=next(iter(refused.values()))[1] if refused else None,
            err_codes={d: code for d, (code, _) in refused.items()} or None,
        )
        self._reply(ev.identity, agreement, reply)
        for p in touched:
            if p.key in self._pulls:
                self._flush(p)

    # -- timers ------------------------------------------------------------------------------

    def _push_pull_timer(self, pull: _Pull) -> None:
        pull.generation += 1
        self._push(min(pull.wait_until, pull.d_deadline), "pull", (pull.key, pull.generation))

    def _timer_live(self, entry: Timer) -> bool:
        when, _, kind, what = entry
        if kind == "pull":
            assert isinstance(what, tuple)
            pull = self._pulls.get(what[0])
            return pull is not None and pull.generation == what[1]
        t = self._transfers.get(str(what))
        return t is not None and t.expire_at == when

    def _fire(self, entry: Timer, now: float) -> None:
        if entry[2] == "transfer":
            self._expire(self._transfers[str(entry[3])], now)
        else:
            self._pull_timer(self._pulls[entry[3][0]], now)

    def _pull_timer(self, pull: _Pull, now: float) -> None:
        if pull.round is not None or not pull.pending:
            return
        if pull.d_deadline <= now:
            reason = (ErrorCode.DEADLINE_EXCEEDED, msgs.DEADLINE_EXCEEDED)
        else:
            reason = (ErrorCode.READY_TIMEOUT, msgs.READY_TIMEOUT)
        for d_req, transfer_id in pull.pending.items():
            pull.err[d_req] = reason
            t = self._transfers.get(transfer_id)
            if t is not None:
                t.waiting.discard(pull.key)
        pull.pending = {}
        self._flush(pull)
