"""Mutants of how a P worker registers and where (§4.4), caught by the registration suite. That
suite starts a P for each case, so each mutant is applied at start-up (``at_start``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdwire.http_models import RegisterReply, RegisterWorkerPayload
from reference_connector import bootstrap_client
from reference_connector.bootstrap_client import BootstrapError
from reference_connector.dp_placement import LOOPBACK, DataParallel
from reference_connector.producer_agent import ProducerAgent

from . import mutant, replace

if TYPE_CHECKING:
    from reference_connector.node import NodeEngine


def _register_with(**forced: Any) -> None:
    """Every registration made with ``forced`` in place of the caller's keyword arguments."""
    original = bootstrap_client.register

    async def register(url: str, payload: RegisterWorkerPayload, **kw: Any) -> RegisterReply:
        return await original(url, payload, **{**kw, **forced})

    replace(bootstrap_client, "register", register)


@mutant(
    "register-four-attempts",
    "prefill",
    "makes a fourth registration attempt",
    at_start=True,
    cases=("registration/4.4/1",),
)
def _register_four_attempts() -> None:
    _register_with(attempts=4)


@mutant(
    "register-no-backoff",
    "prefill",
    "retries a registration at once",
    at_start=True,
    cases=("registration/4.4/1",),
)
def _register_no_backoff() -> None:
    _register_with(backoff=0.0)


@mutant(
    "register-unbounded-attempt",
    "prefill",
    "waits for a registration answer without a timeout",
    at_start=True,
    cases=("registration/4.4/1",),
)
def _register_unbounded_attempt() -> None:
    _register_with(timeout=None)


@mutant(
    "register-vague-failure",
    "prefill",
    "fails an exhausted registration without 4.4-R5's message",
    at_start=True,
    cases=("registration/4.4/1",),
)
def _register_vague_failure() -> None:
    original = bootstrap_client.register

    async def register(url: str, payload: RegisterWorkerPayload, **kw: Any) -> RegisterReply:
        try:
            return await original(url, payload, **kw)
        except BootstrapError as exc:
            if exc.status is not None:
                raise
            raise BootstrapError("registration failed") from None

    replace(bootstrap_client, "register", register)


@mutant(
    "register-retries-http-error",
    "prefill",
    "retries a registration that the server answered with HTTP 400",
    at_start=True,
    cases=("registration/4.4/2",),
)
def _register_retries_http_error() -> None:
    original = bootstrap_client.register

    async def register(url: str, payload: RegisterWorkerPayload, **kw: Any) -> RegisterReply:
        wait = 1.0
        for attempt in range(3):
            try:
                return await original(url, payload, **{**kw, "attempts": 1})
            except BootstrapError:
                if attempt == 2:
                    raise
                await asyncio.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    replace(bootstrap_client, "register", register)


@mutant(
    "serves-before-registered",
    "prefill",
    "serves pulls while its registration is still under way",
    at_start=True,
    cases=("registration/4.4/3",),
)
def _serves_before_registered() -> None:
    async def _open(self: ProducerAgent) -> None:
        self._bind()
        self._serve()
        await self._register()

    replace(ProducerAgent, "_open", _open)


@mutant(
    "only-rank0-registers",
    "prefill",
    "only the worker of TP rank 0 and PP rank 0 registers",
    at_start=True,
    cases=("registration/4.4/3",),
)
def _only_rank0_registers() -> None:
    original = ProducerAgent._register

    async def _register(self: ProducerAgent) -> None:
        if self._ranks[1:] == (0, 0):
            await original(self)

    replace(ProducerAgent, "_register", _register)


def _before_node_start(step: Callable[[NodeEngine], None]) -> None:
    """Run ``step`` on the node's engine before its start."""
    from reference_connector import node  # loads torch, which listing the mutants does not need

    original = node.NodeEngine.start

    def start(self: NodeEngine) -> None:
        step(self)
        original(self)

    replace(node.NodeEngine, "start", start)


@mutant(
    "external-bootstrap-served-too",
    "prefill",
    "starts its own bootstrap server although its workers register at an external one",
    at_start=True,
    cases=("registration/4.4/3",),
)
def _external_bootstrap_served_too() -> None:
    from reference_connector.bootstrap import BootstrapServer

    def serve(engine: NodeEngine) -> None:
        c = engine.config
        if c.role == "prefill" and engine.bootstrap_url:
            server = BootstrapServer(auth_key=c.auth_key)
            engine._bootstrap = server.start(c.bootstrap_host, c.bootstrap_port)

    _before_node_start(serve)


@mutant(
    "own-bootstrap-on-loopback",
    "prefill",
    "serves its own bootstrap server at 127.0.0.1 only, not at every address",
    at_start=True,
    cases=("registration/4.4/5",),
)
def _own_bootstrap_on_loopback() -> None:
    def on_loopback(engine: NodeEngine) -> None:
        engine.config = dataclasses.replace(engine.config, bootstrap_host="127.0.0.1")

    _before_node_start(on_loopback)


@mutant(
    "bootstrap-address-unchecked",
    "prefill",
    "takes an external bootstrap address without a port",
    at_start=True,
    cases=("registration/4.4/4",),
)
def _bootstrap_address_unchecked() -> None:
    replace(bootstrap_client, "external_url", lambda a: a if "://" in a else f"http://{a}")


@mutant(
    "workers-announce-apart",
    "prefill",
    "a worker of TP rank above 0 registers one capability fewer than rank 0",
    at_start=True,
    cases=("registration/4.4/3",),
)
def _workers_announce_apart() -> None:
    original = ProducerAgent._payload

    def _payload(self: ProducerAgent) -> RegisterWorkerPayload:
        payload = original(self)
        if self._ranks[1] > 0 and payload.pdwire_caps:
            return payload.model_copy(update={"pdwire_caps": payload.pdwire_caps[:-1]})
        return payload

    replace(ProducerAgent, "_payload", _payload)


# -- data-parallel placement (4.4-R13, R15, R16) ---------------------------------------------


@mutant(
    "dp-rank-is-index",
    "prefill",
    "registers its DP index as dp_rank even when engines are local only",
    at_start=True,
    cases=("registration/4.4/6",),
)
def _dp_rank_is_index() -> None:
    replace(DataParallel, "rank", property(lambda dp: dp.index))


@mutant(
    "dp-server-on-index-0",
    "prefill",
    "serves the bootstrap server from DP index 0 only, even when engines are local only",
    at_start=True,
    cases=("registration/4.4/6",),
)
def _dp_server_on_index_0() -> None:
    replace(DataParallel, "serves_bootstrap", property(lambda dp: dp.index == 0))


@mutant(
    "registers-at-master-ip",
    "prefill",
    "registers at the DP master IP whatever the deployment",
    at_start=True,
    cases=("registration/4.4/6",),
)
def _registers_at_master_ip() -> None:
    replace(DataParallel, "bootstrap_host", property(lambda dp: dp.master_ip))


@mutant(
    "ignores-dp-nodes",
    "prefill",
    "registers at the DP master IP when one DP rank spans several nodes",
    at_start=True,
    cases=("registration/4.4/6",),
)
def _ignores_dp_nodes() -> None:
    replace(
        DataParallel,
        "bootstrap_host",
        property(lambda dp: LOOPBACK if dp.local_only else dp.master_ip),
    )
