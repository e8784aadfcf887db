"""The consumer (D worker) side of the protocol as a sans-IO session (spec §3, §4.2, §10).

D asks to load requests; the session says which bootstrap to query, which pulls to send where,
and when each request is loaded or failed. It owns no socket, thread or clock: every input comes
with ``now``, and ``next_deadline()`` says when to call ``handle(TimePassed(), now)``.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Final

from . import auth, sections
from .codec import decode_response, encode_cancel, encode_heartbeat, encode_pull
from .errors import DecodeError, LocalProtocolError, RemoteProtocolError
from .events import (
    AbortRequested,
    BlocksReleased,
    ClosePull,
    ConsumerInput,
    ConsumerOutput,
    EngineResolved,
    LeaseRejected,
    LoadRequest,
    LoadsRequested,
    QueryBootstrap,
    ReplyReceived,
    RequestFailed,
    RequestLoaded,
    RequestQueued,
    SendPull,
    TimePassed,
)
from .http_models import EngineEntry
from .messages import (
    ErrorCode,
    Fingerprint,
    LeaseHeartbeat,
    XferCancel,
    XferMetadata,
    XferMetadataV2,
    XferResponseV2,
)
from .messages import XferResponseStatus as Status
from .negotiation import LEGACY_PEER, Agreement, Offer, negotiate
from .planning import Side, layout_of, target_ranks
from .session import Session, Timer, check_keyed, check_lease
from .transitions import LOAD_TRANSITIONS, LoadEvent, LoadState
from .versions import ALL_CAPS, PDWIRE_2, Capability, Profile

L, LE = LoadState, LoadEvent

#: (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60) s, vLLM's receive timeout on a pull (§6).
RECEIVE_TIMEOUT: Final = 540.0
#: pdwire/2: how long D waits for a request's KV before it gives up (§6).
LOAD_DEADLINE: Final = 60.0

UNREPORTED: Final = "peer finished without reporting a transfer result"


def mint_layout_id() -> int:
    """A new layout id, as D mints one each time it registers its KV caches at new addresses:
    random, odd, below 2**63 (3.7-R1, R2)."""
    return secrets.randbits(63) | 1


@dataclasses.dataclass(frozen=True)
class ConsumerConfig:
    hostname: str  # where P writes: this worker's transfer-engine host
    port: int  # ... and RPC port
    side: Side  # this worker's TP/PP position and registered regions
    pp_rank: int = 0
    profile: Profile = PDWIRE_2
    caps: frozenset[str] = ALL_CAPS
    fingerprint: Fingerprint | None = None
    layout_id: int = 0  # nonzero: omit the layout once a P worker echoed it (§3.7)
    receive_timeout: float = RECEIVE_TIMEOUT
    deadline: float = LOAD_DEADLINE
    #: vLLM 0.34's ``kv_lease_duration``: renew P's lease every lease/6 s (§6.4); None = never.
    lease: float | None = None
    auth_key: bytes | None = None  # signs what this side sends
    accepted_keys: tuple[bytes, ...] = ()  # accepted besides auth_key: older keys (8.6-R16)

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The keys this side verifies with."""
        return () if self.auth_key is None else (self.auth_key, *self.accepted_keys)

    def __post_init__(self) -> None:
        check_lease(self.lease)
        check_keyed(self.profile, self.auth_key)


@dataclasses.dataclass(slots=True)
class _Load:
    req: LoadRequest
    state: LoadState | None = None
    outstanding: int = 0  # pulls that have not settled this request
    failure: tuple[ErrorCode, str] | None = None
    deadline: float = float("inf")
    reported: bool = False  # RequestFailed already emitted (deadline, abort)


@dataclasses.dataclass(slots=True)
class _Pull:
    pull_id: int
    addr: str
    engine_id: str
    reqs: dict[str, str]  # d_req_id -> transfer_id, not settled by this pull yet
    with_layout: bool
    announced: bool
    agreement: Agreement
    receive_until: float
    cancel: bool = False
    heartbeat: bool = False
    tag: bytes | None = None  # the auth_tag it was sent with, which its replies' tags cover


class ConsumerSession(Session[ConsumerInput, ConsumerOutput]):
    """One D worker's protocol state: the engines it knows, its pulls, its loading requests."""

    def __init__(self, config: ConsumerConfig) -> None:
        super().__init__()
        self.config = config
        self._offer = Offer.of(config.profile, config.caps)
        self._engines: dict[str, EngineEntry] = {}
        self._waiting: dict[str, list[LoadRequest]] = defaultdict(list)
        self._loads: dict[str, _Load] = {}
        self._pulls: dict[int, _Pull] = {}
        self._peers: dict[str, Offer] = {}  # what each P worker showed of its version
        self._acked: set[str] = set()  # P workers that echoed our layout_id
        self._due: list[_Load] = []  # loads whose deadline fired in this handle
        # Requests whose lease D renews (§6.4), from arrival until the load settles:
        self._leases: dict[str, RequestQueued] = {}
        self._heartbeat_at: float | None = None  # when the next renewal is due, if armed
        self._last_heartbeat = float("-inf")
        self._renewal_owed: set[str] = set()  # engines to renew once their query answers
        self._layout = self._layout_fields()

    # -- public ------------------------------------------------------------------------------

    def state_of(self, d_req_id: str) -> LoadState | None:
        load = self._loads.get(d_req_id)
        return None if load is None else load.state

    def knows_engine(self, engine_id: str) -> bool:
        """Whether D holds the /query entry of ``engine_id``: a load for it pulls at once."""
        return engine_id in self._engines

    @property
    def open_pulls(self) -> int:
        return len(self._pulls)

    @property
    def loading(self) -> int:
        return len(self._loads)

    @property
    def leases(self) -> int:
        """Requests whose lease D renews now."""
        return len(self._leases)

    # -- requests ----------------------------------------------------------------------------

    def _move(self, load: _Load, event: LoadEvent) -> None:
        nxt = LOAD_TRANSITIONS.get((load.state, event))
        if nxt is None:
            raise LocalProtocolError(
                f"request {load.req.d_req_id}: no transition from {load.state} on {event.value}",
                section=sections.BEHAVIOUR,
            )
        load.state = nxt

    def _dispatch(self, event: ConsumerInput, now: float) -> None:
        match event:
            case RequestQueued():
                self._on_queued(event, now)
            case LoadsRequested():
                self._on_loads(event, now)
            case EngineResolved():
                self._on_engine(event, now)
            case ReplyReceived():
                self._on_reply(event, now)
            case AbortRequested():
                self._on_abort(event, now)
            case TimePassed():
                self._on_time(event, now)
            case _:
                raise TypeError(f"not an input of D's session: {event!r}")

    def _on_loads(self, ev: LoadsRequested, now: float) -> None:
        seen: set[str] = set()
        for req in ev.requests:  # refuse the whole batch before taking any of it
            if req.d_req_id in self._loads or req.d_req_id in seen:
                raise LocalProtocolError(
                    f"request {req.d_req_id} is already loading", section=sections.BEHAVIOUR
                )
            seen.add(req.d_req_id)
        by_engine: dict[str, list[LoadRequest]] = defaultdict(list)
        for req in ev.requests:
            if any(req.blocks):
                queued = RequestQueued(
                    req.d_req_id, req.transfer_id, req.engine_id, req.bootstrap_addr
                )
                self._lease(queued, now)
            else:  # a release-only pull settles P's side: nothing left to renew
                self._leases.pop(req.d_req_id, None)
            load = self._loads[req.d_req_id] = _Load(req)
            if self.config.profile == PDWIRE_2:
                budget = req.deadline_ms / 1000 if req.deadline_ms > 0 else self.config.deadline
                load.deadline = now + budget
                self._push(load.deadline, "deadline", req.d_req_id)
            by_engine[req.engine_id].append(req)
        for engine_id, reqs in by_engine.items():
            if engine_id in self._engines:
                self._start_pulls(engine_id, reqs, now)
                continue
            for req in reqs:
                self._move(self._loads[req.d_req_id], LE.ENGINE_UNKNOWN)
            if engine_id not in self._waiting:
                self._out.append(QueryBootstrap(engine_id, reqs[0].bootstrap_addr))
            self._waiting[engine_id].extend(reqs)

    def _on_engine(self, ev: EngineResolved, now: float) -> None:
        reqs = self._waiting.pop(ev.engine_id, [])
        addr = reqs[0].bootstrap_addr if reqs else ""
        problem = ev.error or self._entry_problem(ev.engine_id, ev.entry, addr)
        if problem or ev.entry is None:
            self._renewal_owed.discard(ev.engine_id)
            for req in reqs:
                load = self._loads.get(req.d_req_id)
                if load is not None:
                    self._finish(load, (ErrorCode.INTERNAL, problem or "no entry"))
            return
        self._engines[ev.engine_id] = ev.entry
        if ev.engine_id in self._renewal_owed:
            self._renewal_owed.discard(ev.engine_id)
            self._renew(ev.engine_id, now)
        live = [r for r in reqs if r.d_req_id in self._loads]
        if live:
            self._start_pulls(ev.engine_id, live, now)

    def _entry_problem(self, engine_id: str, entry: EngineEntry | None, addr: str) -> str:
        if entry is None or entry.engine_id != engine_id:
            return f"remote engine_id {engine_id} not found from bootstrap server {addr}"
        tp = entry.tp_size or len(entry.worker_addr)
        pp = entry.pp_size or len(next(iter(entry.worker_addr.values()), {}))
        # 4.2-R6, 4.2-R8: every TP rank below tp, each with every PP rank below pp.
        complete = set(entry.worker_addr) >= set(range(tp)) and all(
            set(entry.worker_addr.get(t, {})) >= set(range(pp)) for t in range(tp)
        )
        if not complete:
            ranks = {t: sorted(by_pp) for t, by_pp in sorted(entry.worker_addr.items())}
            return (
                f"remote engine_id {engine_id} is incomplete: TP ranks and their PP ranks "
                f"{ranks} for TP {tp} x PP {pp}"
            )
        try:
            target_ranks(self.config.side.tp_size, self.config.side.tp_rank, tp)
        except ValueError as exc:
            return str(exc)
        return ""

    def _targets(self, entry: EngineEntry) -> list[str]:
        """The P workers this D worker pulls from (§10.1, §10.2)."""
        side = self.config.side
        tp = entry.tp_size or len(entry.worker_addr)
        addrs: list[str] = []
        for p_rank in target_ranks(side.tp_size, side.tp_rank, tp):
            by_pp = entry.worker_addr[p_rank]
            if side.pp_size == len(by_pp) and self.config.pp_rank in by_pp:
                addrs.append(by_pp[self.config.pp_rank])
            else:
                addrs.extend(by_pp[pp] for pp in sorted(by_pp))
        return addrs

    def _start_pulls(self, engine_id: str, reqs: list[LoadRequest], now: float) -> None:
        entry = self._engines[engine_id]
        addrs = self._targets(entry)
        for req in reqs:
            load = self._loads[req.d_req_id]
            self._move(load, LE.ENGINE_KNOWN)
            load.outstanding = len(addrs)
        for addr in addrs:
            batch = {r.d_req_id: r.transfer_id for r in reqs}
            self._send_pull(addr, engine_id, batch, self._agreement(addr, engine_id), now)

    def _agreement(self, addr: str, engine_id: str) -> Agreement:
        """What D knows of the P worker at ``addr``: its replies, else its /query entry."""
        peer = self._peers.get(addr)
        entry = self._engines.get(engine_id)
        if peer is None and entry is not None:
            peer = (
                Offer(entry.pdwire_version, frozenset(entry.pdwire_caps or ()))
                if entry.pdwire_version
                else LEGACY_PEER
            )
        if self.config.auth_key is not None:
            # Neither an entry nor a reply can talk a D with a key down to legacy (8.6-R14).
            caps = peer.caps if peer is not None else frozenset()
            peer = Offer(
                max(self._offer.version, peer.version if peer else 0),
                caps | {Capability.AUTH.value},
            )
        return negotiate("decode", self._offer, peer)

    # -- pulls -------------------------------------------------------------------------------

    def _layout_fields(self) -> dict[str, Any]:
        return layout_of(self.config.side.regions)

    def _pull_message(
        self, reqs: dict[str, str], with_layout: bool, agreement: Agreement, now: float
    ) -> XferMetadata:
        c = self.config
        layout = self._layout if with_layout else {k: [] for k in self._layout}
        base: dict[str, Any] = {
            "remote_hostname": c.hostname,
            "remote_port": c.port,
            "remote_tp_size": c.side.tp_size,
            "remote_tp_rank": c.side.tp_rank,
            "req_blocks": {d: (t, self._loads[d].req.blocks) for d, t in reqs.items()},
            **layout,
            "remote_pp_size": c.side.pp_size,
            "layout_id": c.layout_id,
        }
        if not agreement.announce:
            return XferMetadata(**base)
        deadlines = [self._loads[d].deadline for d in reqs]
        remaining = max(deadlines) - now if deadlines else float("inf")
        msg = XferMetadataV2(
            **base,
            pdwire_version=self._offer.version,
            pdwire_caps=sorted(self._offer.caps),
            fingerprint=c.fingerprint if with_layout else None,
            deadline_ms=0 if remaining == float("inf") else max(1, int(remaining * 1000)),
        )
        if c.auth_key is not None:
            msg = auth.sign(msg, c.auth_key)
        return msg

    def _send_pull(
        self, addr: str, engine_id: str, reqs: dict[str, str], agreement: Agreement, now: float
    ) -> None:
        with_layout = not self.config.layout_id or addr not in self._acked
        msg = self._pull_message(reqs, with_layout, agreement, now)
        pull = _Pull(
            pull_id=next(self._ids),
            addr=addr,
            engine_id=engine_id,
            reqs=dict(reqs),
            with_layout=with_layout,
            announced=agreement.announce,
            agreement=agreement,
            receive_until=now + self.config.receive_timeout,
            tag=getattr(msg, "auth_tag", None),
        )
        self._pulls[pull.pull_id] = pull
        self._push(pull.receive_until, "receive", (pull.pull_id, pull.receive_until))
        self._out.append(SendPull(pull.pull_id, addr, msg, encode_pull(msg, agreement)))

    def _on_reply(self, ev: ReplyReceived, now: float) -> None:
        pull = self._pulls.get(ev.pull_id)
        if pull is None:
            return  # a late frame on a pull we closed
        try:
            reply = decode_response(ev.data)
            if self.config.auth_key is not None and pull.agreement.allows(Capability.AUTH):
                auth.verify(reply, self.config.keys, answers=pull.tag)
        except (DecodeError, RemoteProtocolError) as exc:
            self._fail_pull(pull, ErrorCode.BAD_MESSAGE, f"transfer failed: {exc}")
            return
        self._learn_peer(pull, reply.pdwire_version, reply.pdwire_caps)
        pull.receive_until = now + self.config.receive_timeout
        self._push(pull.receive_until, "receive", (pull.pull_id, pull.receive_until))
        if pull.cancel:
            self._on_cancel_reply(pull, reply)
            return
        if pull.heartbeat:
            self._close(pull)
            if reply.status is Status.ERROR:
                self._out.append(LeaseRejected(pull.addr, reply.err_msg or "renewal refused"))
            return
        if reply.status is Status.LAYOUT_MISS:
            self._acked.discard(pull.addr)
            if pull.with_layout:
                self._fail_pull(pull, ErrorCode.LAYOUT_MISS, reply.err_msg or "transfer error")
            else:  # P lost our layout: resend the same pull with it (§3.7)
                self._resend_with_layout(pull, now)
            return
        if reply.status is Status.ERROR:
            code = _code(reply.err_code)
            self._fail_pull(pull, code, reply.err_msg or "transfer error")
            return
        if self.config.layout_id and reply.layout_id == self.config.layout_id:
            self._acked.add(pull.addr)
        codes = reply.err_codes or {}
        for d_req in reply.err_reqs or ():
            code = _code(codes.get(d_req, reply.err_code))
            self._settle(pull, d_req, (code, reply.err_msg or "unknown error"))
        for d_req in reply.ok_reqs or ():
            self._settle(pull, d_req, None)
        if reply.status is Status.FINISH:
            self._fail_pull(pull, ErrorCode.INTERNAL, UNREPORTED)

    def _resend_with_layout(self, pull: _Pull, now: float) -> None:
        """Only requests still waiting go again; one D gave up on is settled here, since a new
        pull would not be covered by the cancel already sent (10.10.5)."""
        again = {d: t for d, t in pull.reqs.items() if not self._loads[d].reported}
        for d_req in set(pull.reqs) - set(again):
            self._settle(pull, d_req, (ErrorCode.LAYOUT_MISS, "layout lost after the deadline"))
        self._close(pull)
        if again:
            agreement = self._agreement(pull.addr, pull.engine_id)
            self._send_pull(pull.addr, pull.engine_id, again, agreement, now)

    def _learn_peer(self, pull: _Pull, version: int, caps: list[str]) -> None:
        if version >= 2:
            self._peers[pull.addr] = Offer(version, frozenset(caps))
        elif pull.announced:  # we announced and P answered without a version: legacy
            self._peers[pull.addr] = LEGACY_PEER

    def _fail_pull(self, pull: _Pull, code: ErrorCode, reason: str) -> None:
        # A cancel that fails settles nothing: the pulls it withdrew are still open (§3.5).
        if not pull.cancel:
            for d_req in list(pull.reqs):
                self._settle(pull, d_req, (code, reason))
        self._close(pull)

    def _close(self, pull: _Pull) -> None:
        if self._pulls.pop(pull.pull_id, None) is not None:
            self._out.append(ClosePull(pull.pull_id))

    def _settle(self, pull: _Pull, d_req: str, failure: tuple[ErrorCode, str] | None) -> None:
        """Pull ``pull`` is done with ``d_req`` (§10.10): ok when ``failure`` is None."""
        if pull.reqs.pop(d_req, None) is None:
            return  # not ours, or already settled by this pull
        load = self._loads.get(d_req)
        if load is None:
            return
        if failure is not None and load.failure is None:
            load.failure = failure
        load.outstanding -= 1
        if load.outstanding > 0:
            self._move(load, LE.PULL_SETTLED)
            return
        self._finish(load, load.failure)

    def _finish(self, load: _Load, failure: tuple[ErrorCode, str] | None) -> None:
        """Every pull settled: report the request once and forget it."""
        d_req = load.req.d_req_id
        self._move(load, LE.ALL_SETTLED_FAILED if failure else LE.ALL_LOADED)
        del self._loads[d_req]
        self._leases.pop(d_req, None)
        if not any(load.req.blocks):
            return  # release-only: never reported (§10.10.9)
        if load.reported:
            self._out.append(BlocksReleased(d_req))
        elif failure is not None:
            self._out.append(RequestFailed(d_req, failure[0], failure[1]))
        elif load.state is L.LOADED:
            self._out.append(RequestLoaded(d_req))
        else:
            self._out.append(RequestFailed(d_req, ErrorCode.DEADLINE_EXCEEDED, "deadline"))

    # -- giving up: deadline, abort, cancel (pdwire/2) ----------------------------------------

    def _on_abort(self, ev: AbortRequested, now: float) -> None:
        self._leases.pop(ev.d_req_id, None)
        load = self._loads.get(ev.d_req_id)
        if load is None:
            return
        if load.state is L.RESOLVING:
            # Nothing sent yet: ask P only to release (an empty pull), as vLLM does.
            load.req = dataclasses.replace(load.req, blocks=[])
            return
        self._give_up([load], ErrorCode.CANCELLED, "aborted", now)

    def _give_up(self, loads: Iterable[_Load], code: ErrorCode, reason: str, now: float) -> None:
        """Fail ``loads`` now; withdraw their pulls where P accepts cancels (§3.5)."""
        by_addr: dict[str, dict[str, str]] = defaultdict(dict)
        agreements: dict[str, Agreement] = {}
        for load in loads:
            if load.reported:
                continue
            load.reported = True
            load.failure = load.failure or (code, reason)
            self._leases.pop(load.req.d_req_id, None)  # D wants the KV no more
            if load.state is L.PULLING:
                self._move(load, LE.DEADLINE)
            if any(load.req.blocks):
                self._out.append(RequestFailed(load.req.d_req_id, code, reason, blocks_free=False))
            for pull in self._pulls.values():
                if pull.cancel or load.req.d_req_id not in pull.reqs:
                    continue
                agreement = (
                    negotiate("decode", self._offer, self._peers[pull.addr])
                    if pull.addr in self._peers
                    else pull.agreement
                )
                if agreement.allows(Capability.CANCEL):  # never to a P shown to be legacy
                    by_addr[pull.addr][load.req.d_req_id] = load.req.transfer_id
                    agreements[pull.addr] = agreement
        for addr, reqs in by_addr.items():
            self._send_cancel(addr, reqs, agreements[addr], reason, now)

    def _send_cancel(
        self, addr: str, reqs: dict[str, str], agreement: Agreement, reason: str, now: float
    ) -> None:
        c = self.config
        msg = XferCancel(
            pdwire_version=self._offer.version,
            remote_hostname=c.hostname,
            remote_port=c.port,
            remote_tp_size=c.side.tp_size,
            remote_tp_rank=c.side.tp_rank,
            cancel_reqs=reqs,
            remote_pp_size=c.side.pp_size,
            remote_pp_rank=c.pp_rank,
            reason=reason,
        )
        if c.auth_key is not None:
            msg = auth.sign(msg, c.auth_key)
        pull = _Pull(
            pull_id=next(self._ids),
            addr=addr,
            engine_id="",
            reqs=dict(reqs),
            with_layout=False,
            announced=True,
            agreement=agreement,
            receive_until=now + c.receive_timeout,
            cancel=True,
            tag=msg.auth_tag,
        )
        self._pulls[pull.pull_id] = pull
        self._push(pull.receive_until, "receive", (pull.pull_id, pull.receive_until))
        self._out.append(SendPull(pull.pull_id, addr, msg, encode_cancel(msg, agreement)))

    def _on_cancel_reply(self, cancel: _Pull, reply: XferResponseV2) -> None:
        """Only a FINISH says which requests P stopped serving for us: their withdrawn pulls
        are settled. Any other answer settles nothing (3.5-R17): a P that could not decode the
        cancel answers ERROR while the withdrawn pull may still be writing."""
        cancelled = (reply.ok_reqs or []) if reply.status is Status.FINISH else []
        for d_req in cancelled:
            for pull in list(self._pulls.values()):
                if not pull.cancel and pull.addr == cancel.addr and d_req in pull.reqs:
                    self._settle(pull, d_req, (ErrorCode.CANCELLED, "cancelled"))
                    if not pull.reqs:
                        self._close(pull)
        self._close(cancel)

    # -- timers ------------------------------------------------------------------------------

    def _timer_live(self, entry: Timer) -> bool:
        when, _, kind, what = entry
        if kind == "heartbeat":
            return self._heartbeat_at == when
        if kind == "deadline":
            load = self._loads.get(what)
            return load is not None and not load.reported
        pull = self._pulls.get(what[0])
        return pull is not None and pull.receive_until == what[1]

    def _fire(self, entry: Timer, now: float) -> None:
        if entry[2] == "heartbeat":
            self._on_heartbeat_due(now)
        elif entry[2] == "deadline":
            load = self._loads[entry[3]]
            if load.state is L.RESOLVING:
                self._drop_waiting(load)
                self._finish(load, (ErrorCode.DEADLINE_EXCEEDED, "deadline"))
            else:
                self._due.append(load)  # given up together: one cancel per P worker
        else:
            pull = self._pulls[entry[3][0]]
            self._forget_engine_of(pull)
            self._fail_pull(pull, ErrorCode.DEADLINE_EXCEEDED, "transfer failed: timeout")

    def _after_timers(self, now: float) -> None:
        # A load whose pulls all failed in this same handle is already reported and forgotten.
        due = [d for d in self._due if self._loads.get(d.req.d_req_id) is d]
        self._due = []
        if not due:
            return
        names = {d.req.d_req_id for d in due}
        unanswered = [p for p in self._pulls.values() if names & p.reqs.keys()]
        self._give_up(due, ErrorCode.DEADLINE_EXCEEDED, "deadline", now)
        for pull in unanswered:  # after the cancels, which use what D learned of P
            self._forget_engine_of(pull)

    def _forget_engine_of(self, pull: _Pull) -> None:
        """P did not answer in time: it may have restarted on new ports, so the next request for
        its engine queries the bootstrap again (4.2-R12). Legacy D's cache for good, as vLLM."""
        if self.config.profile == PDWIRE_2 and not (pull.cancel or pull.heartbeat):
            self._engines.pop(pull.engine_id, None)
            self._peers.pop(pull.addr, None)
            self._acked.discard(pull.addr)

    # -- lease renewal (vLLM 0.34, §6.4) -------------------------------------------------------

    @property
    def _renewal_period(self) -> float:
        """How often D renews, and how long it waits for a heartbeat's reply (3.9-R1)."""
        assert self.config.lease is not None
        return self.config.lease / 6

    def _on_queued(self, ev: RequestQueued, now: float) -> None:
        self._lease(ev, now)

    def _lease(self, req: RequestQueued, now: float) -> None:
        """Renew ``req``'s lease from now on, unless D renews it already."""
        if self.config.lease is None:
            return
        self._leases.setdefault(req.d_req_id, req)
        if self._heartbeat_at is None:
            self._heartbeat_at = max(now, self._last_heartbeat + self._renewal_period)
            self._push(self._heartbeat_at, "heartbeat", None)

    def _on_heartbeat_due(self, now: float) -> None:
        """One renewal per P engine, naming every transfer D still waits for from it, to each
        P worker D pulls from; an engine not known yet is queried first."""
        self._heartbeat_at = None
        if not self._leases:
            return
        self._last_heartbeat = now
        for engine_id, first in {r.engine_id: r for r in self._leases.values()}.items():
            if engine_id in self._engines:
                self._renew(engine_id, now)
                continue
            self._renewal_owed.add(engine_id)
            if engine_id not in self._waiting:
                self._out.append(QueryBootstrap(engine_id, first.bootstrap_addr))
                self._waiting[engine_id] = []
        self._heartbeat_at = now + self._renewal_period
        self._push(self._heartbeat_at, "heartbeat", None)

    def _renew(self, engine_id: str, now: float) -> None:
        ids = [r.transfer_id for r in self._leases.values() if r.engine_id == engine_id]
        if not ids:
            return
        msg = LeaseHeartbeat(lease_transfer_ids=ids)
        data = encode_heartbeat(msg)
        for addr in self._targets(self._engines[engine_id]):
            pull = _Pull(
                pull_id=next(self._ids),
                addr=addr,
                engine_id=engine_id,
                reqs={},
                with_layout=False,
                announced=False,
                agreement=negotiate("decode", self._offer, LEGACY_PEER),
                receive_until=now + self._renewal_period,
                heartbeat=True,
            )
            self._pulls[pull.pull_id] = pull
            self._push(pull.receive_until, "receive", (pull.pull_id, pull.receive_until))
            self._out.append(SendPull(pull.pull_id, addr, msg, data))

    def _drop_waiting(self, load: _Load) -> None:
        # By id: an abort while resolving replaced ``load.req`` with a release-only copy.
        waiting = self._waiting.get(load.req.engine_id, [])
        waiting[:] = [r for r in waiting if r.d_req_id != load.req.d_req_id]


def _code(value: str | None) -> ErrorCode:
    """A received error code; unknown or absent codes read as INTERNAL (§7.2)."""
    try:
        return ErrorCode(value) if value else ErrorCode.INTERNAL
    except ValueError:
        return ErrorCode.INTERNAL
