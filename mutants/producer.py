"""Mutants of the P side (caught by producer and pair cases). Each patch replaces one piece of
pdwire's producer session or agent, in the process that applies it."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from pdwire import error_strings, planning
from pdwire import producer as producer_module
from pdwire.codec import encode_response
from pdwire.errors import LocalProtocolError
from pdwire.events import FreeReason, MessageReceived, SendReply, StartWrite, WriteCompleted
from pdwire.messages import ErrorCode, XferMetadataV2
from pdwire.messages import XferResponseStatus as Status
from pdwire.messages import XferResponseV2 as Reply
from pdwire.negotiation import LEGACY_PEER, Offer, negotiate
from pdwire.planning import Descriptors, target_ranks
from pdwire.producer import ProducerSession
from pdwire.transitions import TransferState
from pdwire.versions import ALL_CAPS, CURRENT_VERSION
from reference_connector import producer_agent

from . import mutant, producer_limits, replace

logger = logging.getLogger(__name__)


@mutant(
    "wrong-offset",
    "prefill",
    "writes every descriptor 64 bytes past where it belongs",
    cases=(
        "producer/3.4/1",
        "producer/10.8/1",
        "producer/10.8/2",
    ),
)
def _wrong_offset() -> None:
    plan = planning.descriptors

    def shifted(*args: Any, **kwargs: Any) -> Any:
        d = plan(*args, **kwargs)
        if isinstance(d, Descriptors):
            return Descriptors(d.src, d.dst + np.uint64(64), d.length)
        return d

    replace(producer_module, "descriptors", shifted)


@mutant(
    "reply-delimiter",
    "prefill",
    "sends each reply as [identity, b'', payload]",
    cases=(
        "pair/3.1/1",
        "producer/3.1/1",
    ),
)
def _reply_delimiter() -> None:
    def send(self: producer_agent.ProducerAgent, identity: bytes, data: bytes) -> None:
        self._send_frames([identity, b"", data])

    replace(producer_agent.ProducerAgent, "_send", send)


@mutant(
    "answers-multi-frame",
    "prefill",
    "answers a message of three frames instead of dropping it",
    at_start=True,
    cases=("producer/3.1/2",),
)
def _answers_multi_frame() -> None:
    def on_frames(self: producer_agent.ProducerAgent, frames: list[bytes]) -> None:
        self._feed(MessageReceived(frames[0], frames[-1]))

    replace(producer_agent.ProducerAgent, "_on_frames", on_frames)


@mutant(
    "listener-exits-on-multi-frame",
    "prefill",
    "stops serving its side channel for good after a message of three frames, as vLLM's P does",
    at_start=True,
    cases=("producer/3.1/2",),
)
def _listener_exits_on_multi_frame() -> None:
    serve = producer_agent.ProducerAgent._on_frames

    def on_frames(self: producer_agent.ProducerAgent, frames: list[bytes]) -> None:
        if len(frames) != 2:
            logger.error("mutant listener-exits-on-multi-frame: the listener exits")
            self._stop_serving()
            return
        serve(self, frames)

    replace(producer_agent.ProducerAgent, "_on_frames", on_frames)


@mutant(
    "crash-on-malformed",
    "prefill",
    "the worker exits on a pull it cannot decode",
    cases=(
        "producer/2.1/5",
        "producer/2.2/1",
        "producer/2.2/2",
        "producer/2.2/3",
        "producer/2.3/2",
        "producer/2.3/3",
        "producer/2.3/4",
        "producer/2.4/1",
        "producer/2.4/3",
        "producer/3.2/1",
    ),
)
def _crash_on_malformed() -> None:
    original = ProducerSession._reply_error

    def reply_error(
        self: ProducerSession,
        identity: bytes,
        agreement: Any,
        code: ErrorCode,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # a heartbeat to a P without a lease is answered BAD_MESSAGE too, though it decoded
        if code is ErrorCode.BAD_MESSAGE and args[:1] != (error_strings.LEASE_NOT_SET,):
            logger.error("mutant crash-on-malformed: exiting")
            os._exit(3)
        original(self, identity, agreement, code, *args, **kwargs)

    replace(ProducerSession, "_reply_error", reply_error)


@mutant(
    "no-error-codes",
    "prefill",
    "never sends err_code or err_codes, even to pdwire/2 D's",
    cases=("producer/2.4/2",),
)
def _no_error_codes() -> None:
    def drop(reply: Any, agreement: Any) -> None:
        reply.err_code = None
        reply.err_codes = None

    replace(producer_module, "_drop_unagreed_codes", drop)


@mutant(
    "accepts-any-rank",
    "prefill",
    "serves a pull from a D TP rank it is not paired with",
    cases=("producer/10.1/1",),
)
def _accepts_any_rank() -> None:
    original = ProducerSession._check_pull

    def check(self: ProducerSession, msg: Any, agreement: Any) -> Any:
        problem = original(self, msg, agreement)
        if problem is not None and problem[0] is ErrorCode.TP_RANK_NOT_PAIRED:
            return self._check_stages(msg)
        return problem

    replace(ProducerSession, "_check_pull", check)
    replace(planning, "_pairing_error", lambda producer, consumer: None)


@mutant(
    "packed-rows-across-pp",
    "prefill",
    "aligns a pull across PP sizes even when a region is an opaque packed row (10.2.8)",
    cases=(
        "producer/10.2/2",
        "producer/10.2/4",
    ),
)
def _packed_rows_across_pp() -> None:
    replace(ProducerSession, "_check_packed_rows", lambda self, msg: None)


@mutant(
    "v2-to-legacy",
    "prefill",
    "answers a legacy D with pdwire/2 fields (version, caps, codes)",
    cases=(
        "pair/8.4/1",
        "producer/2.1/6",
        "producer/3.4/2",
    ),
)
def _v2_to_legacy() -> None:
    original = ProducerSession._reply

    def reply(self: ProducerSession, identity: bytes, agreement: Any, msg: Any) -> None:
        everything = negotiate("prefill", self._offer, Offer(CURRENT_VERSION, ALL_CAPS))
        original(self, identity, everything, msg)

    replace(ProducerSession, "_reply", reply)


# -- replies --------------------------------------------------------------------------------


@mutant(
    "double-finish", "prefill", "sends the FINISH of every pull twice", cases=("producer/3.4/5",)
)
def _double_finish() -> None:
    original = ProducerSession._flush

    def flush(self: ProducerSession, pull: Any) -> None:
        n = len(self._out)
        original(self, pull)
        again = [o for o in self._out[n:] if isinstance(o, SendReply)]
        self._out.extend(o for o in again if o.reply.status is Status.FINISH)

    replace(ProducerSession, "_flush", flush)


@mutant(
    "no-continue",
    "prefill",
    "holds a pull's results until none of its requests waits",
    cases=("producer/10.5/1",),
)
def _no_continue() -> None:
    original = ProducerSession._flush

    def flush(self: ProducerSession, pull: Any) -> None:
        if not pull.pending:
            original(self, pull)

    replace(ProducerSession, "_flush", flush)


@mutant(
    "ok-also-failed",
    "prefill",
    "lists its failed requests in ok_reqs too (unchecked)",
    cases=("producer/3.4/6",),
)
def _ok_also_failed() -> None:
    round_reply = ProducerSession._round_reply

    def reply(self: ProducerSession, pull: Any, status: Status) -> Reply:
        out = round_reply(self, pull, status)
        if out.err_reqs:
            out.ok_reqs = [*(out.ok_reqs or ()), *out.err_reqs]
        return out

    def unchecked(reply: Reply, agreement: Any) -> bytes:
        try:
            return encode_response(reply, agreement)
        except LocalProtocolError:
            return msgspec.msgpack.encode(reply)

    replace(ProducerSession, "_round_reply", reply)
    replace(producer_module, "encode_response", unchecked)


@mutant(
    "unannounced-replies",
    "prefill",
    "answers a D that announced pdwire/2 as a legacy one",
    cases=("producer/3.4/3",),
)
def _unannounced_replies() -> None:
    original = ProducerSession._reply

    def reply(self: ProducerSession, identity: bytes, agreement: Any, msg: Any) -> None:
        original(self, identity, negotiate("prefill", self._offer, LEGACY_PEER), msg)

    replace(ProducerSession, "_reply", reply)


@mutant(
    "repeats-ok",
    "prefill",
    "lists every served request twice in ok_reqs",
    cases=("producer/3.4/4",),
)
def _repeats_ok() -> None:
    original = ProducerSession._round_reply

    def round_reply(self: ProducerSession, pull: Any, status: Status) -> Reply:
        out = original(self, pull, status)
        if out.ok_reqs:
            out.ok_reqs = out.ok_reqs * 2
        return out

    replace(ProducerSession, "_round_reply", round_reply)


@mutant(
    "reply-map32", "prefill", "writes every reply with a map 32 header", cases=("producer/2.1/6",)
)
def _reply_map32() -> None:
    def encode(reply: Reply, agreement: Any) -> bytes:
        data = encode_response(reply, agreement)
        if 0x80 <= data[0] <= 0x8F:
            return b"\xdf" + (data[0] & 0x0F).to_bytes(4, "big") + data[1:]
        return data

    replace(producer_module, "encode_response", encode)


@mutant(
    "engine-error-ok",
    "prefill",
    "takes a failed batch write for a successful one",
    cases=("producer/10.5/2",),
)
def _engine_error_ok() -> None:
    original = ProducerSession._finish_round

    def finish_round(self: ProducerSession, pull: Any, status: int, now: float) -> None:
        original(self, pull, 0, now)

    replace(ProducerSession, "_finish_round", finish_round)


@mutant(
    "reply-before-write",
    "prefill",
    "replies at once; each write lands 0.5 s later",
    cases=("producer/3.4/1",),
)
def _reply_before_write() -> None:
    def start_write(self: producer_agent.ProducerAgent, write: StartWrite) -> None:
        def late() -> None:
            time.sleep(0.5)
            self._transport.write(write.peer, write.descriptors)

        self._thread.loop.run_in_executor(self._executor, late)
        self._thread.loop.call_soon(self._feed, WriteCompleted(write.write_id, 0))

    replace(producer_agent.ProducerAgent, "_start_write", start_write)


# -- the layout cache (§3.7) ------------------------------------------------------------------


@mutant("no-layout-echo", "prefill", "never echoes the pull's layout_id", cases=("producer/3.7/2",))
def _no_layout_echo() -> None:
    original = ProducerSession._round_reply

    def reply(self: ProducerSession, pull: Any, status: Status) -> Reply:
        out = original(self, pull, status)
        out.layout_id = 0
        return out

    replace(ProducerSession, "_round_reply", reply)


@mutant(
    "miss-on-zero-layout",
    "prefill",
    "answers LAYOUT_MISS to any pull without a layout",
    cases=("producer/3.3/1",),
)
def _miss_on_zero_layout() -> None:
    original = ProducerSession._plan_for

    def plan_for(self: ProducerSession, msg: XferMetadataV2) -> Any:
        return None if not msg.kv_caches_base_addr else original(self, msg)

    replace(ProducerSession, "_plan_for", plan_for)


@mutant(
    "miss-as-error", "prefill", "answers ERROR where LAYOUT_MISS is due", cases=("producer/3.7/1",)
)
def _miss_as_error() -> None:
    original = ProducerSession._reply_error

    def reply_error(self: ProducerSession, *args: Any, **kwargs: Any) -> None:
        if len(args) > 4 and args[4] is Status.LAYOUT_MISS:
            args = (*args[:4], Status.ERROR, *args[5:])
        original(self, *args, **kwargs)

    replace(ProducerSession, "_reply_error", reply_error)


@mutant(
    "no-layout-cache",
    "prefill",
    "evicts every layout as soon as it is cached",
    cases=("producer/3.7/2",),
)
def _no_layout_cache() -> None:
    producer_limits(cached_layouts=0)


@mutant(
    "layout-cache-cleared-on-error",
    "prefill",
    "clears its layout cache at each ERROR reply",
    cases=("producer/3.7/4",),
)
def _layout_cache_cleared_on_error() -> None:
    original = ProducerSession._reply_error

    def reply_error(self: ProducerSession, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("status", args[4] if len(args) > 4 else Status.ERROR) is Status.ERROR:
            self._peer_layouts.clear()
        original(self, *args, **kwargs)

    replace(ProducerSession, "_reply_error", reply_error)


@mutant(
    "layout-key-by-id",
    "prefill",
    "looks a cached layout up by layout_id alone",
    cases=("producer/3.7/3",),
)
def _layout_key_by_id() -> None:
    original = ProducerSession._plan_for

    def plan_for(self: ProducerSession, msg: XferMetadataV2) -> Any:
        if msg.layout_id and not msg.kv_caches_base_addr:
            for key, plan in self._peer_layouts.items():
                if key[-1] == msg.layout_id:
                    return plan
        return original(self, msg)

    replace(ProducerSession, "_plan_for", plan_for)


@mutant(
    "caches-mismatched-layout",
    "prefill",
    "caches a pull's layout before its other checks",
    cases=("producer/3.6/3",),
)
def _caches_mismatched_layout() -> None:
    original = ProducerSession._on_pull

    def on_pull(self: ProducerSession, identity: bytes, msg: XferMetadataV2, now: float) -> None:
        if msg.kv_caches_base_addr:
            self._plan_for(msg)
        original(self, identity, msg, now)

    replace(ProducerSession, "_on_pull", on_pull)


@mutant(
    "no-placeholders",
    "prefill",
    "answers a pull for an unknown transfer_id as expired",
    cases=("producer/10.4/1",),
)
def _no_placeholders() -> None:
    original = ProducerSession._on_pull

    def on_pull(self: ProducerSession, identity: bytes, msg: XferMetadataV2, now: float) -> None:
        original(self, identity, msg, now)
        for transfer_id, _ in msg.req_blocks.values():
            t = self._transfers.get(transfer_id)
            if t is not None and t.state is TransferState.PLACEHOLDER:
                self._expire(t, now)

    replace(ProducerSession, "_on_pull", on_pull)


# -- PP stages (§10.2) ------------------------------------------------------------------------


@mutant(
    "pp-serves-every-layer",
    "prefill",
    "each PP stage holds, registers and serves every layer of the model, not its own only",
    at_start=True,
    cases=("producer/10.2/3",),
)
def _pp_serves_every_layer() -> None:
    from reference_connector.kv_pool import (
        KVPool,
    )  # loads torch, which listing the mutants does not need

    original_init, original_side = KVPool.__init__, KVPool.side

    def init(self: KVPool, shape: Any, tp_size: int, tp_rank: int, pp: int, pp_rank: int) -> None:
        original_init(self, shape, tp_size, tp_rank, 1, 0)  # the whole model's layers and memory
        self.pp_size, self.pp_rank = pp, pp_rank  # registered as its own stage still

    def side(self: KVPool, base: int) -> Any:
        stage = self.pp_size, self.pp_rank
        self.pp_size, self.pp_rank = 1, 0
        try:
            whole = original_side(self, base)
        finally:
            self.pp_size, self.pp_rank = stage
        return dataclasses.replace(whole, pp_size=stage[0])

    from reference_connector import kv_content, node

    original_place = kv_content.place

    def place(table: Any, part: bytes, layers: range, heads: range) -> None:
        # The front's digest table takes a worker's rows for every layer it now holds.
        if len(part) != len(layers) * 2 * len(heads) * 8:
            layers = range(table.shape[0])
        original_place(table, part, layers, heads)

    replace(KVPool, "__init__", init)
    replace(KVPool, "side", side)
    replace(node, "place", place)


# -- counting and freeing (§10.3, §10.9) ------------------------------------------------------


def _set_need_send(need_send: Callable[[ProducerSession, XferMetadataV2], int]) -> None:
    original = ProducerSession._open_pull

    def open_pull(self: ProducerSession, identity: bytes, msg: Any, *args: Any) -> Any:
        pull = original(self, identity, msg, *args)
        pull.need_send = need_send(self, msg)
        return pull

    replace(ProducerSession, "_open_pull", open_pull)


@mutant(
    "early-free",
    "prefill",
    "frees a transfer's blocks once its first pull is served",
    cases=(
        "producer/10.3/1",
        "producer/10.3/2",
    ),
)
def _early_free() -> None:
    _set_need_send(lambda self, msg: 1)


@mutant(
    "pp-count-ignored",
    "prefill",
    "counts one pull per paired D TP rank, whatever D's PP",
    cases=("producer/10.3/2",),
)
def _pp_count_ignored() -> None:
    def paired(self: ProducerSession, msg: XferMetadataV2) -> int:
        side = self.config.side
        return len(target_ranks(side.tp_size, side.tp_rank, msg.remote_tp_size))

    _set_need_send(paired)


@mutant(
    "need-send-follows-each-pull",
    "prefill",
    "counts the pulls it waits for anew from each pull that finds the transfer ready",
    cases=("producer/10.3/5",),
)
def _need_send_follows_each_pull() -> None:
    original = ProducerSession._take_for_round

    def take_for_round(self: ProducerSession, pull: Any, t: Any, *args: Any) -> None:
        t.need_send = 0  # as if no pull had found the transfer ready before this one
        original(self, pull, t, *args)

    replace(ProducerSession, "_take_for_round", take_for_round)


@mutant(
    "error-frees",
    "prefill",
    "an ERROR reply frees the ready transfers its pull named",
    cases=("producer/10.9/1",),
)
def _error_frees() -> None:
    original = ProducerSession._on_pull

    def on_pull(self: ProducerSession, identity: bytes, msg: XferMetadataV2, now: float) -> None:
        n = len(self._out)
        original(self, identity, msg, now)
        replies = [o for o in self._out[n:] if isinstance(o, SendReply)]
        if any(o.reply.status is Status.ERROR for o in replies):
            for transfer_id, _ in msg.req_blocks.values():
                t = self._transfers.get(transfer_id)
                if t is not None and t.state is TransferState.READY:
                    self._settle_all(t, FreeReason.SERVED)

    replace(ProducerSession, "_on_pull", on_pull)


@mutant(
    "err-counts-served",
    "prefill",
    "counts a pull that failed a request as serving it",
    cases=("producer/10.3/4",),
)
def _err_counts_served() -> None:
    original = ProducerSession._take_for_round

    def take(self: ProducerSession, pull: Any, t: Any, d_req: str, *args: Any) -> None:
        original(self, pull, t, d_req, *args)
        if d_req in pull.err:
            self._settle(t, pull.peer)

    replace(ProducerSession, "_take_for_round", take)


@mutant(
    "release-only-not-counted",
    "prefill",
    "does not count a release-only pull as served",
    cases=("producer/10.3/3",),
)
def _release_only_not_counted() -> None:
    original = ProducerSession._take_for_round

    def take(self: ProducerSession, pull: Any, t: Any, d_req: str, *args: Any) -> None:
        if any(pull.msg.req_blocks[d_req][1]):
            original(self, pull, t, d_req, *args)
            return
        del pull.pending[d_req]
        t.waiting.discard(pull.key)
        t.need_send = t.need_send or pull.need_send
        pull.ok.append(d_req)

    replace(ProducerSession, "_take_for_round", take)


# -- timers (§6) ------------------------------------------------------------------------------


@mutant(
    "ready-timeout-as-error",
    "prefill",
    "ends a pull whose ready wait expired with ERROR",
    cases=("producer/10.4/2",),
)
def _ready_timeout_as_error() -> None:
    original = ProducerSession._pull_timer

    def pull_timer(self: ProducerSession, pull: Any, now: float) -> None:
        if pull.round is None and pull.pending and pull.d_deadline > now:
            message = error_strings.READY_TIMEOUT
            self._reply_error(pull.identity, pull.agreement, ErrorCode.READY_TIMEOUT, message)
            self._close(pull)
            return
        original(self, pull, now)

    replace(ProducerSession, "_pull_timer", pull_timer)


def _skip_expiry(state: TransferState) -> None:
    original = ProducerSession._expire

    def expire(self: ProducerSession, t: Any, now: float) -> None:
        if t.state is not state:
            original(self, t, now)

    replace(ProducerSession, "_expire", expire)


@mutant(
    "never-expires",
    "prefill",
    "keeps a ready transfer past its retention timer",
    cases=(
        "producer/6.4/2",
        "producer/10.11/1",
    ),
)
def _never_expires() -> None:
    _skip_expiry(TransferState.READY)


@mutant(
    "ready-wait-fixed",
    "prefill",
    "ends a pull's ready wait T after the pull, whatever became ready",
    cases=("producer/6.3/3",),
)
def _ready_wait_fixed() -> None:
    original = ProducerSession._finish_round

    def finish_round(self: ProducerSession, pull: Any, status: int, now: float) -> None:
        first = pull.wait_until
        original(self, pull, status, now)
        if pull.key in self._pulls and pull.round is None:
            pull.wait_until = first
            self._push_pull_timer(pull)

    replace(ProducerSession, "_finish_round", finish_round)


@mutant(
    "ready-wait-restarts-on-record",
    "prefill",
    "restarts a pull's ready wait when P records a transfer the pull waits for",
    cases=("producer/6.3/3",),
)
def _ready_wait_restarts_on_record() -> None:
    original = ProducerSession._on_started

    def on_started(self: ProducerSession, ev: Any, now: float) -> None:
        original(self, ev, now)
        t = self._transfers.get(ev.transfer_id)
        for key in t.waiting if t is not None else ():
            pull = self._pulls[key]
            pull.wait_until = now + self.config.abort_timeout
            self._push_pull_timer(pull)

    replace(ProducerSession, "_on_started", on_started)


@mutant(
    "expires-in-flight",
    "prefill",
    "expires a ready transfer at its timer even while a write from its blocks is in flight",
    cases=("producer/6.3/2",),
)
def _expires_in_flight() -> None:
    original = ProducerSession._expire

    def expire(self: ProducerSession, t: Any, now: float) -> None:
        writing, t.writing = t.writing, 0
        try:
            original(self, t, now)
        finally:
            t.writing = writing

    replace(ProducerSession, "_expire", expire)


@mutant(
    "placeholders-never-expire",
    "prefill",
    "keeps a placeholder until its request comes",
    cases=("producer/10.11/2",),
)
def _placeholders_never_expire() -> None:
    _skip_expiry(TransferState.PLACEHOLDER)


@mutant(
    "placeholder-restarts",
    "prefill",
    "restarts a placeholder's expiry at each pull naming it",
    cases=("producer/10.11/2",),
)
def _placeholder_restarts() -> None:
    original = ProducerSession._on_pull

    def on_pull(self: ProducerSession, identity: bytes, msg: XferMetadataV2, now: float) -> None:
        original(self, identity, msg, now)
        for transfer_id, _ in msg.req_blocks.values():
            t = self._transfers.get(transfer_id)
            if t is not None and t.state is TransferState.PLACEHOLDER:
                self._remember(t)

    replace(ProducerSession, "_on_pull", on_pull)


from . import producer_bootstrap, producer_decode, producer_planning, producer_v2  # noqa: E402, F401
