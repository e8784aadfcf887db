"""Mutants of P's pdwire/2 behaviour (§3.5, §3.6, §8, §10.11), each a patch of the producer
session."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from pdwire import producer as producer_module
from pdwire.codec import encode_response
from pdwire.events import (
    FreeBlocks,
    FreeReason,
    MessageReceived,
    SendReply,
    StartWrite,
    TransferFinished,
    TransferStarted,
    TransferWillNotSend,
    WriteCompleted,
)
from pdwire.messages import (
    KV_LAYOUT_NAMES,
    ErrorCode,
    Fingerprint,
    XferCancel,
    XferMetadataV2,
    XferResponseV2,
)
from pdwire.messages import XferResponseStatus as Status
from pdwire.negotiation import LEGACY_PEER, Offer, negotiate
from pdwire.planning import PlanError, descriptors
from pdwire.producer import ProducerConfig, ProducerSession
from pdwire.transitions import TERMINAL
from pdwire.versions import ALL_CAPS, CURRENT_VERSION, Capability
from reference_connector.worker_spec import WorkerSpec

from . import mutant, replace

# -- negotiation (§8) -----------------------------------------------------------------------


@mutant(
    "no-code-filter",
    "prefill",
    "sends every error code, whether its capability is agreed",
    cases=(
        "producer/7.2/1",
        "producer/7.2/2",
    ),
)
def _no_code_filter() -> None:
    replace(producer_module, "_drop_unagreed_codes", lambda reply, agreement: None)


@mutant(
    "remembers-peer-version",
    "prefill",
    "answers a D worker as it announced in an earlier pull",
    cases=("producer/8.2/1",),
)
def _remembers_peer_version() -> None:
    original = ProducerSession._on_pull
    announced: set[tuple[str, int, int]] = set()

    def on_pull(self: ProducerSession, identity: bytes, msg: XferMetadataV2, now: float) -> None:
        peer = (msg.remote_hostname, msg.remote_port, msg.remote_tp_rank)
        if msg.pdwire_version >= 2:
            announced.add(peer)
        elif peer in announced:
            msg.pdwire_version, msg.pdwire_caps = CURRENT_VERSION, sorted(ALL_CAPS)
        original(self, identity, msg, now)

    replace(ProducerSession, "_on_pull", on_pull)


@mutant(
    "newer-version-legacy",
    "prefill",
    "answers a D announcing a version above its own as legacy",
    cases=("producer/8.1/1",),
)
def _newer_version_legacy() -> None:
    original = ProducerSession._agreement

    def agreement(self: ProducerSession, version: int, caps: list[str]) -> Any:
        if version > CURRENT_VERSION:
            return negotiate("prefill", self._offer, LEGACY_PEER)
        return original(self, version, caps)

    replace(ProducerSession, "_agreement", agreement)


@mutant(
    "rejects-unknown-caps",
    "prefill",
    "answers ERROR to a pull announcing a capability it lacks",
    cases=("producer/8.2/2",),
)
def _rejects_unknown_caps() -> None:
    original = ProducerSession._check_pull

    def check(self: ProducerSession, msg: XferMetadataV2, agreement: Any) -> Any:
        unknown = sorted(set(msg.pdwire_caps) - ALL_CAPS)
        if unknown:
            return ErrorCode.BAD_MESSAGE, f"unknown capabilities {unknown}", Status.ERROR
        return original(self, msg, agreement)

    replace(ProducerSession, "_check_pull", check)


@mutant(
    "upper-case-caps",
    "prefill",
    "announces its capabilities in upper case",
    at_start=True,
    cases=("producer/8.5/1",),
)
def _upper_case_caps() -> None:
    original = ProducerSession.__init__

    def init(self: ProducerSession, config: ProducerConfig) -> None:
        original(self, config)
        self._offer = Offer(self._offer.version, frozenset(c.upper() for c in self._offer.caps))

    replace(ProducerSession, "__init__", init)


# -- fingerprint (§3.6) -----------------------------------------------------------------------


@mutant(
    "no-fingerprint-check",
    "prefill",
    "never compares a pull's fingerprint with its own",
    cases=("producer/3.6/1",),
)
def _no_fingerprint_check() -> None:
    original = ProducerSession._check_pull

    def check(self: ProducerSession, msg: XferMetadataV2, agreement: Any) -> Any:
        return original(self, msgspec.structs.replace(msg, fingerprint=None), agreement)

    replace(ProducerSession, "_check_pull", check)


@mutant(
    "requires-fingerprint",
    "prefill",
    "answers ERROR to a pdwire/2 pull without a fingerprint",
    cases=("producer/3.6/2",),
)
def _requires_fingerprint() -> None:
    original = ProducerSession._check_pull

    def check(self: ProducerSession, msg: XferMetadataV2, agreement: Any) -> Any:
        if agreement.allows(Capability.FINGERPRINT) and msg.fingerprint is None:
            return ErrorCode.FINGERPRINT_MISMATCH, "no fingerprint", Status.ERROR
        return original(self, msg, agreement)

    replace(ProducerSession, "_check_pull", check)


@mutant(
    "misnames-layout",
    "prefill",
    "names another registered layout than its own in its fingerprint (3.6-R11)",
    at_start=True,
    cases=("producer/3.6/4",),
)
def _misnames_layout() -> None:
    original = WorkerSpec.fingerprint

    def fingerprint(self: WorkerSpec) -> Fingerprint | None:
        fp = original(self)
        if fp is None:
            return None
        apart, together = KV_LAYOUT_NAMES["apart"], KV_LAYOUT_NAMES["together"]
        other = together if fp.kv_layout == apart else apart
        return dataclasses.replace(fp, kv_layout=other)

    replace(WorkerSpec, "fingerprint", fingerprint)


@mutant(
    "no-pp-size-check",
    "prefill",
    "never checks for a missing remote_pp_size (10.11.11)",
    cases=("producer/10.11/6",),
)
def _no_pp_size_check() -> None:
    replace(ProducerSession, "_check_pp_size", lambda self, msg: None)


# -- transfers P will not send, duplicates (§10.11) -------------------------------------------


@mutant(
    "stall-on-stop",
    "prefill",
    "frees a stop-token request's blocks but wakes no pull for it",
    cases=(
        "producer/7.2/3",
        "producer/10.11/3",
    ),
)
def _stall_on_stop() -> None:
    def will_not_send(self: ProducerSession, ev: TransferWillNotSend, now: float) -> None:
        self._out.append(FreeBlocks(ev.p_req_id, ev.transfer_id, FreeReason.WILL_NOT_SEND))

    replace(ProducerSession, "_on_will_not_send", will_not_send)


@mutant(
    "duplicate-overwrites",
    "prefill",
    "lets a request overwrite another's transfer_id state",
    cases=("producer/10.11/5",),
)
def _duplicate_overwrites() -> None:
    original = ProducerSession._on_started

    def started(self: ProducerSession, ev: TransferStarted, now: float) -> None:
        t = self._transfers.get(ev.transfer_id)
        if t is not None and t.p_req_id and t.p_req_id != ev.p_req_id:
            del self._transfers[ev.transfer_id]
        original(self, ev, now)

    replace(ProducerSession, "_on_started", started)


@mutant(
    "unbound-transfer-ids",
    "prefill",
    "serves any d_req_id that names a transfer_id",
    cases=("producer/10.11/4",),
)
def _unbound_transfer_ids() -> None:
    original = ProducerSession._on_pull

    def on_pull(self: ProducerSession, identity: bytes, msg: XferMetadataV2, now: float) -> None:
        for transfer_id, _ in msg.req_blocks.values():
            t = self._transfers.get(transfer_id)
            if t is not None:
                t.bound_d_req = None
        original(self, identity, msg, now)

    replace(ProducerSession, "_on_pull", on_pull)


@mutant(
    "will-not-send-is-bound",
    "prefill",
    "answers Duplicate transfer_id to another d_req_id naming a transfer P will not send",
    cases=("producer/10.11/3",),
)
def _will_not_send_is_bound() -> None:
    def binds(self: ProducerSession, t: Any, d_req: str) -> bool:
        if t.bound_d_req is None:
            t.bound_d_req = d_req
        return bool(t.bound_d_req == d_req)

    replace(ProducerSession, "_binds", binds)


@mutant(
    "reused-id-stalls",
    "prefill",
    "loses a request whose transfer_id was used and served",
    cases=("producer/10.4/3",),
)
def _reused_id_stalls() -> None:
    started, finished = ProducerSession._on_started, ProducerSession._on_finished
    reused: set[str] = set()

    def on_started(self: ProducerSession, ev: TransferStarted, now: float) -> None:
        t = self._transfers.get(ev.transfer_id)
        if t is not None and t.state in TERMINAL:
            reused.add(ev.transfer_id)
        started(self, ev, now)

    def on_finished(self: ProducerSession, ev: TransferFinished, now: float) -> None:
        if ev.transfer_id in reused:
            raise KeyError(ev.transfer_id)  # vLLM 0.33's record_send_reqs (risk 3)
        finished(self, ev, now)

    replace(ProducerSession, "_on_started", on_started)
    replace(ProducerSession, "_on_finished", on_finished)


# -- cancel (§3.5) ----------------------------------------------------------------------------


@mutant(
    "cancel-ignored",
    "prefill",
    "answers a cancel with an empty FINISH and does nothing",
    cases=("producer/3.5/1",),
)
def _cancel_ignored() -> None:
    def on_cancel(
        self: ProducerSession, ev: MessageReceived, cancel: XferCancel, now: float
    ) -> None:
        agreement = self._agreement(cancel.pdwire_version, [])
        self._reply(ev.identity, agreement, XferResponseV2(Status.FINISH))

    replace(ProducerSession, "_on_cancel", on_cancel)


@mutant(
    "cancel-reply-in-flight",
    "prefill",
    "answers a cancel at once, while a write to that D worker for a listed request is in flight",
    cases=("producer/3.5/4",),
)
def _cancel_reply_in_flight() -> None:
    original = ProducerSession._on_cancel

    def cancel(self: ProducerSession, ev: MessageReceived, msg: XferCancel, now: float) -> None:
        peer = (msg.remote_hostname, msg.remote_port, msg.remote_tp_rank)
        if any(
            p.peer == peer and p.round is not None and set(p.round.reqs) & set(msg.cancel_reqs)
            for p in self._pulls.values()
        ):
            agreement = self._agreement(msg.pdwire_version, [])
            self._reply(ev.identity, agreement, XferResponseV2(Status.FINISH))
            return
        original(self, ev, msg, now)

    replace(ProducerSession, "_on_cancel", cancel)


@mutant(
    "writes-after-cancel",
    "prefill",
    "ends a cancelled pull as it must, yet writes the withdrawn request's blocks once its "
    "transfer is ready",
    cases=("producer/3.5/3",),
)
def _writes_after_cancel() -> None:
    on_cancel = ProducerSession._on_cancel
    on_finished = ProducerSession._on_finished
    on_write_completed = ProducerSession._on_write_completed
    withdrawn: dict[str, list[tuple[Any, str]]] = {}  # transfer_id -> [(pull, d_req_id)]
    stray: set[int] = set()  # the ids of those writes, whose completions no pull awaits

    def cancel(self: ProducerSession, ev: MessageReceived, msg: XferCancel, now: float) -> None:
        for pull in self._pulls.values():
            for d_req, transfer_id in msg.cancel_reqs.items():
                if pull.pending.get(d_req) == transfer_id:
                    withdrawn.setdefault(transfer_id, []).append((pull, d_req))
        on_cancel(self, ev, msg, now)

    def finished(self: ProducerSession, ev: TransferFinished, now: float) -> None:
        on_finished(self, ev, now)
        for pull, d_req in withdrawn.pop(ev.transfer_id, []):
            planned = descriptors(pull.plan, ev.blocks, pull.msg.req_blocks[d_req][1])
            if isinstance(planned, PlanError):
                continue
            write_id = next(self._ids)
            stray.add(write_id)
            peer = f"{pull.msg.remote_hostname}:{pull.msg.remote_port}"
            self._out.append(StartWrite(write_id, peer, planned, (d_req,)))

    def write_completed(self: ProducerSession, ev: WriteCompleted, now: float) -> None:
        if ev.write_id in stray:
            stray.discard(ev.write_id)
            return
        on_write_completed(self, ev, now)

    replace(ProducerSession, "_on_cancel", cancel)
    replace(ProducerSession, "_on_finished", finished)
    replace(ProducerSession, "_on_write_completed", write_completed)


@mutant(
    "cancel-not-counted",
    "prefill",
    "does not count a cancelled pull as settled",
    cases=("producer/3.5/2",),
)
def _cancel_not_counted() -> None:
    original = ProducerSession._settle

    def settle(
        self: ProducerSession, t: Any, peer: Any, reason: FreeReason = FreeReason.SERVED
    ) -> None:
        if reason is not FreeReason.CANCELLED:
            original(self, t, peer, reason)

    replace(ProducerSession, "_settle", settle)


@mutant(
    "cancel-lists-all",
    "prefill",
    "lists every d_req_id of a cancel as cancelled",
    cases=("producer/3.5/1",),
)
def _cancel_lists_all() -> None:
    original = ProducerSession._on_cancel

    def on_cancel(
        self: ProducerSession, ev: MessageReceived, cancel: XferCancel, now: float
    ) -> None:
        n = len(self._out)
        original(self, ev, cancel, now)
        for i in range(n, len(self._out)):
            out = self._out[i]
            if isinstance(out, SendReply) and out.identity == ev.identity:
                out.reply.ok_reqs = sorted(cancel.cancel_reqs)
                agreement = self._agreement(cancel.pdwire_version, [])
                self._out[i] = SendReply(
                    ev.identity, out.reply, encode_response(out.reply, agreement)
                )

    replace(ProducerSession, "_on_cancel", on_cancel)


# -- deadline (§6.2) --------------------------------------------------------------------------


@mutant(
    "ignores-deadline",
    "prefill",
    "never stops waiting at a pull's deadline_ms",
    cases=("producer/6.3/1",),
)
def _ignores_deadline() -> None:
    original = ProducerSession._open_pull

    def open_pull(self: ProducerSession, identity: bytes, msg: XferMetadataV2, *args: Any) -> Any:
        return original(self, identity, msgspec.structs.replace(msg, deadline_ms=0), *args)

    replace(ProducerSession, "_open_pull", open_pull)
