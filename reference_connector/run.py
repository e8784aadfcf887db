"""``pdwire run``: a whole P/D deployment on loopback, driven and checked byte by byte.

Order of start-up, everything on 127.0.0.1 with ports picked at run time, everything stopped
in a ``finally`` (also on Ctrl-C):

1. the P node (``NodeServer``, role prefill), **serving its own bootstrap server**. That is how
   vLLM's MooncakeConnector deploys it (the P engine hosts the bootstrap server on
   ``VLLM_MOONCAKE_BOOTSTRAP_PORT``), so the bootstrap lives and dies with P, its port is the
   one P registered at, and there is one process fewer to start, watch and stop;
2. the D node (role decode);
3. the proxy (``ProxyServer``), then ``wait_ready``: P's ``/health`` and an engine at P's
   bootstrap server.

The requests are streamed completions through the proxy (``/v1/completions``, greedy,
``concurrency`` at once). Each prompt is ``prompt_tokens`` words drawn from an RNG seeded with
``(seed, request index)`` (the node tokenizes one word to one token). A request counts as
verified only if

- the text streamed through the proxy equals ``expected_text``: ``kv_values.
  reference_completion`` computed **in this process** (in threads, while the nodes start), a
  computation that shares no state with the nodes; and
- D's final chunk says ``pdwire.verified`` true with ``bytes_verified`` equal to the prompt's KV
  bytes on D (every whole block of the prompt, over every layer, K and V and head).

TTFT split of one request, in ms. ``t`` are ``time.perf_counter()`` readings of this process,
which runs the client, the proxy and both nodes' front ends (the nodes' workers are child
processes; only durations come from them). ``P.*`` and ``D.*`` are the ``pdwire.timings_ms``
the nodes report in their responses. The proxy answers with D's response only, so P's is read
where it reaches the proxy: a response hook on the proxy's HTTP client to P (``LegTap``), which
also times the arrival of both legs' responses at the proxy::

    TTFT      = t(first data chunk at the client) - t(request sent by the client)
    P_ready   = t(P's response reached the proxy)     P answers once its workers have the
                                                      finished transfer: its KV is ready
    D_loaded  = t(D's response headers reached the proxy) - D.verify
                                                      D answers once loaded and verified
    transfer  = clamp(D_loaded - P_ready, 0, D.load)
    P prefill = min(P.prefill, D.load - transfer)
    wait      = D.load - transfer - P prefill         D waiting for P beyond P's prefill: the P
                                                      leg's trip, P's queue, the pull round trip
    D         = D.queue + D.verify
    first step = D.first_step                         D computing the first token
    proxy     = TTFT - (D.queue + D.load + D.verify + D.first_step)
                                                      the client-proxy-D hops and the relay

so ``proxy + P prefill + wait + transfer + D + first step = TTFT``. ``transfer`` also holds
the HTTP hop of each of the two responses (well under a millisecond on loopback); the tax
(``run_tax``) times P's write and D's pull apart from the hops, and the overhead of the whole.

Throughput. ``transfer_gbps`` = bytes P wrote (P's ``/pdwire/stats``, summed over its workers,
after minus before the requests) / the sum of the requests' ``transfer`` times. Descriptors per
request: P's descriptor count the same way, over the number of requests. ``raw_engine_gbps``:
after the requests, two ``MooncakeTransport``\\ s in this process, one registered buffer each of a
request's bytes, and ``raw_write`` of one request's descriptors (their count, each of the mean
size) from one to the other, ``raw_repeats`` times; the median call counts (``RawResult``). One
batch from one engine: with P's TP or PP above 1 the run wrote a request from several engines
at once.
GB and MB are 10**9 and 10**6 bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import random
import statistics
import string
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, TextIO

import httpx
import numpy as np

from pdwire.http_models import CLIENT_KEEPALIVE_S
from pdwire.roles import Role
from pdwire.versions import PDWIRE_2, Profile

from .http_tls import client_tls
from .kv_content import KVShape, render, tokenize
from .kv_values import reference_completion
from .node import NodeConfig
from .node_api import NodeServer
from .proxy import Prefill, Proxy, ProxyServer
from .run_tax import WRITE_TARGET, Tax, overhead_ms, write_gbps, write_ms
from .worker_spec import WorkerStart

logger = logging.getLogger(__name__)

MODEL: Final = "pdwire-synthetic"
SPLIT_KEYS: Final = ("proxy", "p_prefill", "wait", "transfer", "d", "first_step")
NOT_MEASURED: Final = (
    "'transfer' also holds the HTTP hop of P's and of D's response to the proxy "
    "('P write' and 'D pull' do not)",
)
_SETTLE_S: Final = 10.0  # how long P may take to free the blocks of the last transfers
_PROMPT_ATTEMPTS: Final = 20
_LETTERS: Final = string.ascii_lowercase


class RunError(RuntimeError):
    """The deployment could not start or be measured; the message says which part and why."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What ``pdwire run`` runs; the defaults are the seeds' case (Qwen3-8B KV, 1P1D)."""

    requests: int = 8
    concurrency: int = 2
    prompt_tokens: int = 1000
    max_tokens: int = 128
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_pp: int = 1
    decode_pp: int = 1
    profile: Profile = PDWIRE_2
    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 0  # blocks per worker pool; 0: enough for 2 x concurrency requests
    seed: int = 0
    raw_repeats: int = 9
    start_timeout: float = 120.0  # each node, and the proxy's readiness
    request_timeout: float = 300.0
    prefill_agent: str = ""  # the P workers' agent factory (MODULE:CALLABLE); "" = pdwire's
    decode_agent: str = ""  # the D workers' agent factory; "" = pdwire's
    abort_timeout: float = 480.0  # both nodes' T (§6)
    receive_timeout: float | None = None  # D's, per pull; None = abort_timeout + 60
    kv_lease_duration: float | None = None  # both nodes' lease (§6.4); None = no lease
    worker_start: WorkerStart = "spawn"  # how both nodes start their workers (node_worker)

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "prompt_tokens", "max_tokens", "raw_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be 0 (automatic) or more, got {self.num_blocks}")
        shape = self.shape()  # checks the geometry
        shape.check_split(self.prefill_tp, self.prefill_pp)
        shape.check_split(self.decode_tp, self.decode_pp)
        need = shape.blocks_for(self.prompt_tokens + self.max_tokens)
        if shape.num_blocks < need:
            raise ValueError(
                f"num_blocks {shape.num_blocks} cannot hold one request ({need} blocks of "
                f"{self.block_size} tokens for {self.prompt_tokens} + {self.max_tokens})"
            )

    def shape(self) -> KVShape:
        per_request = -(-(self.prompt_tokens + self.max_tokens) // self.block_size)
        return KVShape(
            num_layers=self.layers,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            num_blocks=self.num_blocks or 2 * self.concurrency * per_request,
        )

    def describe(self) -> str:
        agents = "".join(
            f", {side} agent {name}"
            for side, name in (("P", self.prefill_agent), ("D", self.decode_agent))
            if name
        )
        return (
            f"1P (TP{self.prefill_tp} PP{self.prefill_pp}) -> 1D (TP{self.decode_tp} "
            f"PP{self.decode_pp}), {self.profile}{agents}, {self.requests} requests x "
            f"{self.prompt_tokens} prompt tokens, max_tokens {self.max_tokens}, concurrency "
            f"{self.concurrency}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "num_blocks": self.shape().num_blocks}


# -- the workload ----------------------------------------------------------------------------


def make_prompt(seed: int, index: int, tokens: int, attempt: int = 0) -> str:
    """``tokens`` words drawn from an RNG seeded with (seed, index, attempt)."""
    rng = random.Random(f"pdwire-run/{seed}/{index}/{attempt}")
    return " ".join("".join(rng.choices(_LETTERS, k=rng.randint(2, 9))) for _ in range(tokens))


def expected_text(shape: KVShape, prompt: str, max_tokens: int) -> str:
    """The completion every correct deployment streams for ``prompt``: the node's decoding
    computed here from scratch, in one slice (``kv_values.reference_completion``)."""
    return render(reference_completion(shape, tokenize(prompt, shape.vocab), max_tokens))


def prompt_kv_bytes(shape: KVShape, prompt_tokens: int) -> int:
    """The KV bytes of a prompt's whole blocks, over every layer, K and V, and head."""
    per_block = shape.num_layers * 2 * shape.num_kv_heads * shape.block_size * shape.channels
    return shape.blocks_for(prompt_tokens) * per_block * shape.torch_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    request_id: str
    prompt: str
    expected: str


def make_case(config: RunConfig, index: int) -> Case:
    """Request ``index``: its prompt and expected text. A prompt whose first token would be the
    stop token is drawn again (P would have no KV to send: a load failure, not a run)."""
    shape = config.shape()
    for attempt in range(_PROMPT_ATTEMPTS):
        prompt = make_prompt(config.seed, index, config.prompt_tokens, attempt)
        text = expected_text(shape, prompt, config.max_tokens)
        if text:
            return Case(index, f"pdwire-run-{config.seed}-{index}", prompt, text)
    raise RunError(f"request {index}: {_PROMPT_ATTEMPTS} prompts in a row decode nothing")


# -- progress on stderr ----------------------------------------------------------------------


class Progress:
    """Progress lines with elapsed seconds, and a request bar: redrawn with ``\\r`` on a
    terminal, else one line per request."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def line(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", file=self.stream, flush=True)

    def request(self, done: int, total: int, failed: int, what: str, ok: bool = True) -> None:
        if self.tty and not ok:  # on a terminal, a failure gets its own line above the bar
            print("\r\033[K", end="", file=self.stream)
        if not self.tty or not ok:
            self.line(f"request {done}/{total} {what}")
        if not self.tty:
            return
        width = 30
        full = width * done // total
        bar = "#" * full + "." * (width - full)
        end = "\n" if done == total else ""
        text = f"\r[{self.elapsed():6.1f}s] [{bar}] {done}/{total}, {failed} failed"
        print(text, end=end, file=self.stream, flush=True)


@contextlib.contextmanager
def step(progress: Progress, what: str) -> Iterator[None]:
    progress.line(f"{what}...")
    t0 = time.perf_counter()
    yield
    progress.line(f"{what}: done in {time.perf_counter() - t0:.1f}s")


# -- the deployment --------------------------------------------------------------------------


@dataclasses.dataclass
class Legs:
    """What the proxy saw of one request's legs (``time.perf_counter`` readings)."""

    p_answered: float | None = None
    p_timings: dict[str, float] | None = None
    d_answered: float | None = None


class LegTap:
    """Response hooks on the proxy's HTTP clients to P and to D: when each leg's response
    reached the proxy, and the ``pdwire.timings_ms`` of P's response, which the proxy does not
    pass on. The hooks run on the proxy's event loop; they never raise into it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._legs: dict[str, Legs] = {}

    def install(self, proxy: Proxy, prefill_url: str, decode_url: str) -> None:
        for url, hook in ((prefill_url, self._on_prefill), (decode_url, self._on_decode)):
            client = proxy.clients[url]
            hooks = client.event_hooks
            client.event_hooks = {**hooks, "response": [*hooks.get("response", []), hook]}

    def legs(self, request_id: str) -> Legs:
        with self._lock:
            return dataclasses.replace(self._legs.get(request_id, Legs()))

    def _leg(self, response: httpx.Response) -> Legs | None:
        rid = response.request.headers.get("x-request-id")
        if response.request.method != "POST" or rid is None:
            return None
        with self._lock:
            return self._legs.setdefault(rid, Legs())

    async def _on_prefill(self, response: httpx.Response) -> None:
        now = time.perf_counter()
        try:
            leg = self._leg(response)
            if leg is None:
                return
            await response.aread()  # the proxy reads it whole anyway
            body = response.json() if response.is_success else None
            timings = body.get("pdwire", {}).get("timings_ms") if isinstance(body, dict) else None
            with self._lock:
                leg.p_answered = now
                leg.p_timings = timings if isinstance(timings, dict) else None
        except Exception:
            logger.exception("tap on the P leg failed")

    async def _on_decode(self, response: httpx.Response) -> None:
        now = time.perf_counter()
        leg = self._leg(response)
        if leg is not None:
            with self._lock:
                leg.d_answered = now


class Deployment:
    """P (with its bootstrap server), D and the proxy, in that order, on 127.0.0.1."""

    def __init__(self, config: RunConfig, progress: Progress) -> None:
        self.config = config
        self.progress = progress
        self.prefill: NodeServer | None = None
        self.decode: NodeServer | None = None
        self.proxy: ProxyServer | None = None
        self.tap = LegTap()

    def _node(self, role: Role, tp: int, pp: int) -> NodeServer:
        c = self.config
        name = "P" if role == "prefill" else "D"
        extra = " with its bootstrap server" if role == "prefill" else ""
        agent = c.prefill_agent if role == "prefill" else c.decode_agent
        if agent:
            extra += f", agent {agent}"
        node = NodeServer(
            NodeConfig(
                role=role,
                shape=c.shape(),
                tp_size=tp,
                pp_size=pp,
                bootstrap_port=0,
                profile=c.profile,
                model=MODEL,
                load_timeout=c.request_timeout,
                start_timeout=c.start_timeout,
                agent=agent,
                abort_timeout=c.abort_timeout,
                receive_timeout=c.receive_timeout,
                kv_lease_duration=c.kv_lease_duration,
                worker_start=c.worker_start,
            )
        )
        if role == "prefill":
            self.prefill = node
        else:
            self.decode = node
        with step(self.progress, f"starting {name} node (TP{tp} PP{pp}){extra}"):
            node.start(port=0, timeout=c.start_timeout)
        where = f" (bootstrap {node.engine.bootstrap_url})" if role == "prefill" else ""
        self.progress.line(f"{name} node {node.engine.engine_id[:8]} at {node.url}{where}")
        return node

    def start(self) -> None:
        """P and D side by side (neither needs the other to start), then the proxy. Workers
        forked from this process start one node after the other: a fork copies only the thread
        that forks, and one node's start should not be half done in another thread then."""
        c = self.config
        if c.worker_start == "fork":
            p = self._node("prefill", c.prefill_tp, c.prefill_pp)
            d = self._node("decode", c.decode_tp, c.decode_pp)
        else:
            with concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pdwire-start"
            ) as pool:
                starting = pool.submit(self._node, "prefill", c.prefill_tp, c.prefill_pp)
                d = self._node("decode", c.decode_tp, c.decode_pp)
                p = starting.result()
        prefill = Prefill(p.url, p.engine.bootstrap_url)
        self.proxy = ProxyServer(
            [prefill],
            [d.url],
            profile=c.profile,
            client_timeout=c.request_timeout,
            poll_interval=0.1,
        )
        with step(self.progress, f"starting the proxy ({c.profile})"):
            self.proxy.start("127.0.0.1", 0, c.start_timeout)
            self.tap.install(self.proxy.proxy, prefill.url, self.proxy.proxy.decodes[0])
            try:
                self.proxy.wait_ready(c.start_timeout)
            except TimeoutError as exc:
                raise RunError(
                    f"the proxy at {self.proxy.url} waited {c.start_timeout}s for P {p.url} to "
                    f"answer /health and for P's engine at bootstrap {prefill.bootstrap}: {exc}"
                ) from None
        self.progress.line(f"proxy at {self.proxy.url}")

    def stop(self) -> None:
        """Stop the proxy, then D and P together; never raises."""
        if self.proxy is not None:
            _quietly(self.proxy.stop)
        nodes = [n for n in (self.decode, self.prefill) if n is not None]
        threads = [threading.Thread(target=_quietly, args=(n.stop,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.proxy = self.decode = self.prefill = None

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _quietly(stop: Callable[[], None]) -> None:
    try:
        stop()
    except Exception:
        logger.exception("error while stopping")


def node_stats(http: httpx.Client, node: NodeServer) -> dict[str, Any]:
    reply = http.get(f"{node.url}/pdwire/stats")
    reply.raise_for_status()
    stats: dict[str, Any] = reply.json()
    return stats


def _sum_workers(stats: dict[str, Any], key: str) -> int:
    return sum(int(w.get(key, 0)) for w in stats["workers"])


def _settled(http: httpx.Client, node: NodeServer) -> dict[str, Any]:
    """The node's stats once it holds no block (or after ``_SETTLE_S``): P frees a request's
    blocks when its agents have, a moment after D answered."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        stats = node_stats(http, node)
        if not stats["blocks_in_use"] or time.monotonic() >= deadline:
            return stats
        time.sleep(0.02)


# -- the requests ----------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """One request as the client saw it."""

    case: Case
    sent: float
    first: float | None = None  # first data chunk
    status: int = 0
    text: str = ""
    finish: str | None = None
    pdwire: dict[str, Any] | None = None
    error: str | None = None  # transport, HTTP or stream error
    why: str | None = None  # None: verified

    @property
    def verified(self) -> bool:
        return self.why is None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first is None else (self.first - self.sent) * 1000


def check(outcome: Outcome, kv_bytes: int) -> str | None:
    """Why the request does not count as verified, or None."""
    if outcome.error is not None:
        return outcome.error
    if outcome.text != outcome.case.expected:
        got, want = outcome.text.split(), outcome.case.expected.split()
        at = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), None)
        where = f"first differs at token {at}" if at is not None else "one is a prefix"
        return f"text differs from the reference ({len(got)} vs {len(want)} tokens, {where})"
    info = outcome.pdwire or {}
    if info.get("verified") is not True:
        return f"D did not verify the KV: {info.get('failure') or info or 'no pdwire object'}"
    if info.get("bytes_verified") != kv_bytes:
        return f"D verified {info.get('bytes_verified')} bytes, the prompt's KV is {kv_bytes}"
    return None


async def stream_completion(
    client: httpx.AsyncClient, url: str, config: RunConfig, out: Outcome, first_only: bool = False
) -> None:
    """Send ``out.case`` streamed and fill ``out``; with ``first_only`` the client closes the
    stream once the first data chunk has come."""
    body = {
        "model": MODEL,
        "prompt": out.case.prompt,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    headers = {"X-Request-Id": out.case.request_id}
    parts: list[str] = []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        out.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            out.error = f"HTTP {response.status_code}: {response.text[:300]}"
            return
        event, done = "message", False
        async for line in response.aiter_lines():
            if not line:
                event = "message"
                continue
            if line.startswith("event:"):
                event = line[6:].strip()
                continue
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            if out.first is None:
                out.first = time.perf_counter()
                if first_only:
                    return
            chunk = json.loads(data)
            if event == "error" or "error" in chunk:
                out.error = f"stream error: {chunk.get('error', chunk)}"
                return
            choice = chunk["choices"][0]
            parts.append(choice.get("text", ""))
            out.finish = choice.get("finish_reason") or out.finish
            if "pdwire" in chunk:
                out.pdwire = chunk["pdwire"]
        if not done:
            out.error = "the stream ended without [DONE]"
    out.text = "".join(parts)


async def _send_all(
    url: str,
    cases: Sequence[Case],
    config: RunConfig,
    kv_bytes: int,
    progress: Progress,
) -> list[Outcome]:
    semaphore = asyncio.Semaphore(config.concurrency)
    outcomes: list[Outcome] = []
    failed = 0
    limits = httpx.Limits(max_connections=config.concurrency, keepalive_expiry=CLIENT_KEEPALIVE_S)
    async with httpx.AsyncClient(
        timeout=config.request_timeout, limits=limits, verify=client_tls()
    ) as client:

        async def one(case: Case) -> None:
            nonlocal failed
            async with semaphore:
                out = Outcome(case, time.perf_counter())
                try:
                    await stream_completion(client, url, config, out)
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                    out.error = f"{type(exc).__name__}: {exc}"
            out.why = check(out, kv_bytes)
            outcomes.append(out)
            failed += not out.verified
            ttft = f"TTFT {out.ttft_ms:.0f} ms" if out.ttft_ms is not None else "no token"
            what = f"ok ({ttft})" if out.verified else f"FAILED: {out.why}"
            progress.request(
                len(outcomes), len(cases), failed, f"{case.request_id} {what}", out.verified
            )

        await asyncio.gather(*(one(case) for case in cases))
    return sorted(outcomes, key=lambda o: o.case.index)


def split_ms(outcome: Outcome, legs: Legs) -> dict[str, float] | None:
    """The TTFT split of one request (module docstring); None when a timing is missing (the
    request failed before D's KV was loaded)."""
    timings = (outcome.pdwire or {}).get("timings_ms") or {}
    ttft = outcome.ttft_ms
    if (
        ttft is None
        or legs.p_answered is None
        or legs.d_answered is None
        or legs.p_timings is None
        or not all(k in timings for k in ("queue", "load", "verify"))
        or "prefill" not in legs.p_timings
    ):
        return None
    queue, load, verify = (float(timings[k]) for k in ("queue", "load", "verify"))
    first_step = float(timings.get("first_step", 0.0))
    d_loaded = legs.d_answered - verify / 1000
    transfer = min(max((d_loaded - legs.p_answered) * 1000, 0.0), load)
    p_prefill = min(float(legs.p_timings["prefill"]), load - transfer)
    return {
        "proxy": ttft - (queue + load + verify + first_step),
        "p_prefill": p_prefill,
        "wait": load - transfer - p_prefill,
        "transfer": transfer,
        "d": queue + verify,
        "first_step": first_step,
    }


# -- the raw engine --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RawResult:
    """The raw engine's timed writes of one request's descriptors. Its speed is the median
    call's: the tax's figures are medians over the requests, and the engine's own calls spread
    by a fifth or more from one to the next here, so the best call is a luckier baseline than
    any typical one."""

    descriptors: int
    nbytes: int
    seconds: tuple[float, ...]

    @property
    def repeats(self) -> int:
        return len(self.seconds)

    @property
    def gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9

    @property
    def best_gbps(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9


def measure_raw_engine(descriptors: int, nbytes: int, repeats: int) -> RawResult:
    """Time ``repeats`` calls of ``raw_write`` of ``descriptors`` descriptors totalling
    ``nbytes`` (each of the mean size) between two transfer engines of this process. Raises
    ``RunError`` if a write fails or the bytes do not arrive."""
    import torch

    from .transport import MooncakeTransport

    size, extra = divmod(nbytes, descriptors)
    lengths = [size + (i < extra) for i in range(descriptors)]
    offsets = [0, *np.cumsum(lengths)[:-1].tolist()]
    source, target = MooncakeTransport(), MooncakeTransport()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    try:
        s, d = source.register(src), target.register(dst)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            status = source.raw_write(
                target.session, [s + o for o in offsets], [d + o for o in offsets], lengths
            )
            took = time.perf_counter() - t0
            if status != 0:
                raise RunError(f"raw engine write returned {status}")
            seconds.append(took)
        if not torch.equal(src, dst):
            raise RunError("raw engine write: the target's bytes differ from the source's")
    finally:
        source.close()
        target.close()
    return RawResult(descriptors, nbytes, tuple(seconds))


# -- the report ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def round_or_none(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


@dataclasses.dataclass
class Report:
    config: RunConfig
    outcomes: list[Outcome]
    splits: list[dict[str, float] | None]
    kv_bytes: int  # per request, as D verifies it
    bytes_written: int  # by P, over the requests
    descriptors: int  # by P, over the requests
    raw: RawResult | None
    raw_error: str | None
    blocks_left: dict[str, int]
    p_side_channel: list[str]  # P's workers' ROUTER addresses: what to capture
    requests_wall_s: float
    tax: Tax
    wall_s: float = 0.0

    @property
    def verified(self) -> int:
        return sum(o.verified for o in self.outcomes)

    @property
    def failed(self) -> int:
        return len(self.outcomes) - self.verified

    @property
    def exit_code(self) -> int:
        return 0 if self.outcomes and self.failed == 0 else 1

    @property
    def bytes_verified(self) -> int:
        return sum(int((o.pdwire or {}).get("bytes_verified", 0)) for o in self.outcomes)

    @property
    def transfer_s(self) -> float:
        return sum(s["transfer"] for s in self.splits if s is not None) / 1000

    @property
    def transfer_gbps(self) -> float | None:
        return self.bytes_written / self.transfer_s / 1e9 if self.transfer_s > 0 else None

    @property
    def descriptors_per_request(self) -> float:
        return self.descriptors / len(self.outcomes)

    @property
    def ratio(self) -> float | None:
        gbps = self.transfer_gbps
        return gbps / self.raw.gbps if gbps is not None and self.raw is not None else None

    def ttft(self, q: float) -> float | None:
        return percentile([o.ttft_ms for o in self.outcomes if o.ttft_ms is not None], q)

    def split_p50(self) -> dict[str, float | None]:
        rows = [s for s in self.splits if s is not None]
        return {k: percentile([s[k] for s in rows], 50) for k in SPLIT_KEYS}

    def as_dict(self) -> dict[str, Any]:
        per_request = [
            {
                "request_id": o.case.request_id,
                "verified": o.verified,
                "why": o.why,
                "ttft_ms": round_or_none(o.ttft_ms),
                "split_ms": None if s is None else {k: round(v, 3) for k, v in s.items()},
                "tax_ms": {k: round_or_none(v) for k, v in t.items()},
                "bytes_verified": (o.pdwire or {}).get("bytes_verified"),
                "timings_ms": (o.pdwire or {}).get("timings_ms"),
            }
            for o, s, t in zip(self.outcomes, self.splits, self.tax.per_request, strict=True)
        ]
        return {
            "requests": len(self.outcomes),
            "verified": self.verified,
            "failed": self.failed,
            "ttft_ms_p50": round_or_none(self.ttft(50)),
            "ttft_ms_p90": round_or_none(self.ttft(90)),
            "ttft_split_ms_p50": {k: round_or_none(v) for k, v in self.split_p50().items()},
            "transfer_gbps": round_or_none(self.transfer_gbps, 4),
            "raw_engine_gbps": round_or_none(self.raw.gbps if self.raw else None, 4),
            "raw_engine_best_gbps": round_or_none(self.raw.best_gbps if self.raw else None, 4),
            "transfer_to_raw_ratio": round_or_none(self.ratio, 4),
            "tax": self.tax.as_dict(),
            "raw_engine_error": self.raw_error,
            "descriptors_per_request": self.descriptors_per_request,
            "kv_mb_per_request": self.kv_bytes / 1e6,
            "bytes_written": self.bytes_written,
            "bytes_verified": self.bytes_verified,
            "blocks_left": self.blocks_left,
            "p_side_channel": self.p_side_channel,
            "requests_wall_s": round(self.requests_wall_s, 3),
            "wall_s": round(self.wall_s, 3),
            "not_measured": list(NOT_MEASURED),
            "config": self.config.as_dict(),
            "failures": [
                {"request_id": o.case.request_id, "why": o.why}
                for o in self.outcomes
                if not o.verified
            ],
            "per_request": per_request,
        }

    def _tax_rows(
        self, ms: Callable[[float | None], str], gbps: Callable[[float | None], str]
    ) -> list[tuple[str, str]]:
        tax, p50 = self.tax, self.tax.p50()
        ratio = tax.write_ratio
        target = tax.overhead_target_ms
        return [
            ("P write (p50)", f"{ms(p50['write'])} (the engine's calls for the request)"),
            (
                "  P write speed",
                f"{gbps(tax.write_gbps)}"
                + ("" if ratio is None else f" = {ratio:.2f} of raw (target >= {WRITE_TARGET})"),
            ),
            ("D pull (p50)", f"{ms(p50['pull'])} (first pull sent to the reply that completed it)"),
            (
                "overhead (p50)",
                f"{ms(p50['overhead'])} = TTFT - P prefill - D first step - D verify"
                + ("" if target is None else f" (target <= {target:.1f} ms)"),
            ),
        ]

    def summary(self) -> str:
        def ms(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.1f} ms"

        def gbps(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3f} GB/s"

        split = self.split_p50()
        raw = self.raw
        raw_text = gbps(raw.gbps if raw else None) + (
            f" (median of {raw.repeats} raw_write calls of {raw.descriptors} descriptors, "
            f"{raw.nbytes / 1e6:.1f} MB, in-process engine to engine; best {gbps(raw.best_gbps)})"
            if raw
            else f" ({self.raw_error})"
        )
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.2f}"
        rows = [
            ("requests", str(len(self.outcomes))),
            ("verified", str(self.verified)),
            ("failed", str(self.failed)),
            ("TTFT p50 / p90", f"{ms(self.ttft(50))} / {ms(self.ttft(90))}"),
            ("  proxy (p50)", ms(split["proxy"])),
            ("  P prefill (p50)", ms(split["p_prefill"])),
            ("  wait (p50)", ms(split["wait"])),
            ("  transfer (p50)", ms(split["transfer"])),
            ("  D queue+verify (p50)", ms(split["d"])),
            ("  D first step (p50)", ms(split["first_step"])),
            *self._tax_rows(ms, gbps),
            ("transfer", f"{gbps(self.transfer_gbps)} (bytes P wrote / sum of transfer times)"),
            ("raw engine", raw_text),
            ("transfer / raw", ratio),
            ("descriptors per request", f"{self.descriptors_per_request:g}"),
            ("KV MB per request", f"{self.kv_bytes / 1e6:.3f}"),
            (
                "bytes P wrote / D verified",
                f"{self.bytes_written} / {self.bytes_verified}"
                + (" (equal)" if self.bytes_verified == self.bytes_written else " (DIFFER)"),
            ),
            ("blocks left P / D", f"{self.blocks_left['prefill']} / {self.blocks_left['decode']}"),
            ("requests wall", f"{self.requests_wall_s:.1f} s"),
            ("wall", f"{self.wall_s:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"pdwire run: {self.config.describe()}"]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        lines += ["  not measured:"] + [f"    - {n}" for n in NOT_MEASURED]
        if self.failed:
            lines.append("  failed requests:")
            lines += [f"    {o.case.request_id}: {o.why}" for o in self.outcomes if o.why]
        return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------


def run_deployment(config: RunConfig, progress: Progress | None = None) -> Report:
    """Start the deployment, send and check every request, measure the raw engine, stop it all.

    Raises ``RunError`` (or ``WorkerError``, ``TimeoutError``, ``OSError``) when the deployment
    cannot start; a request that fails is in the report, not raised."""
    progress = progress or Progress()
    t0 = time.perf_counter()
    shape = config.shape()
    kv_bytes = prompt_kv_bytes(shape, config.prompt_tokens)
    progress.line(
        f"pdwire run: {config.describe()}; {shape.num_blocks} blocks per pool, "
        f"{kv_bytes / 1e6:.3f} MB of KV per prompt"
    )
    with deployed(config, progress) as (deployment, cases):
        report = _measure(deployment, cases, kv_bytes, progress)
    report.wall_s = time.perf_counter() - t0
    return report


@contextlib.contextmanager
def deployed(config: RunConfig, progress: Progress) -> Iterator[tuple[Deployment, list[Case]]]:
    """The started deployment and the ``config.requests`` cases (their expected texts computed
    in threads while the nodes start, or, when the workers fork from this process, once they
    have: the threads' torch ops are not to be mid-way in a fork); everything is stopped on the
    way out."""
    threads = min(os.cpu_count() or 1, config.requests, 4)
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="pdwire-expected")
    forks = config.worker_start == "fork"

    def compute() -> list[concurrent.futures.Future[Case]]:
        return [pool.submit(make_case, config, i) for i in range(config.requests)]

    try:
        futures = [] if forks else compute()
        with Deployment(config, progress) as deployment:
            deployment.start()
            if forks:
                futures = compute()
            with step(progress, f"expected texts ({threads} threads, in-process reference)"):
                cases = [f.result() for f in futures]
            yield deployment, cases
            with step(progress, "stopping P, D and the proxy"):
                deployment.stop()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _measure(
    deployment: Deployment, cases: list[Case], kv_bytes: int, progress: Progress
) -> Report:
    config = deployment.config
    p, d, proxy = deployment.prefill, deployment.decode, deployment.proxy
    assert p is not None and d is not None and proxy is not None
    with httpx.Client(timeout=30.0, verify=client_tls()) as http:
        before = node_stats(http, p)
        progress.line(f"sending {len(cases)} requests, {config.concurrency} at once")
        t0 = time.perf_counter()
        outcomes = asyncio.run(
            _send_all(f"{proxy.url}/v1/completions", cases, config, kv_bytes, progress)
        )
        requests_wall = time.perf_counter() - t0
        after = _settled(http, p)
        d_after = _settled(http, d)
    splits = [split_ms(o, deployment.tap.legs(o.case.request_id)) for o in outcomes]
    descriptors = _sum_workers(after, "descriptors") - _sum_workers(before, "descriptors")
    written = _sum_workers(after, "bytes_written") - _sum_workers(before, "bytes_written")
    raw, raw_error = None, None
    n = round(descriptors / len(outcomes))
    nbytes = round(written / len(outcomes))
    if n < 1 or nbytes < n:
        raw_error = "not measured: P wrote no descriptors"
    else:
        what = f"raw engine: {config.raw_repeats} x raw_write of {n} descriptors"
        with step(progress, f"{what}, {nbytes / 1e6:.1f} MB"):
            try:
                raw = measure_raw_engine(n, nbytes, config.raw_repeats)
            except Exception as exc:  # the run's verdict stands without it
                logger.exception("raw engine measurement failed")
                raw_error = f"not measured: {type(exc).__name__}: {exc}"
    return Report(
        config=config,
        outcomes=outcomes,
        splits=splits,
        kv_bytes=kv_bytes,
        bytes_written=written,
        descriptors=descriptors,
        raw=raw,
        raw_error=raw_error,
        blocks_left={"prefill": after["blocks_in_use"], "decode": d_after["blocks_in_use"]},
        p_side_channel=[str(w["address"]) for w in after["workers"] if "address" in w],
        requests_wall_s=requests_wall,
        tax=_tax(deployment, outcomes, after, kv_bytes, raw),
    )


def _tax(
    deployment: Deployment,
    outcomes: list[Outcome],
    p_stats: dict[str, Any],
    kv_bytes: int,
    raw: RawResult | None,
) -> Tax:
    d_reqs = {o.case.request_id: str((o.pdwire or {}).get("d_req_id", "")) for o in outcomes}
    writes = write_ms(p_stats, d_reqs.values())
    per_request = []
    for o in outcomes:
        timings = (o.pdwire or {}).get("timings_ms") or {}
        legs = deployment.tap.legs(o.case.request_id)
        per_request.append(
            {
                "write": writes.get(d_reqs[o.case.request_id]),
                "pull": timings.get("pull"),
                "overhead": overhead_ms(o.ttft_ms, legs.p_timings, timings),
            }
        )
    raw_gbps = None if raw is None else raw.gbps
    return Tax(per_request, write_gbps(p_stats, d_reqs.values()), raw_gbps, kv_bytes)


def write_json(report: Report, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.as_dict(), f, indent=2)
        f.write("\n")
