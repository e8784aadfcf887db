"""The consumer suite's world: the harness is P (and P's bootstrap server) of a D under test.

``ConsumerEnv`` is opened once per run: it learns D's model and starts the harness's transfer
engine and the random bytes fake P's write from. Each case gets a ``ConsumerCtx``: fake P's
(``fake_p``) with the /query entry the case wants, D legs (``start``) whose kv_transfer_params
point at them, D's next message at a fake P (``pull``), and D's own local text (``local``).
Everything a case starts is stopped after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import zmq.asyncio

from pdwire.negotiation import Offer
from pdwire.planning import target_ranks
from pdwire.versions import Capability

from ..case import Case, CaseFailed, Skip, Suite, Unsupported, WireLog, case, expect, given
from ..command import TemplateProcess, fill
from ..peers.engine import Engine
from ..peers.fake_p import DEFAULT_CAPS, FakeP, FakePConfig, Received, Source
from ..peers.http import HttpResult, client, request, request_id, transfer_id
from ..ports import free_port
from ..runner import DEFAULT_REQUEST_TIMEOUT, Result, RunOptions, run_suite

DECODE_KEYS: Final = ("remote_bootstrap_addr", "remote_engine_id", "transfer_id")
QUIET: Final = 0.3  # how long to watch for something that must not arrive
FAST: Final = 2.5  # "at once": a failure that needs no wait on P comes within this
#: Long enough that each wait of a case for D (``request_timeout``) ends first, and says what
#: the case waited for.
CASE_TIMEOUT: Final = 60.0
#: Those of ``ConsumerOptions.d_command``.
D_PLACEHOLDERS: Final = ("python", "port")
#: How long a D started from ``d_command`` may take to answer ``/health`` (as long as
#: ``pdwire conformance self`` gives its own testees).
D_START_S: Final = 120.0


@dataclasses.dataclass(frozen=True)
class ConsumerOptions:
    api: str  # D's OpenAI API, e.g. http://127.0.0.1:8200
    model: str | None = None  # default: the first model of /v1/models
    abort_timeout: float | None = None  # D's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, when known
    receive_timeout: float | None = None  # D's receive timeout per pull, when known
    kv_lease_duration: float | None = None  # D's lease (§6.4), when known; 0: D has none
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT  # the longest wait for any one answer of D
    block_size: int | None = None  # D's KV block size; default: from its fingerprint
    host: str = "127.0.0.1"  # where the fake P's listen and write from: reachable from D
    vocab: int = 1000  # prompts use token ids in [1, vocab)
    prompt_tokens: int = 18  # not a multiple of common block sizes
    max_tokens: int = 4
    auth_key: bytes | None = None  # the key D shares (§8.6): the fake P's sign their replies
    #: the command line that starts a D of the harness's own, for the cases that restart D
    #: (placeholders ``D_PLACEHOLDERS``)
    d_command: str | None = None
    sliding_window: int | None = None  # the window of D's KV-cache group 1, when it has one


#: What a completion request asks for so that its answer has all of ``HttpResult.output``.
OUTPUT_BODY: Final = {"return_token_ids": True, "logprobs": 1}
#: Log probabilities this close are taken as one computation's: a recompute of the same prompt
#: in another batch may move them a little, KV that is not the prompt's moves them far.
LOGPROB_TOLERANCE: Final = 0.01

Output = tuple[str, list[int] | None, list[float] | None]


def same_output(a: Output, b: Output) -> bool:
    """Whether two answers (``HttpResult.output``) are one computation's: the same text and
    token ids, and log probabilities within ``LOGPROB_TOLERANCE`` of each other."""
    (text_a, ids_a, lp_a), (text_b, ids_b, lp_b) = a, b
    if text_a != text_b or ids_a != ids_b:
        return False
    if lp_a is None or lp_b is None:
        return lp_a == lp_b
    return len(lp_a) == len(lp_b) and all(
        x == y or (x is not None and y is not None and abs(x - y) <= LOGPROB_TOLERANCE)
        for x, y in zip(lp_a, lp_b, strict=True)
    )


class ConsumerEnv:
    """What every consumer case shares: D's address and model, the harness's engine, sockets
    and source bytes, and what a first exchange showed of D's version."""

    def __init__(self, options: ConsumerOptions) -> None:
        self.options = options
        self.http = client(options.request_timeout)
        self.zmq = zmq.asyncio.Context()
        self.engine: Engine | None = None
        self.source: Source | None = None
        self.model = options.model or ""
        self.d_offer: Offer | None = None  # D's announcement, once probed
        self.winding_down: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)

    async def open(self) -> None:
        if not self.model:
            got = await request(self.http, "GET", f"{self.options.api}/v1/models", WireLog())
            try:
                self.model = str(got.body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise RuntimeError(
                    f"GET {self.options.api}/v1/models named no model "
                    f"(HTTP {got.status} {got.error or got.body!r}): is D up?"
                ) from None
        self.engine = Engine(self.options.host)
        self.source = Source(self.engine)

    async def close(self) -> None:
        if self.winding_down:
            await asyncio.wait(self.winding_down, timeout=10.0)
        await self.http.aclose()
        self.zmq.destroy(linger=0)
        if self.engine is not None:
            self.engine.close()

    def next_id(self) -> int:
        return next(self._ids)

    async def serving(self) -> str | None:
        """Whether D still serves (``runner.Probe``): a plain request from a new fake P is
        pulled, served and answered within the run's wait."""
        t = ConsumerCtx(self, WireLog())
        try:
            fake = await t.fake_p()
            leg = t.start(fake)
            await t.serve_until_done(fake, [leg])
            got = await leg.result()
        except CaseFailed as exc:
            return f"a plain request to D did not complete: {exc.detail}"
        finally:
            await t.close()
        if got.status == 0:
            return f"D did not answer a plain request ({got.error})"
        if not got.ok:
            return f"D answered a plain request with HTTP {got.status} {got.body!r}"
        return None


@dataclasses.dataclass
class Leg:
    """One D leg sent: its prompt, transfer_id and kv_transfer_params, and D's answer."""

    prompt: list[int]
    transfer_id: str
    params: dict[str, Any] | None
    task: asyncio.Task[HttpResult]
    sent: float  # monotonic time it was sent

    async def result(self) -> HttpResult:
        return await self.task


class ConsumerCtx:
    """One consumer case's view of the world."""

    def __init__(self, env: ConsumerEnv, log: WireLog) -> None:
        self.env = env
        self.log = log
        self.options = env.options
        self.api = env.options.api  # the D the case's requests go to (``own_d`` changes it)
        self._fakes: list[FakeP] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._own: TemplateProcess | None = None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own is not None:
            await self._own.stop()
        for fake in self._fakes:
            winding = fake.stop()
            if winding is not None:
                self.env.winding_down.add(winding)
                winding.add_done_callback(self.env.winding_down.discard)

    async def own_d(self) -> None:
        """Start a D of the case's own from the run's ``d_command`` (the case is skipped
        without one), stopping the one it started before; the case's requests go to it."""
        what = "the command that starts a D"
        template = given(self.options.d_command, what, "--d-command")
        if self._own is not None:
            await self._own.stop()
        port = free_port()
        values = {"python": sys.executable, "port": str(port)}
        env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        self._own = TemplateProcess("D", fill(template, values, "D"), env, self.log)
        self.api = f"http://127.0.0.1:{port}"
        await self._own.spawn()
        until = time.monotonic() + D_START_S
        await self._own.wait_listening(self.api, D_START_S)
        healthy = await self._own.wait_answer(f"{self.api}/health", until, http=self.env.http)
        expect(healthy is not None, f"D did not answer /health within {D_START_S}s")
        self.log.note(f"D started from the --d-command template at {self.api}")

    # -- fake P's ----------------------------------------------------------------------------

    async def fake_p(self, **config: Any) -> FakeP:
        """A started fake P (``FakePConfig`` fields as keywords)."""
        assert self.env.engine is not None and self.env.source is not None
        key = self.options.auth_key
        if key is not None and "auth_key" not in config:
            config["auth_key"] = key
            config["caps"] = config.get("caps", DEFAULT_CAPS) | {Capability.AUTH}
        fake = FakeP(
            FakePConfig(**config),
            ctx=self.env.zmq,
            engine=self.env.engine,
            source=self.env.source,
            log=self.log,
            host=self.options.host,
        )
        self._fakes.append(fake)
        return await fake.start()

    async def pull(
        self,
        fake: FakeP,
        timeout: float | None = None,
        *,
        kind: str = "pull",
        match: Callable[[Received], bool] | None = None,
        what: str = "pull",
    ) -> Received:
        """D's next message of ``kind`` at ``fake``; fails the case when none comes in time,
        or when it cannot be decoded."""
        wait = timeout if timeout is not None else self.options.request_timeout

        def wanted(rx: Received) -> bool:
            return rx.kind == kind and (match is None or match(rx))

        rx = await fake.next(wait, wanted)
        if rx is None:
            raise CaseFailed(f"no {what} from D reached the fake P within {wait:.1f}s")
        expect(rx.error is None, f"D sent {rx.describe()}")
        return rx

    async def quiet(self, fake: FakeP, window: float = QUIET) -> Received | None:
        """Watch ``fake`` for ``window`` seconds: the first message that arrived, if any."""
        return await fake.next(window)

    # -- D legs ------------------------------------------------------------------------------

    def prompt(self, tokens: int | None = None) -> list[int]:
        n = tokens or self.options.prompt_tokens
        k = self.env.next_id()
        span = max(2, self.options.vocab - 1)
        return [1 + (k * 7919 + i * 104729) % span for i in range(n)]

    def params(
        self, fake: FakeP, transfer: str, *, drop: Sequence[str] = (), **extra: Any
    ) -> dict[str, Any]:
        """The D leg's kv_transfer_params (§5.2) pointing at ``fake``."""
        kv: dict[str, Any] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": fake.url,
            "remote_engine_id": fake.engine_id,
            "transfer_id": transfer,
        }
        for key in drop:
            kv.pop(key, None)
        kv.update(extra)
        return kv

    async def complete(
        self,
        prompt: list[int],
        params: dict[str, Any] | None,
        *,
        timeout: float | None = None,
        **body: Any,
    ) -> HttpResult:
        payload: dict[str, Any] = {
            "model": self.env.model,
            "prompt": prompt,
            "max_tokens": self.options.max_tokens,
            "stream": False,
            **body,
        }
        if params is not None:
            payload["kv_transfer_params"] = params
        return await request(
            self.env.http,
            "POST",
            f"{self.api}/v1/completions",
            self.log,
            body=payload,
            headers={"X-Request-Id": request_id()},
            timeout=timeout if timeout is not None else self.options.request_timeout,
        )

    def start(
        self,
        fake: FakeP,
        *,
        prompt: list[int] | None = None,
        transfer: str | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        body: dict[str, Any] | None = None,
        **extra: Any,
    ) -> Leg:
        """Send D the D leg of a new request for ``fake``'s engine; D answers in the
        background (``Leg.result``). ``body`` adds to the completion request's body, ``extra``
        to its kv_transfer_params."""
        ids = prompt or self.prompt()
        tid = transfer or transfer_id()
        kv = params if params is not None else self.params(fake, tid, **extra)
        task = asyncio.create_task(self.complete(ids, kv, timeout=timeout, **(body or {})))
        self._tasks.append(task)
        return Leg(ids, tid, kv, task, time.monotonic())

    async def local(self, prompt: list[int]) -> str:
        """D's own text for ``prompt``: no kv_transfer_params (its prefix cache kept apart)."""
        return (await self._local(prompt)).text()

    async def local_output(self, prompt: list[int]) -> Output:
        """D's own output (``HttpResult.output``, asked with ``OUTPUT_BODY``) for ``prompt``."""
        return (await self._local(prompt, **OUTPUT_BODY)).output()

    async def _local(self, prompt: list[int], **body: Any) -> HttpResult:
        got = await self.complete(prompt, None, cache_salt=f"pdwire-local-{request_id()}", **body)
        expect(got.ok, f"D's local request failed: HTTP {got.status} {got.error or got.body!r}")
        return got

    # -- what D did --------------------------------------------------------------------------

    def expect_decoded(self, got: HttpResult, what: str = "D") -> None:
        expect(
            got.ok,
            f"{what}: expected HTTP 200, got {got.status} {got.error or got.body!r}",
        )

    def expect_failed(self, got: HttpResult, what: str = "the request") -> None:
        """Under the load-failure policy ``fail`` (the default), a failed load is an HTTP error."""
        expect(
            got.status != 0,
            f"{what}: D did not answer ({got.error}); expected an HTTP error",
        )
        expect(
            got.status >= 400,
            f"{what}: expected an HTTP error (the load failed), got HTTP {got.status} with "
            f"text {got.text()!r}: D decoded anyway, or recomputed the prompt",
        )

    async def pull_of(self, fake: FakeP, leg: Leg, timeout: float | None = None) -> Received:
        """D's next pull at ``fake`` that names ``leg``'s transfer: a late pull for a request
        of an earlier leg is not taken for it."""
        return await self.pull(fake, timeout, match=lambda r: names(r, leg.transfer_id))

    async def serve_leg(self, fake: FakeP, leg: Leg) -> Received:
        """D's pull for ``leg``, served with written bytes and FINISH."""
        rx = await self.pull_of(fake, leg)
        await fake.serve(rx)
        return rx

    async def pulls(self, fake: FakeP, leg: Leg, count: int, had: int = 0) -> list[Received]:
        """The next ``count`` pulls for ``leg`` at ``fake`` (after ``had`` taken), in order."""
        return [
            await self.pull(
                fake,
                match=lambda r: names(r, leg.transfer_id),
                what=f"pull {had + i + 1} (of the {had + count} the request needs)",
            )
            for i in range(count)
        ]

    async def all_pulls(self, fake: FakeP, leg: Leg) -> list[Received]:
        """Every pull D sends ``fake`` for ``leg``: as many as the TP and PP sizes of both sides
        make (§10.1, §10.2), those of the first pull giving D's."""
        first = await self.pull_of(fake, leg)
        assert first.pull is not None
        c = fake.config
        count = paired_pulls(c.tp, c.pp, first.pull.remote_tp_size, first.pull.remote_pp_size)
        return [first, *await self.pulls(fake, leg, count - 1, had=1)]

    async def serve_until_done(
        self, fake: FakeP, legs: Sequence[Leg], timeout: float | None = None
    ) -> list[Received]:
        """Serve every pull that comes to ``fake`` until D has answered every leg."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else self.options.request_timeout)
        answers = asyncio.ensure_future(asyncio.wait([leg.task for leg in legs]))
        served: list[Received] = []
        try:
            while not answers.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise CaseFailed(
                        f"D did not answer within the wait; it sent {len(served)} pulls"
                    )
                nxt = asyncio.ensure_future(fake.next(left, lambda r: r.kind == "pull"))
                await asyncio.wait([nxt, answers], return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    continue
                rx = nxt.result()
                if rx is not None:
                    expect(rx.error is None, f"D sent {rx.describe()}")
                    await fake.serve(rx)
                    served.append(rx)
        finally:
            answers.cancel()
        return served

    # -- what is known of D ------------------------------------------------------------------

    async def d_announcement(self) -> Offer:
        """D's version and capabilities as its pull to a pdwire/2 P shows them (once a run)."""
        if self.env.d_offer is None:
            fake = await self.fake_p()
            leg = self.start(fake)
            rx = await self.pull(fake)
            await fake.serve(rx)
            await leg.result()
            assert rx.pull is not None
            self.env.d_offer = Offer(rx.pull.pdwire_version, frozenset(rx.pull.pdwire_caps))
            self.log.note(f"D announces {self.env.d_offer}")
        return self.env.d_offer

    async def require_pdwire2(self, *caps: str) -> Offer:
        """Unsupported unless D announces pdwire/2 (with ``caps``) to a pdwire/2 P."""
        offer = await self.d_announcement()
        if offer.version < 2:
            raise Unsupported("D does not announce pdwire/2 (a legacy D)")
        missing = [c for c in caps if c not in offer.caps]
        if missing:
            raise Unsupported(f"D does not announce the capabilities {missing}")
        return offer

    @property
    def auth_key(self) -> bytes:
        """The key D shares; skips the case when the run was not given one."""
        return given(self.options.auth_key, "D's shared key", "--auth-key-file")

    def require_lease(self) -> float:
        """D's kv_lease_duration; skips the case when the run was not told it, unsupported when
        D has none."""
        lease = given(
            self.options.kv_lease_duration, "D's kv_lease_duration", "--kv-lease-duration"
        )
        if not lease:
            raise Unsupported("D has no kv_lease_duration (§6.4)")
        return lease

    @property
    def receive_timeout(self) -> float:
        """D's receive timeout per pull; skips the case when the run was not told it."""
        if self.options.receive_timeout is not None:
            return self.options.receive_timeout
        if self.options.abort_timeout is not None:
            return self.options.abort_timeout + 60.0
        raise Skip("D's receive timeout is unknown: pass --receive-timeout or --abort-timeout")

    def block_size(self, rx: Received) -> int | None:
        if self.options.block_size:
            return self.options.block_size
        if rx.pull is not None and rx.pull.fingerprint is not None:
            return rx.pull.fingerprint.block_size
        return None


async def run_consumer(
    options: ConsumerOptions,
    cases: Sequence[Case],
    run_options: RunOptions,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    env = ConsumerEnv(options)
    return await run_suite(
        env, Suite.CONSUMER, lambda log: ConsumerCtx(env, log), cases, run_options, on_result
    )


CaseFunc = Callable[["ConsumerCtx"], Awaitable[None]]


def consumer_case(case_id: str, requirement: str, **kw: Any) -> Callable[[CaseFunc], CaseFunc]:
    """``case``, with the consumer suite's timeout unless the case gives its own."""
    kw.setdefault("timeout", CASE_TIMEOUT)
    return case(case_id, requirement, **kw)


def names(rx: Received, transfer: str) -> bool:
    """Whether ``rx`` is a pull that names the request of ``transfer``."""
    return rx.pull is not None and any(t == transfer for t, _ in rx.pull.req_blocks.values())


def paired_pulls(p_tp: int, p_pp: int, d_tp: int, d_pp: int) -> int:
    """How many pulls a D of TP ``d_tp`` and PP ``d_pp`` sends a P of TP ``p_tp`` and PP ``p_pp``
    for one request (§10.1, §10.2)."""
    per_stage = sum(len(target_ranks(d_tp, r, p_tp)) for r in range(d_tp))
    return per_stage * (d_pp if d_pp == p_pp else d_pp * p_pp)
