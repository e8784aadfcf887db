"""Mutants of vLLM 0.34's KV lease (§3.9, §6.4), on both sides (caught by the lease cases)."""

from __future__ import annotations

from typing import Any

from pdwire.consumer import ConsumerSession
from pdwire.events import LeaseRejected, LoadsRequested, RequestFailed
from pdwire.messages import ErrorCode
from pdwire.messages import XferResponseStatus as Status
from pdwire.messages import XferResponseV2 as Reply
from pdwire.producer import ProducerSession
from pdwire.transitions import TransferEvent, TransferState

from . import mutant, replace

# -- P ------------------------------------------------------------------------------------------


@mutant(
    "renewal-ignored",
    "prefill",
    "answers a lease renewal FINISH but moves no lease",
    cases=("producer/6.4/1",),
)
def _renewal_ignored() -> None:
    def on_heartbeat(self: ProducerSession, ev: Any, heartbeat: Any, now: float) -> None:
        self._reply(ev.identity, None, Reply(Status.FINISH))

    replace(ProducerSession, "_on_heartbeat", on_heartbeat)


@mutant(
    "lease-as-abort-timeout",
    "prefill",
    "holds a finished transfer for VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, not for its lease",
    cases=("producer/6.4/2",),
)
def _lease_as_abort_timeout() -> None:
    original = ProducerSession._on_finished

    def on_finished(self: ProducerSession, ev: Any, now: float) -> None:
        original(self, ev, now)
        t = self._transfers.get(ev.transfer_id)
        if t is not None and t.state is TransferState.READY:
            t.expire_at = now + self.config.abort_timeout
            self._push(t.expire_at, "transfer", t.transfer_id)

    replace(ProducerSession, "_on_finished", on_finished)


@mutant(
    "forgets-expired",
    "prefill",
    "forgets an expired transfer at once: a later pull waits out its ready wait",
    cases=("producer/6.4/2",),
)
def _forgets_expired() -> None:
    original = ProducerSession._expire

    def expire(self: ProducerSession, t: Any, now: float) -> None:
        original(self, t, now)
        if t.state is TransferState.EXPIRED and not t.waiting:
            del self._transfers[t.transfer_id]

    replace(ProducerSession, "_expire", expire)


@mutant(
    "renewal-creates-transfer",
    "prefill",
    "makes a placeholder for each renewed transfer it does not hold, over its tombstone",
    cases=("producer/6.4/3",),
)
def _renewal_creates_transfer() -> None:
    original = ProducerSession._on_heartbeat

    def on_heartbeat(self: ProducerSession, ev: Any, heartbeat: Any, now: float) -> None:
        for transfer_id in heartbeat.lease_transfer_ids:
            t = self._transfers.get(transfer_id)
            if t is None or t.state is not TransferState.READY:
                self._transfers.pop(transfer_id, None)
                placeholder = self._transfer(transfer_id)
                self._remember(placeholder)
                self._move(placeholder, TransferEvent.PULL_NAMED)
        original(self, ev, heartbeat, now)

    replace(ProducerSession, "_on_heartbeat", on_heartbeat)


@mutant(
    "renewal-without-lease",
    "prefill",
    "a P without a lease answers renewals FINISH",
    cases=("producer/6.4/4",),
)
def _renewal_without_lease() -> None:
    original = ProducerSession._on_heartbeat

    def on_heartbeat(self: ProducerSession, ev: Any, heartbeat: Any, now: float) -> None:
        if self.config.lease is None:
            self._reply(ev.identity, None, Reply(Status.FINISH))
            return
        original(self, ev, heartbeat, now)

    replace(ProducerSession, "_on_heartbeat", on_heartbeat)


@mutant(
    "heartbeat-unanswered",
    "prefill",
    "renews a lease but sends no reply",
    cases=("producer/3.9/1",),
)
def _heartbeat_unanswered() -> None:
    original = ProducerSession._on_heartbeat

    def on_heartbeat(self: ProducerSession, ev: Any, heartbeat: Any, now: float) -> None:
        original(self, ev, heartbeat, now)
        self._out.pop()

    replace(ProducerSession, "_on_heartbeat", on_heartbeat)


@mutant(
    "empty-heartbeat-accepted",
    "prefill",
    "answers a heartbeat that names no transfer FINISH, not as the decode error it is",
    cases=("producer/3.9/2",),
)
def _empty_heartbeat_accepted() -> None:
    original = ProducerSession._on_message

    def on_message(self: ProducerSession, ev: Any, now: float) -> None:
        if ev.data == b"\x81\xb2lease_transfer_ids\x90":
            self._reply(ev.identity, None, Reply(Status.FINISH))
            return
        original(self, ev, now)

    replace(ProducerSession, "_on_message", on_message)


# -- D ------------------------------------------------------------------------------------------


@mutant(
    "d-renews-at-load-only",
    "decode",
    "renews a lease only once the request is loading",
    cases=("consumer/6.4/2",),
)
def _d_renews_at_load_only() -> None:
    def on_queued(self: ConsumerSession, ev: Any, now: float) -> None:
        pass

    replace(ConsumerSession, "_on_queued", on_queued)


@mutant(
    "d-renews-after-settle",
    "decode",
    "goes on renewing a request that loaded",
    cases=("consumer/6.4/1",),
)
def _d_renews_after_settle() -> None:
    original = ConsumerSession._finish

    def finish(self: ConsumerSession, load: Any, failure: Any) -> None:
        kept = self._leases.get(load.req.d_req_id)
        original(self, load, failure)
        if kept is not None:
            self._leases[load.req.d_req_id] = kept

    replace(ConsumerSession, "_finish", finish)


@mutant(
    "d-renews-every-lease",
    "decode",
    "renews once every lease, not every sixth of it",
    cases=("consumer/6.4/1",),
)
def _d_renews_every_lease() -> None:
    def period(self: ConsumerSession) -> float:
        assert self.config.lease is not None
        return self.config.lease

    replace(ConsumerSession, "_renewal_period", property(period))


@mutant(
    "d-renews-after-release",
    "decode",
    "goes on renewing a request it sent a release-only pull for",
    cases=("consumer/6.4/2",),
)
def _d_renews_after_release() -> None:
    original = ConsumerSession._on_loads

    def on_loads(self: ConsumerSession, ev: LoadsRequested, now: float) -> None:
        leases = self._leases
        kept = {r.d_req_id: leases[r.d_req_id] for r in ev.requests if r.d_req_id in leases}
        original(self, ev, now)
        leases.update(kept)

    replace(ConsumerSession, "_on_loads", on_loads)


@mutant(
    "d-renews-one-worker",
    "decode",
    "sends each renewal to the first P worker only",
    cases=("consumer/6.4/1",),
)
def _d_renews_one_worker() -> None:
    original = ConsumerSession._renew

    def renew(self: ConsumerSession, engine_id: str, now: float) -> None:
        before = len(self._out)
        original(self, engine_id, now)
        for dropped in self._out[before + 1 :]:
            self._pulls.pop(getattr(dropped, "pull_id", 0), None)
        del self._out[before + 1 :]

    replace(ConsumerSession, "_renew", renew)


@mutant(
    "d-fails-on-refused-renewal",
    "decode",
    "fails every request of an engine whose P refused a renewal",
    cases=("consumer/3.9/1",),
)
def _d_fails_on_refused_renewal() -> None:
    original = ConsumerSession._on_reply

    def on_reply(self: ConsumerSession, ev: Any, now: float) -> None:
        original(self, ev, now)
        if any(isinstance(o, LeaseRejected) for o in self._out):
            for load in list(self._loads.values()):
                if not load.reported:
                    load.reported = True
                    self._out.append(
                        RequestFailed(load.req.d_req_id, ErrorCode.INTERNAL, "lease refused")
                    )

    replace(ConsumerSession, "_on_reply", on_reply)
