"""The registration suite's world: the harness is P's deployment and its bootstrap server; the
testee is a P, started for each case from a command template pointed at a scripted bootstrap
server (``peers.registrar``), which checks how P's workers register (§4.4).

P is told where to register with ``{bootstrap_address}`` (``host:port``, vLLM's
``bootstrap_server_address``) or ``{bootstrap_url}``; its environment carries
``VLLM_MOONCAKE_CONNECTOR_TIMEOUT`` (the bound on each attempt) and
``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (where P would serve a bootstrap server of its own, which it must
not, 4.4-R11). A second template, without an external address, starts a P that serves a
bootstrap server of its own (4.4-R14); a third starts one engine of a data-parallel deployment
at the place the case gives it (4.4-R13, R15, R16). The cases of the suite are independent,
each with its own P and server, and run side by side: most of a case is waiting for P to start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final

from ..case import Case, Suite, WireLog, given
from ..command import TemplateProcess, check, fill, with_env
from ..peers.registrar import Registrar, Script
from ..ports import free_port
from ..runner import DEFAULT_REQUEST_TIMEOUT, Result, RunOptions, run_case

PLACEHOLDERS: Final = (
    "python", "port", "bootstrap_address", "bootstrap_url", "bootstrap_host", "bootstrap_port",
)  # fmt: skip
#: Those of the template that starts P without an external bootstrap address.
OWN_PLACEHOLDERS: Final = ("python", "port")
#: What ``{bootstrap_address}`` is in the case of an address without a port (4.4-R12).
PORTLESS_HOST: Final = "127.0.0.1"
#: P's VLLM_MOONCAKE_CONNECTOR_TIMEOUT in the cases that do not time its attempts: long enough
#: that a registration answered (or held, 4.4-R6) is never given up on a loaded machine.
RELAXED_TIMEOUT: Final = 10.0
#: The reference P (``pdwire node``) of TP 2, as ``pdwire conformance self`` starts it.
REFERENCE_COMMAND: Final = (
    "{python} -m pdwire node --role prefill --port {port} --tp 2 --bootstrap "
    "{bootstrap_address} --layers 4 --kv-heads 4 --head-dim 16 --block-size 4 --num-blocks 16"
)
#: The same P without an external bootstrap address: it serves its own.
REFERENCE_OWN_COMMAND: Final = REFERENCE_COMMAND.replace(" --bootstrap {bootstrap_address}", "")
#: Those of the template that starts one engine of a data-parallel deployment without an external
#: bootstrap address (4.4-R13, R15, R16): its DP index and local DP rank, its DP load balancing
#: (internal, hybrid or external; the last two mean engines local only), vLLM's
#: data_parallel_master_ip and master_addr, and how many nodes one DP rank spans.
DP_PLACEHOLDERS: Final = (
    "python", "port", "dp_index", "dp_local_rank", "dp_load_balancing", "dp_master_ip",
    "master_addr", "dp_nodes",
)  # fmt: skip
#: The reference engine of such a deployment, of TP 1.
REFERENCE_DP_COMMAND: Final = (
    REFERENCE_OWN_COMMAND.replace("--tp 2", "--tp 1")
    + " --dp-index {dp_index} --dp-local-rank {dp_local_rank} --dp-load-balancing "
    "{dp_load_balancing} --dp-master-ip {dp_master_ip} --master-addr {master_addr} "
    "--dp-nodes {dp_nodes}"
)


@dataclasses.dataclass(frozen=True)
class RegistrationOptions:
    command: str  # the template that starts P
    own_command: str | None = None  # the one that starts P without an external address
    dp_command: str | None = None  # the one that starts an engine of a DP deployment
    attempt_timeout: float = 1.0  # P's VLLM_MOONCAKE_CONNECTOR_TIMEOUT where attempts time out
    start_timeout: float = 60.0  # from P's start to its first registration, or to its health
    tp: int | None = None  # P's sizes, when its registrations do not carry them (legacy)
    pp: int | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT


def check_template(template: str, own: bool = False, dp: bool = False) -> None:
    """``ValueError`` unless ``template`` is a command line using only known placeholders
    (``own``: those of the template that starts P without an external address; ``dp``: those
    of the template that starts an engine of a data-parallel deployment)."""
    check(template, DP_PLACEHOLDERS if dp else OWN_PLACEHOLDERS if own else PLACEHOLDERS, "P")


def reference_options(
    env: dict[str, str] | None = None, request_timeout: float = DEFAULT_REQUEST_TIMEOUT
) -> RegistrationOptions:
    """The reference P, ``env`` added to its environment."""
    return RegistrationOptions(
        with_env(REFERENCE_COMMAND, env or {}),
        own_command=with_env(REFERENCE_OWN_COMMAND, env or {}),
        dp_command=with_env(REFERENCE_DP_COMMAND, env or {}),
        request_timeout=request_timeout,
    )


@dataclasses.dataclass
class Deployment:
    """One P started for a case, and the bootstrap server it registers at."""

    registrar: Registrar
    process: TemplateProcess
    api: str  # P's API, whose /health says it started
    #: VLLM_MOONCAKE_BOOTSTRAP_PORT: where P serves its own bootstrap server, which it must not
    #: with an external address (4.4-R11)
    own_bootstrap_port: int
    started: float  # when P was started (monotonic)

    def output(self) -> str:
        return self.process.output()

    async def close(self) -> None:
        await self.process.stop()
        await self.registrar.stop()


class RegistrationCtx:
    """What a registration case works with: ``deploy`` starts its P."""

    def __init__(self, options: RegistrationOptions, log: WireLog) -> None:
        self.options = options
        self.log = log
        self._deployments: list[Deployment] = []
        self._dp_deployments: list[DpDeployment] = []

    async def deploy(
        self,
        script: Script,
        *,
        attempt_timeout: float = RELAXED_TIMEOUT,
        with_port: bool = True,
        own: bool = False,
    ) -> Deployment:
        """A scripted bootstrap server and P, started from the template pointed at it, with
        ``attempt_timeout`` as its VLLM_MOONCAKE_CONNECTOR_TIMEOUT; ``with_port`` False gives
        P an address without a port (4.4-R12); ``own`` starts P from the template without an
        external address (the case is skipped when the run has none), so that it serves its
        own bootstrap server."""
        template = self.options.command
        if own:
            what = "the command that starts P without an external bootstrap address"
            template = given(self.options.own_command, what, "--own-command")
        registrar = Registrar(script, self.log)
        await registrar.start()
        port, own_port = free_port(), free_port()
        address = registrar.host_port if with_port else PORTLESS_HOST
        values = {
            "python": sys.executable,
            "port": str(port),
            "bootstrap_address": address,
            "bootstrap_url": f"http://{address}",
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": str(registrar.port) if with_port else "",
        }
        env = _p_env(attempt_timeout, own_port)
        process = TemplateProcess("P", fill(template, values, "P"), env, self.log)
        deployment = Deployment(
            registrar, process, f"http://127.0.0.1:{port}", own_port, time.monotonic()
        )
        self._deployments.append(deployment)
        await process.spawn()
        return deployment

    async def deploy_dp(self, place: DpPlace, listen: Sequence[str]) -> DpDeployment:
        """An engine of a data-parallel deployment, started from the DP template (the case is
        skipped when the run has none), and a scripted bootstrap server that accepts every
        registration at each address of ``listen``, all on the port that P is given as
        VLLM_MOONCAKE_BOOTSTRAP_PORT."""
        what = "the command that starts an engine of a data-parallel deployment"
        template = given(self.options.dp_command, what, "--dp-command")
        registrars, port = await _listen_on_one_port(listen, self.log)
        deployment = DpDeployment(registrars, port)
        self._dp_deployments.append(deployment)
        values = {
            "python": sys.executable,
            "port": str(free_port()),
            "dp_index": str(place.index),
            "dp_local_rank": str(place.local_rank),
            "dp_load_balancing": place.load_balancing,
            "dp_master_ip": place.master_ip,
            "master_addr": place.master_addr,
            "dp_nodes": str(place.nodes),
        }
        env = _p_env(RELAXED_TIMEOUT, port)
        deployment.process = TemplateProcess("P", fill(template, values, "P"), env, self.log)
        await deployment.process.spawn()
        return deployment

    async def close(self) -> None:
        await asyncio.gather(*(d.close() for d in self._deployments))
        await asyncio.gather(*(d.close() for d in self._dp_deployments))
        self._deployments.clear()
        self._dp_deployments.clear()


@dataclasses.dataclass(frozen=True)
class DpPlace:
    """An engine's place in a data-parallel deployment, as the DP template's placeholders
    give it."""

    index: int
    local_rank: int
    load_balancing: str  # internal, hybrid or external
    master_ip: str  # vLLM's data_parallel_master_ip
    master_addr: str  # vLLM's master_addr
    nodes: int = 1  # how many nodes one DP rank spans


@dataclasses.dataclass
class DpDeployment:
    """One engine of a DP deployment, and the scripted servers on its bootstrap port."""

    registrars: dict[str, Registrar]  # by the address each listens on
    port: int  # VLLM_MOONCAKE_BOOTSTRAP_PORT
    process: TemplateProcess | None = None

    async def close(self) -> None:
        """Stop the engine and the servers; once only."""
        process, self.process = self.process, None
        registrars, self.registrars = self.registrars, {}
        if process is not None:
            await process.stop()
        await asyncio.gather(*(r.stop() for r in registrars.values()))


#: How many ports ``_listen_on_one_port`` tries before it gives up.
PORT_TRIES: Final = 20


async def _listen_on_one_port(
    hosts: Sequence[str], log: WireLog
) -> tuple[dict[str, Registrar], int]:
    """Accepting scripted servers on one port at every address of ``hosts`` (none: only a free
    port), and that port."""
    for _ in range(PORT_TRIES):
        port = free_port()
        started: dict[str, Registrar] = {}
        try:
            for host in hosts:
                registrar = Registrar(Script("accept"), log)
                await registrar.start(host, port)
                started[host] = registrar
            return started, port
        except OSError:
            await asyncio.gather(*(r.stop() for r in started.values()))
    raise RuntimeError(f"no port free at every address of {', '.join(hosts)}")


def _p_env(attempt_timeout: float, own_port: int) -> dict[str, str]:
    """P's environment: the bound on each registration attempt, and the port of the bootstrap
    server P would serve itself."""
    return {
        **os.environ,
        "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
        "VLLM_MOONCAKE_CONNECTOR_TIMEOUT": str(attempt_timeout),
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(own_port),
    }


class RegistrationEnv:
    """The suite's shared world: none, since each case starts a P and a server of its own."""

    def __init__(self, options: RegistrationOptions) -> None:
        check_template(options.command)
        if options.own_command is not None:
            check_template(options.own_command, own=True)
        if options.dp_command is not None:
            check_template(options.dp_command, dp=True)
        self.options = options

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def run_registration(
    options: RegistrationOptions,
    cases: Sequence[Case],
    run_options: RunOptions,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """The registration cases of ``cases``, side by side; results in the cases' order."""
    env = RegistrationEnv(options)
    chosen = [c for c in cases if c.suite is Suite.REGISTRATION]

    async def one(c: Case) -> Result:
        result = await run_case(c, lambda log: RegistrationCtx(env.options, log), run_options)
        if on_result is not None:
            on_result(result)
        return result

    return list(await asyncio.gather(*(one(c) for c in chosen)))
