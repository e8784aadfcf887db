"""Mutants caught by the pair suite, where the harness sees a real P and D only through their
answers and the side channel between them. Silent fallbacks first: a D that answers HTTP 200
without decoding from the KV it was sent."""

from __future__ import annotations

from typing import Any

import msgspec

from pdwire.codec import decode_response, encode_response
from pdwire.errors import DecodeError
from pdwire.events import FreeReason
from pdwire.messages import XferResponseStatus
from pdwire.negotiation import LEGACY_PEER, negotiate
from pdwire.versions import LEGACY, PDWIRE_2

from . import mutant, replace

_TERMINAL = (XferResponseStatus.FINISH, XferResponseStatus.ERROR, XferResponseStatus.LAYOUT_MISS)


def _status(data: bytes) -> XferResponseStatus | None:
    try:
        return decode_response(data).status
    except DecodeError:
        return None


# -- D ---------------------------------------------------------------------------------------


@mutant(
    "d-recompute-silent",
    "decode",
    "computes the prompt itself instead of loading it; HTTP 200",
    cases=(
        "pair/5.2/4",
        "pair/5.2/5",
    ),
)
def _d_recompute_silent() -> None:
    from reference_connector import node

    async def decode_remote(self: node.NodeEngine, job: node.Job, p: dict[str, Any]) -> Any:
        return await self._local(job)

    replace(node.NodeEngine, "_decode_remote", decode_remote)


@mutant(
    "d-recompute-after-load",
    "decode",
    "loads the KV, then decodes from a local prefill of the prompt, claiming it loaded it",
    cases=("pair/5.2/5",),
)
def _d_recompute_after_load() -> None:
    from reference_connector import node

    original = node.NodeEngine._load

    async def load(self: node.NodeEngine, job: node.Job, p: Any, blocks: Any, *a: Any) -> Any:
        failure, verified, nbytes, table = await original(self, job, p, blocks, *a)
        if failure is None:
            table = self._table(await self._all("prefill", job.req, job.ids, blocks, None, True))
        return failure, verified, nbytes, table

    replace(node.NodeEngine, "_load", load)


@mutant(
    "d-cached-tokens-rounded",
    "decode",
    "reports remote_prefill_cached_tokens as the prompt's blocks times the block size",
    cases=("pair/5.3/2",),
)
def _d_cached_tokens_rounded() -> None:
    from reference_connector import node

    original = node.NodeEngine._decode_remote

    async def decode_remote(self: node.NodeEngine, job: node.Job, p: dict[str, Any]) -> Any:
        gen = await original(self, job, p)
        params = gen.kv_transfer_params
        if params and params.get("remote_prefill_cached_tokens"):
            shape = self.config.shape
            params["remote_prefill_cached_tokens"] = (
                shape.blocks_for(len(job.ids)) * shape.block_size
            )
        return gen

    replace(node.NodeEngine, "_decode_remote", decode_remote)


@mutant(
    "d-announces-to-legacy",
    "decode",
    "announces pdwire/2 even to a P its bootstrap shows as legacy",
    cases=("pair/8.3/1",),
)
def _d_announces_to_legacy() -> None:
    from pdwire.consumer import ConsumerSession

    original = ConsumerSession._agreement

    def agreement(self: ConsumerSession, addr: str, engine_id: str) -> Any:
        agreed = original(self, addr, engine_id)
        if agreed.announce or self.config.profile != PDWIRE_2:
            return agreed
        return negotiate("decode", self._offer, None)

    replace(ConsumerSession, "_agreement", agreement)


@mutant(
    "d-pulls-one-rank",
    "decode",
    "pulls only from the first of the P workers it pairs with",
    cases=("pair/10.1/1",),
)
def _d_pulls_one_rank() -> None:
    from pdwire.consumer import ConsumerSession

    original = ConsumerSession._targets

    def targets(self: ConsumerSession, entry: Any) -> list[str]:
        return original(self, entry)[:1]

    replace(ConsumerSession, "_targets", targets)


@mutant(
    "d-decodes-early",
    "decode",
    "takes a request as loaded when the first of its pulls is served",
    cases=("pair/10.10/1",),
)
def _d_decodes_early() -> None:
    from pdwire.consumer import ConsumerSession

    original = ConsumerSession._settle

    def settle(self: ConsumerSession, pull: Any, d_req: str, failure: Any) -> None:
        load = self._loads.get(d_req)
        if failure is None and load is not None and d_req in pull.reqs and load.failure is None:
            load.outstanding = 1
        original(self, pull, d_req, failure)

    replace(ConsumerSession, "_settle", settle)


@mutant(
    "d-pull-delimiter",
    "decode",
    "sends each pull as two frames [b'', payload]",
    cases=("pair/3.1/2",),
)
def _d_pull_delimiter() -> None:
    from reference_connector import consumer_agent

    def send_pull(self: consumer_agent.ConsumerAgent, pull: Any) -> None:
        self._pulls_sent += 1
        self._open(pull.pull_id, pull.addr, self._dealer(pull.addr), [b"", pull.data])

    replace(consumer_agent.ConsumerAgent, "_send_pull", send_pull)


@mutant(
    "d-skips-layout",
    "decode",
    "omits its layout from the first pull to each P worker, as if that worker had echoed it",
    cases=("pair/9.3/1",),
)
def _d_skips_layout() -> None:
    from pdwire.consumer import ConsumerSession

    original = ConsumerSession._send_pull
    seen: set[tuple[int, str]] = set()

    def send_pull(self: ConsumerSession, addr: str, *args: Any) -> None:
        if self.config.layout_id and (id(self), addr) not in seen:
            seen.add((id(self), addr))
            self._acked.add(addr)
        original(self, addr, *args)

    replace(ConsumerSession, "_send_pull", send_pull)


@mutant(
    "d-ignores-deadline",
    "decode",
    "ignores deadline_ms in kv_transfer_params",
    cases=("pair/5.2/6",),
)
def _d_ignores_deadline() -> None:
    from reference_connector import node

    original = node.NodeEngine._decode_remote

    async def decode_remote(self: node.NodeEngine, job: node.Job, p: dict[str, Any]) -> Any:
        return await original(self, job, {k: v for k, v in p.items() if k != "deadline_ms"})

    replace(node.NodeEngine, "_decode_remote", decode_remote)


# -- P ---------------------------------------------------------------------------------------


@mutant(
    "p-garbage",
    "prefill",
    "writes the KV of other tokens than the prompt's",
    cases=(
        "pair/5.2/1",
        "pair/5.2/2",
        "pair/5.2/3",
    ),
)
def _p_garbage() -> None:
    from reference_connector.kv_pool import KVPool

    original = KVPool.write_prompt

    def write_prompt(self: KVPool, ids: Any, blocks: Any) -> int:
        return original(self, [(i + 1) % self.shape.vocab for i in ids], blocks)

    replace(KVPool, "write_prompt", write_prompt)


@mutant(
    "p-double-finish",
    "prefill",
    "sends every terminal reply twice",
    cases=(
        "pair/3.4/1",
        "pair/3.4/2",
    ),
)
def _p_double_finish() -> None:
    from reference_connector.producer_agent import ProducerAgent

    original = ProducerAgent._send

    def send(self: ProducerAgent, identity: bytes, data: bytes) -> None:
        original(self, identity, data)
        if _status(data) in _TERMINAL:
            original(self, identity, data)

    replace(ProducerAgent, "_send", send)


@mutant(
    "p-forgets-ok",
    "prefill",
    "ends each served pull with FINISH listing no request",
    cases=("pair/3.4/2",),
)
def _p_forgets_ok() -> None:
    from reference_connector.producer_agent import ProducerAgent

    original = ProducerAgent._send

    def send(self: ProducerAgent, identity: bytes, data: bytes) -> None:
        try:
            msg = decode_response(data)
        except DecodeError:
            msg = None
        if msg is not None and msg.status is XferResponseStatus.FINISH and msg.ok_reqs:
            msg = msgspec.structs.replace(msg, ok_reqs=[])
            data = encode_response(msg, PDWIRE_2 if msg.pdwire_version else LEGACY)
        original(self, identity, data)

    replace(ProducerAgent, "_send", send)


@mutant(
    "p-mute-version",
    "prefill",
    "answers a D that announced pdwire/2 without its version",
    cases=("pair/3.4/3",),
)
def _p_mute_version() -> None:
    from pdwire.producer import ProducerSession

    original = ProducerSession._reply

    def reply(self: ProducerSession, identity: bytes, agreement: Any, msg: Any) -> None:
        original(self, identity, negotiate("prefill", self._offer, LEGACY_PEER), msg)

    replace(ProducerSession, "_reply", reply)


@mutant(
    "p-echoes-params",
    "prefill",
    "answers the P leg with its kv_transfer_params, not null",
    cases=(
        "pair/5.3/1",
        "producer/5.3/1",
    ),
)
def _p_echoes_params() -> None:
    from reference_connector import node

    original = node.NodeEngine._prefill_remote

    async def prefill_remote(self: node.NodeEngine, job: node.Job, transfer_id: str) -> Any:
        gen = await original(self, job, transfer_id)
        gen.kv_transfer_params = dict(job.params or {})
        return gen

    replace(node.NodeEngine, "_prefill_remote", prefill_remote)


@mutant("p-keeps-blocks", "prefill", "never frees a sent transfer's blocks", cases=("pair/10.9/1",))
def _p_keeps_blocks() -> None:
    from reference_connector import node

    original = node.NodeEngine._on_send_event

    def on_send_event(self: node.NodeEngine, index: int, name: str, req: str, args: Any) -> None:
        if name != "free":
            original(self, index, name, req, args)

    replace(node.NodeEngine, "_on_send_event", on_send_event)


@mutant(
    "p-stall-on-stop",
    "prefill",
    "on a stop token as the only prefill token, frees its blocks but answers no waiting pull "
    "(vLLM 0.33: D waits out P's ready wait)",
    cases=("pair/10.11/1",),
)
def _p_stall_on_stop() -> None:
    from reference_connector.producer_agent import ProducerAgent

    def will_not_send(
        self: ProducerAgent, transfer_id: str, p_req_id: str, reason: str = ""
    ) -> None:
        self._thread.call(self._on_free, p_req_id, transfer_id, FreeReason.WILL_NOT_SEND)

    replace(ProducerAgent, "transfer_will_not_send", will_not_send)


@mutant(
    "p-leg-needs-transfer-id",
    "prefill",
    "refuses a P leg whose params lack transfer_id",
    cases=("producer/5.1/2",),
)
def _p_leg_needs_transfer_id() -> None:
    from reference_connector import node

    original = node.NodeEngine.generate

    async def generate(self: node.NodeEngine, job: node.Job) -> Any:
        p = job.params or {}
        if p.get("do_remote_decode") and not p.get("transfer_id"):
            raise node.NodeError(400, "kv_transfer_params lack transfer_id")
        return await original(self, job)

    replace(node.NodeEngine, "generate", generate)
