"""Mutants of the D side (caught by consumer and pair cases). Each patch replaces one piece of
pdwire's consumer session, the D agent or the decode node, in the process that applies it (the
node's front and each worker). The node's own modules are imported inside the patches: they
load torch, which listing the mutants does not need."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from typing import Any

import httpx
import msgspec
import zmq

from pdwire import codec, negotiation, planning
from pdwire import consumer as consumer_module
from pdwire.codec import decode_response, encode_response
from pdwire.consumer import UNREPORTED, ConsumerSession
from pdwire.errors import DecodeError
from pdwire.events import LoadRequest, LoadsRequested, ReplyReceived, RequestFailed
from pdwire.messages import ErrorCode, XferCancel, XferMetadataV2, XferResponseV2
from pdwire.messages import XferResponseStatus as Status
from pdwire.negotiation import LEGACY_PEER, Agreement, Offer
from pdwire.roles import Role
from pdwire.transitions import LoadState
from pdwire.versions import CURRENT_VERSION, PDWIRE_2, Capability
from reference_connector import bootstrap_client
from reference_connector.consumer_agent import ConsumerAgent

from . import configure, mutant, replace
from .producer_planning import keep_every_block

logger = logging.getLogger(__name__)
DECODE_KEYS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")


def _rewrite_replies(rewrite: Any) -> None:
    """Make D read each decodable reply as ``rewrite(session, pull, reply)`` gives it (None:
    as it came); ``pull`` is the open pull the reply is for."""
    original = ConsumerSession._on_reply

    def on_reply(self: ConsumerSession, ev: ReplyReceived, now: float) -> None:
        pull = self._pulls.get(ev.pull_id)
        try:
            reply: XferResponseV2 | None = decode_response(ev.data)
        except DecodeError:
            reply = None
        if pull is not None and not pull.cancel:
            changed = rewrite(self, pull, reply)
            if changed is not None:
                ev = ReplyReceived(ev.pull_id, encode_response(changed, PDWIRE_2))
        original(self, ev, now)

    replace(ConsumerSession, "_on_reply", on_reply)


# -- the pull ---------------------------------------------------------------------------------


@mutant(
    "omits-remote-pp-size",
    "decode",
    "runs PP 2 but leaves remote_pp_size out of its pulls",
    cases=("consumer/3.2/2",),
    at_start=True,
)
def _omits_remote_pp_size() -> None:
    configure(pp_size=2)
    original = ConsumerSession._pull_message

    def pull_message(self: ConsumerSession, *args: Any, **kwargs: Any) -> Any:
        return msgspec.structs.replace(original(self, *args, **kwargs), remote_pp_size=1)

    replace(ConsumerSession, "_pull_message", pull_message)


@mutant(
    "short-block-list",
    "decode",
    "asks P for one block fewer than the prompt fills",
    cases=("consumer/3.2/1",),
)
def _short_block_list() -> None:
    original = ConsumerSession._on_loads

    def on_loads(self: ConsumerSession, ev: LoadsRequested, now: float) -> None:
        def short(r: LoadRequest) -> LoadRequest:
            return dataclasses.replace(r, blocks=[g[:-1] if len(g) > 1 else g for g in r.blocks])

        original(self, LoadsRequested(tuple(short(r) for r in ev.requests)), now)

    replace(ConsumerSession, "_on_loads", on_loads)


@mutant(
    "omits-layout-unechoed",
    "decode",
    "omits its layout before P echoed its layout_id",
    at_start=True,
    cases=("consumer/3.2/3",),
)
def _omits_layout_unechoed() -> None:
    class EchoedByAll(set[str]):
        def __contains__(self, item: object) -> bool:
            return True

    original = ConsumerSession.__init__

    def init(self: ConsumerSession, config: Any) -> None:
        original(self, config)
        self._acked = EchoedByAll()

    replace(ConsumerSession, "__init__", init)


@mutant(
    "no-fingerprint",
    "decode",
    "announces fingerprint but sends none in its pulls",
    cases=("consumer/3.2/5",),
)
def _no_fingerprint() -> None:
    original = ConsumerSession._pull_message

    def pull_message(self: ConsumerSession, *args: Any, **kwargs: Any) -> Any:
        msg = original(self, *args, **kwargs)
        if isinstance(msg, XferMetadataV2):
            return msgspec.structs.replace(msg, fingerprint=None)
        return msg

    replace(ConsumerSession, "_pull_message", pull_message)


@mutant(
    "pull-deadline-inflated",
    "decode",
    "sends 10 s more than the time left as its deadline_ms",
    cases=("consumer/5.2/3",),
)
def _pull_deadline_inflated() -> None:
    original = ConsumerSession._pull_message

    def pull_message(self: ConsumerSession, *args: Any, **kwargs: Any) -> Any:
        msg = original(self, *args, **kwargs)
        if isinstance(msg, XferMetadataV2) and msg.deadline_ms:
            return msgspec.structs.replace(msg, deadline_ms=msg.deadline_ms + 10_000)
        return msg

    replace(ConsumerSession, "_pull_message", pull_message)


@mutant(
    "pull-deadline-earliest",
    "decode",
    "sends the time left until the earliest deadline of a pull's requests, not the latest",
    cases=("consumer/6.3/2",),
)
def _pull_deadline_earliest() -> None:
    original = ConsumerSession._pull_message

    def pull_message(
        self: ConsumerSession, reqs: dict[str, str], with_layout: bool, agreement: Any, now: float
    ) -> Any:
        msg = original(self, reqs, with_layout, agreement, now)
        if isinstance(msg, XferMetadataV2) and msg.deadline_ms and reqs:
            left = min(self._loads[d].deadline for d in reqs) - now
            return msgspec.structs.replace(msg, deadline_ms=max(1, int(left * 1000)))
        return msg

    replace(ConsumerSession, "_pull_message", pull_message)


@mutant(
    "cancel-rank-out-of-range",
    "decode",
    "names TP rank tp_size in its cancels",
    cases=("consumer/5.2/3",),
)
def _cancel_rank_out_of_range() -> None:
    original = codec.encode_cancel

    def encode(msg: XferCancel, agreement: Any) -> bytes:
        return original(msgspec.structs.replace(msg, remote_tp_rank=msg.remote_tp_size), agreement)

    replace(consumer_module, "encode_cancel", encode)


@mutant(
    "cancel-to-legacy", "decode", "cancels its pulls at a legacy P too", cases=("consumer/3.5/1",)
)
def _cancel_to_legacy() -> None:
    original = negotiation.Agreement.allows

    def allows(self: Agreement, cap: Any) -> bool:
        return cap == Capability.CANCEL or original(self, cap)

    replace(negotiation.Agreement, "allows", allows)
    replace(consumer_module, "encode_cancel", lambda msg, agreement: msgspec.msgpack.encode(msg))


@mutant(
    "flat-block-lists",
    "decode",
    "sends flat block lists, as vLLM 0.16 to 0.19 did",
    cases=("consumer/3.2/1",),
)
def _flat_block_lists() -> None:
    original = codec.encode_pull

    def encode(msg: Any, agreement: Any) -> bytes:
        obj = msgspec.msgpack.decode(original(msg, agreement))
        obj["req_blocks"] = {d: [t, groups[0]] for d, (t, groups) in obj["req_blocks"].items()}
        return msgspec.msgpack.encode(obj)

    replace(consumer_module, "encode_pull", encode)


@mutant(
    "pull-with-delimiter",
    "decode",
    "sends each pull as two frames [b'', pull]",
    cases=("consumer/3.1/1",),
)
def _pull_with_delimiter() -> None:
    def send_pull(self: ConsumerAgent, pull: Any) -> None:
        self._pulls_sent += 1
        self._open(pull.pull_id, pull.addr, self._dealer(pull.addr), [b"", pull.data])

    replace(ConsumerAgent, "_send_pull", send_pull)


@mutant(
    "reuses-dealer",
    "decode",
    "sends every pull to a P worker on one DEALER",
    cases=("consumer/3.1/1",),
)
def _reuses_dealer() -> None:
    def send_pull(self: ConsumerAgent, pull: Any) -> None:
        kept: dict[str, zmq.Socket[bytes]] = self.__dict__.setdefault("_kept", {})
        sock = kept.get(pull.addr)
        if sock is None:
            sock = kept[pull.addr] = self._dealer(pull.addr)
        else:  # the earlier pull's replies are read no more
            self._thread.loop.remove_reader(sock.FD)
        self._pulls_sent += 1
        self._open(pull.pull_id, pull.addr, sock, [pull.data])

    def close_pull(self: ConsumerAgent, pull_id: int) -> None:
        self._pulls.pop(pull_id, None)  # the socket stays open for the next pull

    replace(ConsumerAgent, "_send_pull", send_pull)
    replace(ConsumerAgent, "_close_pull", close_pull)


# -- replies ----------------------------------------------------------------------------------


@mutant(
    "unreported-ok",
    "decode",
    "takes a request a FINISH did not list as loaded",
    cases=("consumer/3.4/1",),
)
def _unreported_ok() -> None:
    original = ConsumerSession._fail_pull

    def fail_pull(self: ConsumerSession, pull: Any, code: ErrorCode, reason: str) -> None:
        if reason != UNREPORTED:
            original(self, pull, code, reason)
            return
        for d_req in list(pull.reqs):
            self._settle(pull, d_req, None)
        self._close(pull)

    replace(ConsumerSession, "_fail_pull", fail_pull)


@mutant(
    "trusts-every-reply",
    "decode",
    "takes every request as loaded on any terminal reply: ERROR, or one it cannot decode",
    cases=(
        "consumer/2.4/1",
        "consumer/3.4/2",
    ),
)
def _trusts_every_reply() -> None:
    def rewrite(session: Any, pull: Any, reply: XferResponseV2 | None) -> Any:
        if reply is not None and reply.status not in (Status.FINISH, Status.ERROR):
            return None
        return XferResponseV2(status=Status.FINISH, ok_reqs=list(pull.reqs), err_reqs=[])

    _rewrite_replies(rewrite)


@mutant(
    "ignores-err-reqs",
    "decode",
    "takes the requests of err_reqs as loaded",
    cases=(
        "consumer/10.10/1",
        "consumer/10.10/5",
    ),
)
def _ignores_err_reqs() -> None:
    def rewrite(session: Any, pull: Any, reply: XferResponseV2 | None) -> Any:
        if reply is None or not reply.err_reqs:
            return None
        ok = [*(reply.ok_reqs or ()), *reply.err_reqs]
        return msgspec.structs.replace(
            reply, ok_reqs=ok, err_reqs=[], err_msg=None, err_code=None, err_codes=None
        )

    _rewrite_replies(rewrite)


@mutant(
    "continue-is-terminal",
    "decode",
    "takes CONTINUE as the end of the pull",
    cases=("consumer/3.4/4",),
)
def _continue_is_terminal() -> None:
    def rewrite(session: Any, pull: Any, reply: XferResponseV2 | None) -> Any:
        if reply is None or reply.status is not Status.CONTINUE:
            return None
        return msgspec.structs.replace(reply, status=Status.FINISH)

    _rewrite_replies(rewrite)


@mutant(
    "err-msg-fails",
    "decode",
    "fails every pending request of a reply that has an err_msg",
    cases=("consumer/7.1/1",),
)
def _err_msg_fails() -> None:
    def rewrite(session: Any, pull: Any, reply: XferResponseV2 | None) -> Any:
        if reply is None or not reply.err_msg or reply.status is not Status.FINISH:
            return None
        return XferResponseV2(status=Status.ERROR, err_msg=reply.err_msg)

    _rewrite_replies(rewrite)


@mutant(
    "ignores-err-codes",
    "decode",
    "takes a failed request's code from err_code alone",
    cases=("consumer/3.4/5",),
)
def _ignores_err_codes() -> None:
    def rewrite(session: Any, pull: Any, reply: XferResponseV2 | None) -> Any:
        if reply is None or not reply.err_codes:
            return None
        return msgspec.structs.replace(reply, err_codes=None)

    _rewrite_replies(rewrite)


@mutant(
    "unknown-id-fails-pull",
    "decode",
    "fails the whole pull when a reply lists an id that is not pending in it",
    cases=("consumer/3.4/3",),
)
def _unknown_id_fails_pull() -> None:
    original = ConsumerSession._settle

    def settle(self: ConsumerSession, pull: Any, d_req: str, failure: Any) -> None:
        if d_req not in pull.reqs and d_req not in self._loads:
            self._fail_pull(pull, ErrorCode.INTERNAL, f"unknown request {d_req}")
            return
        original(self, pull, d_req, failure)

    replace(ConsumerSession, "_settle", settle)


@mutant(
    "ignores-layout-miss",
    "decode",
    "fails a pull on LAYOUT_MISS instead of resending it",
    cases=("consumer/3.7/1",),
)
def _ignores_layout_miss() -> None:
    def resend(self: ConsumerSession, pull: Any, now: float) -> None:
        self._fail_pull(pull, ErrorCode.LAYOUT_MISS, "layout lost")

    replace(ConsumerSession, "_resend_with_layout", resend)


@mutant(
    "retries-layout-miss",
    "decode",
    "sends a pull again on LAYOUT_MISS even when it carried its layout",
    cases=("consumer/3.7/2",),
)
def _retries_layout_miss() -> None:
    original = ConsumerSession._on_reply

    def on_reply(self: ConsumerSession, ev: ReplyReceived, now: float) -> None:
        pull = self._pulls.get(ev.pull_id)
        if pull is not None:
            pull.with_layout = False
        original(self, ev, now)

    replace(ConsumerSession, "_on_reply", on_reply)


@mutant(
    "first-reply-completes",
    "decode",
    "settles a request when its first pull settles, not its last",
    cases=("consumer/10.10/3",),
)
def _first_reply_completes() -> None:
    original = ConsumerSession._start_pulls

    def start_pulls(self: ConsumerSession, engine_id: str, reqs: Any, now: float) -> None:
        original(self, engine_id, reqs, now)
        _settle_at_next_reply(self, [req.d_req_id for req in reqs])

    replace(ConsumerSession, "_start_pulls", start_pulls)


def _settle_at_next_reply(session: ConsumerSession, d_reqs: list[str]) -> None:
    """Make the next pull that settles each of ``d_reqs`` settle the request, not its last."""
    for d_req in d_reqs:
        load = session._loads.get(d_req)
        if load is not None:
            load.outstanding = min(load.outstanding, 1)


#: How late the mutant error-fails-late answers a failed load: twice the least gap of
#: consumer/10.10/3, as late as vLLM's own D answered on a loaded machine.
LATE_S = 0.6


@mutant(
    "error-fails-late",
    "decode",
    "fails a request as soon as one of its pulls fails (as vLLM 0.32 does), and, slowed as on a "
    f"loaded machine, answers a failed load {LATE_S} s late",
    cases=("consumer/10.10/3",),
)
def _error_fails_late() -> None:
    from reference_connector.node import NodeEngine

    fail_pull = ConsumerSession._fail_pull

    def fail_at_once(self: ConsumerSession, pull: Any, code: ErrorCode, reason: str) -> None:
        _settle_at_next_reply(self, list(pull.reqs))
        fail_pull(self, pull, code, reason)

    load = NodeEngine._load

    async def load_late(self: NodeEngine, *args: Any) -> Any:
        got = await load(self, *args)
        if got[0] is not None:
            await asyncio.sleep(LATE_S)
        return got

    replace(ConsumerSession, "_fail_pull", fail_at_once)
    replace(NodeEngine, "_load", load_late)


# -- bootstrap --------------------------------------------------------------------------------


@mutant(
    "first-engine-entry",
    "decode",
    "pulls from the /query entry of DP rank 0, whatever engine",
    cases=(
        "consumer/4.2/1",
        "consumer/4.2/2",
    ),
)
def _first_engine_entry() -> None:
    from pdwire.events import EngineResolved
    from reference_connector.consumer_agent import ENGINE_NOT_FOUND

    async def resolve(self: ConsumerAgent, engine_id: str, addr: str) -> None:
        entry = None
        try:
            reply = await bootstrap_client.query(addr, timeout=self._query_timeout)
        except Exception as exc:
            logger.warning("query of %s failed: %s", addr, exc)
        else:
            if reply.root:
                entry = reply.root[min(reply.root)].model_copy(update={"engine_id": engine_id})
        error = "" if entry else ENGINE_NOT_FOUND.format(engine_id=engine_id, addr=addr)
        self._feed(EngineResolved(engine_id, entry, error))

    replace(ConsumerAgent, "_resolve", resolve)


@mutant(
    "infers-tp-from-entry",
    "decode",
    "takes P's TP size from the workers a /query entry lists, ignoring its tp_size",
    cases=("consumer/4.2/3",),
)
def _infers_tp_from_entry() -> None:
    problem, targets = ConsumerSession._entry_problem, ConsumerSession._targets

    def entry_problem(self: ConsumerSession, engine_id: str, entry: Any, addr: str) -> str:
        bare = entry.model_copy(update={"tp_size": None}) if entry is not None else None
        return problem(self, engine_id, bare, addr)

    def targets_of(self: ConsumerSession, entry: Any) -> list[str]:
        return targets(self, entry.model_copy(update={"tp_size": None}))

    replace(ConsumerSession, "_entry_problem", entry_problem)
    replace(ConsumerSession, "_targets", targets_of)


@mutant(
    "caches-engine-forever",
    "decode",
    "never queries the bootstrap server again for an engine it knows",
    cases=("consumer/4.2/4",),
)
def _caches_engine_forever() -> None:
    replace(ConsumerSession, "_forget_engine_of", lambda self, pull: None)


@mutant(
    "requires-health",
    "decode",
    "refuses a bootstrap server without GET /health",
    cases=("consumer/4.3/1",),
)
def _requires_health() -> None:
    original = bootstrap_client.query

    async def query(url: str, **kwargs: Any) -> Any:
        async with httpx.AsyncClient(timeout=kwargs.get("timeout", 30.0)) as client:
            health = await client.get(f"{url.rstrip('/')}/health")
        if health.status_code != 200:
            raise bootstrap_client.BootstrapError(f"{url} is not healthy: {health.status_code}")
        return await original(url, **kwargs)

    replace(bootstrap_client, "query", query)


@mutant(
    "query-per-request",
    "decode",
    "queries the bootstrap server once per request",
    cases=("consumer/4.4/1",),
)
def _query_per_request() -> None:
    original = ConsumerSession._on_loads

    def on_loads(self: ConsumerSession, ev: LoadsRequested, now: float) -> None:
        engines = {r.engine_id for r in ev.requests}
        held = {e: self._waiting.pop(e) for e in engines if e in self._waiting}
        original(self, ev, now)
        for engine_id, reqs in held.items():
            self._waiting[engine_id][:0] = reqs

    replace(ConsumerSession, "_on_loads", on_loads)


# -- the load and its timers ------------------------------------------------------------------


@mutant(
    "recompute",
    "decode",
    "silently recomputes every prompt instead of loading it",
    cases=("consumer/4.2/1", "consumer/4.4/2", "consumer/5.2/2"),
    at_start=True,
)
def _recompute() -> None:
    configure(load_failure_policy="recompute")

    def load(self: ConsumerAgent, requests: Any) -> None:
        for r in requests:
            self._thread.call(self._on_failed, r.d_req_id, ErrorCode.INTERNAL, "not loaded", True)

    replace(ConsumerAgent, "load", load)


@mutant(
    "discards-loaded-kv",
    "decode",
    "loads the KV from P, then recomputes the prompt over it and decodes from that",
    cases=("consumer/5.2/2",),
)
def _discards_loaded_kv() -> None:
    from reference_connector.node import NodeEngine

    original = NodeEngine._load

    async def load(self: NodeEngine, job: Any, p: Any, blocks: Any, *args: Any) -> Any:
        failure, verified, nbytes, table = await original(self, job, p, blocks, *args)
        if failure is None:
            parts = await self._all("prefill", job.req, job.ids, blocks, None, True)
            table = self._table(parts)
        return failure, verified, nbytes, table

    replace(NodeEngine, "_load", load)


@mutant(
    "no-release-on-abort",
    "decode",
    "sends P nothing for a request aborted while it waited for blocks",
    cases=("consumer/10.10/4",),
)
def _no_release_on_abort() -> None:
    from reference_connector.node import NodeEngine

    async def release_only(self: NodeEngine, job: Any, p: Any) -> None:
        return None

    replace(NodeEngine, "_release_only", release_only)


@mutant(
    "invalid-params-fail",
    "decode",
    "fails a D leg that lacks a field instead of computing the prompt itself",
    cases=("consumer/5.2/1",),
)
def _invalid_params_fail() -> None:
    from reference_connector.node import NodeEngine, NodeError

    original = NodeEngine.generate

    async def generate(self: NodeEngine, job: Any) -> Any:
        p = job.params or {}
        missing = [k for k in DECODE_KEYS if not p.get(k)]
        if self.config.role == "decode" and p.get("do_remote_prefill") and missing:
            raise NodeError(400, f"kv_transfer_params lacks {missing}")
        return await original(self, job)

    replace(NodeEngine, "generate", generate)


@mutant(
    "ignores-deadline-ms", "decode", "ignores deadline_ms in the D leg", cases=("consumer/5.2/3",)
)
def _ignores_deadline_ms() -> None:
    from reference_connector.node import NodeEngine

    original = NodeEngine._load

    async def load(self: NodeEngine, job: Any, p: Any, *args: Any) -> Any:
        return await original(self, job, {k: v for k, v in p.items() if k != "deadline_ms"}, *args)

    replace(NodeEngine, "_load", load)


@mutant(
    "no-receive-timeout",
    "decode",
    "waits for a reply to its pull as good as forever",
    cases=("consumer/3.1/2",),
    at_start=True,
)
def _no_receive_timeout() -> None:
    configure(receive_timeout=1e6)


@mutant(
    "frees-before-cancel-reply",
    "decode",
    "frees the blocks of a request it gives up on at once, while P may still write into them",
    cases=("consumer/5.2/3",),
)
def _frees_before_cancel_reply() -> None:
    original = ConsumerSession._give_up

    def give_up(self: ConsumerSession, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._out = [
            dataclasses.replace(o, blocks_free=True) if isinstance(o, RequestFailed) else o
            for o in self._out
        ]

    replace(ConsumerSession, "_give_up", give_up)


@mutant(
    "pulls-after-deadline",
    "decode",
    "a request whose deadline passes while P is resolved is still pulled once P is known",
    cases=("consumer/6.3/1",),
)
def _pulls_after_deadline() -> None:
    original = ConsumerSession._fire

    def fire(self: ConsumerSession, entry: Any, now: float) -> None:
        if entry[2] == "deadline":
            load = self._loads.get(entry[3])
            if load is not None and load.state is LoadState.RESOLVING:
                return  # keep waiting for P, then pull as if nothing had happened
        original(self, entry, now)

    replace(ConsumerSession, "_fire", fire)


# -- negotiation ------------------------------------------------------------------------------


@mutant(
    "ignores-legacy-reply",
    "decode",
    "keeps announcing to a P worker that answered without pdwire_version",
    cases=("consumer/8.2/1",),
)
def _ignores_legacy_reply() -> None:
    def learn(self: ConsumerSession, pull: Any, version: int, caps: list[str]) -> None:
        if version >= 2:
            self._peers[pull.addr] = Offer(version, frozenset(caps))

    replace(ConsumerSession, "_learn_peer", learn)


@mutant(
    "ignores-reply-version",
    "decode",
    "learns nothing from a reply's pdwire_version, only from /query",
    cases=("consumer/8.2/2",),
)
def _ignores_reply_version() -> None:
    def learn(self: ConsumerSession, pull: Any, version: int, caps: list[str]) -> None:
        if version < 2 and pull.announced:
            self._peers[pull.addr] = LEGACY_PEER

    replace(ConsumerSession, "_learn_peer", learn)


@mutant(
    "announces-to-legacy",
    "decode",
    "announces pdwire/2 even to a P known to be legacy",
    cases=(
        "consumer/3.2/4",
        "consumer/8.2/1",
    ),
)
def _announces_to_legacy() -> None:
    original = negotiation.negotiate

    def negotiate(role: Role, local: Offer, peer: Offer | None) -> Agreement:
        agreement = original(role, local, peer)
        if role == "decode" and local.version >= 2 and not agreement.announce:
            return dataclasses.replace(agreement, profile=PDWIRE_2, announce=True)
        return agreement

    replace(consumer_module, "negotiate", negotiate)


@mutant(
    "newer-p-is-legacy",
    "decode",
    "speaks legacy to a P that announced a later version",
    cases=("consumer/8.1/1",),
)
def _newer_p_is_legacy() -> None:
    original = negotiation.negotiate

    def negotiate(role: Role, local: Offer, peer: Offer | None) -> Agreement:
        if peer is not None and peer.version > CURRENT_VERSION:
            peer = LEGACY_PEER
        return original(role, local, peer)

    replace(consumer_module, "negotiate", negotiate)


@mutant(
    "cancel-to-any",
    "decode",
    "sends XferCancel to P's that did not announce cancel",
    cases=("consumer/8.4/1",),
)
def _cancel_to_any() -> None:
    original = Agreement.allows

    def allows(self: Agreement, cap: Capability) -> bool:
        return cap is Capability.CANCEL or original(self, cap)

    replace(Agreement, "allows", allows)


# -- pairing ----------------------------------------------------------------------------------


@mutant(
    "pulls-one-tp-rank",
    "decode",
    "pulls from only the first of the P TP ranks it pairs with",
    cases=("consumer/10.1/1",),
)
def _pulls_one_tp_rank() -> None:
    original = planning.target_ranks

    def first(local_tp: int, local_rank: int, remote_tp: int) -> list[int]:
        return original(local_tp, local_rank, remote_tp)[:1]

    replace(consumer_module, "target_ranks", first)


@mutant(
    "tp-pairs-unchecked",
    "decode",
    "pairs with a P whose TP size does not divide its own (rounding the ratio down) and pulls",
    cases=("consumer/10.1/2",),
)
def _tp_pairs_unchecked() -> None:
    def rounded(local_tp: int, local_rank: int, remote_tp: int) -> list[int]:
        if local_tp >= remote_tp:
            return [local_rank * remote_tp // local_tp]
        k = remote_tp // local_tp
        return [local_rank * k + i for i in range(k)]

    replace(consumer_module, "target_ranks", rounded)


@mutant(
    "pulls-own-stage-only",
    "decode",
    "pulls only from the P stage of its own PP rank, whatever the PP sizes",
    cases=("consumer/10.2/1",),
)
def _pulls_own_stage_only() -> None:
    def targets(self: ConsumerSession, entry: Any) -> list[str]:
        side = self.config.side
        tp = entry.tp_size or len(entry.worker_addr)
        addrs = []
        for p_rank in planning.target_ranks(side.tp_size, side.tp_rank, tp):
            by_pp = entry.worker_addr[p_rank]
            addrs.append(by_pp.get(self.config.pp_rank, by_pp[min(by_pp)]))
        return addrs

    replace(ConsumerSession, "_targets", targets)


def _set_layout_id(agent: ConsumerAgent, layout_id: int) -> None:
    """Make ``agent``'s D send ``layout_id`` from now on, having forgotten every echo."""
    session = agent._session
    session.config = dataclasses.replace(session.config, layout_id=layout_id)
    session._acked.clear()


@mutant(
    "new-layout-on-wake",
    "decode",
    "mints a new layout_id when woken from sleep, though its KV keeps its addresses",
    cases=("consumer/3.7/3",),
)
def _new_layout_on_wake() -> None:
    from reference_connector.worker_agents import ReferenceAgent

    original = ReferenceAgent.wake_up

    def wake_up(self: ReferenceAgent) -> None:
        original(self)
        if self.consumer is not None:
            _set_layout_id(self.consumer, consumer_module.mint_layout_id())

    replace(ReferenceAgent, "wake_up", wake_up)


@mutant(
    "layout-id-of-engine",
    "decode",
    "derives its layout_id from its engine id and ranks, so a D restarted under the same "
    "engine id sends the same one",
    at_start=True,
    cases=("consumer/3.7/4",),
)
def _layout_id_of_engine() -> None:
    from reference_connector.worker_agents import ReferenceAgent, WorkerContext

    original = ReferenceAgent.__init__

    def __init__(self: ReferenceAgent, ctx: WorkerContext, **kw: Any) -> None:
        original(self, ctx, **kw)
        if self.consumer is not None:
            s = ctx.spec
            key = hashlib.blake2b(f"{s.engine_id}/{s.tp_rank}/{s.pp_rank}".encode()).digest()
            _set_layout_id(self.consumer, int.from_bytes(key[:7], "little") | 1)

    replace(ReferenceAgent, "__init__", __init__)


mutant(
    "d-window-unclipped",
    "decode",
    "lists every block of a prompt in its sliding-window KV-cache group (10.4.7)",
    cases=("consumer/10.4/1",),
)(keep_every_block)
