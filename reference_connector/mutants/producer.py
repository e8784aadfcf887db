"""Mutants of the P side (caught by producer and pair cases). Each patch replaces one piece of
pdwire's producer session or agent, in the process that applies it."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np

from pdwire import planning
from pdwire import producer as producer_module
from pdwire.events import MessageReceived
from pdwire.messages import ErrorCode
from pdwire.negotiation import Offer, negotiate
from pdwire.planning import Descriptors
from pdwire.producer import ProducerSession
from pdwire.versions import ALL_CAPS, CURRENT_VERSION

from .. import producer_agent
from . import mutant, replace

logger = logging.getLogger(__name__)


@mutant("wrong-offset", "prefill", "writes every descriptor 64 bytes past where it belongs")
def _wrong_offset() -> None:
    plan = planning.descriptors

    def shifted(*args: Any, **kwargs: Any) -> Any:
        d = plan(*args, **kwargs)
        if isinstance(d, Descriptors):
            return Descriptors(d.src, d.dst + np.uint64(64), d.length)
        return d

    replace(producer_module, "descriptors", shifted)


@mutant("reply-delimiter", "prefill", "sends each reply as [identity, b'', payload]")
def _reply_delimiter() -> None:
    def send(self: producer_agent.ProducerAgent, identity: bytes, data: bytes) -> None:
        assert self._sock is not None
        self._replies_sent += 1
        sent = asyncio.ensure_future(self._sock.send_multipart([identity, b"", data]))
        sent.add_done_callback(self._log_send_failure)

    replace(producer_agent.ProducerAgent, "_send", send)


@mutant(
    "answers-multi-frame", "prefill", "answers a message of three frames instead of dropping it"
)
def _answers_multi_frame() -> None:
    async def receive(self: producer_agent.ProducerAgent) -> None:
        assert self._sock is not None
        while True:
            frames = [bytes(f) for f in await self._sock.recv_multipart()]
            self._feed(MessageReceived(frames[0], frames[-1]))

    replace(producer_agent.ProducerAgent, "_receive", receive)


@mutant("crash-on-malformed", "prefill", "the worker exits on a pull it cannot decode")
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
        if code is ErrorCode.BAD_MESSAGE:
            logger.error("mutant crash-on-malformed: exiting")
            os._exit(3)
        original(self, identity, agreement, code, *args, **kwargs)

    replace(ProducerSession, "_reply_error", reply_error)


@mutant("no-error-codes", "prefill", "never sends err_code or err_codes, even to pdwire/2 D's")
def _no_error_codes() -> None:
    def drop(reply: Any, agreement: Any) -> None:
        reply.err_code = None
        reply.err_codes = None

    replace(producer_module, "_drop_unagreed_codes", drop)


@mutant("accepts-any-rank", "prefill", "serves a pull from a D TP rank it is not paired with")
def _accepts_any_rank() -> None:
    original = ProducerSession._check_pull

    def check(self: ProducerSession, msg: Any, agreement: Any) -> Any:
        problem = original(self, msg, agreement)
        if problem is not None and problem[0] is ErrorCode.TP_RANK_NOT_PAIRED:
            return self._check_pp_size(msg)
        return problem

    replace(ProducerSession, "_check_pull", check)
    replace(planning, "_pairing_error", lambda producer, consumer: None)


@mutant("v2-to-legacy", "prefill", "answers a legacy D with pdwire/2 fields (version, caps, codes)")
def _v2_to_legacy() -> None:
    original = ProducerSession._reply

    def reply(self: ProducerSession, identity: bytes, agreement: Any, msg: Any) -> None:
        everything = negotiate("P", self._offer, Offer(CURRENT_VERSION, ALL_CAPS))
        original(self, identity, everything, msg)

    replace(ProducerSession, "_reply", reply)
