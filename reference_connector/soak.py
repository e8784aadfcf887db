"""``pdwire run --soak MINUTES``: the reference pair under load for MINUTES, with real faults
injected through real interfaces, checked for leaked blocks and for requests that were not
terminal by their deadline.

The deployment is ``run.deployed``'s (P with its bootstrap server, D, the proxy, on loopback),
with timers short enough that every fault resolves within seconds: ``T`` (``abort_timeout``: P's
ready wait, retention and placeholder expiry) 3 s by default, D's receive timeout ``T`` + 2 s,
D's load wait the request timeout. ``concurrency`` clients each send one request at a time until
MINUTES have passed. With probability ``fault_rate`` a request is the next of ``FAULTS`` in turn,
else a streamed completion through the proxy that must verify as in ``pdwire run`` (the text and
every KV byte):

- ``disconnect-mid-stream``: through the proxy; the client closes the connection after the first
  token (``disconnected``);
- ``give-up-before-first-token``: through the proxy; the client closes it after a quarter of the
  shortest TTFT seen so far, while P prefills and D waits for P's KV (``abandoned``; ``raced``
  when the first token came first);
- ``d-leg-without-p``: straight to D, ``kv_transfer_params`` naming P's engine and bootstrap
  server but a ``transfer_id`` P never prefilled; D must answer an error (``load-failed``) by its
  deadline: the leg's ``deadline_ms`` in pdwire/2, P's ready wait or D's receive timeout (the
  earlier) in legacy, plus ``FAULT_SLACK_S``;
- ``p-leg-without-d``: straight to P, a prefill that no D ever pulls (``prefilled``); P must
  free its blocks when its retention timer expires, which the drain checks.

Any other outcome is unexpected. A request is terminal when it got an answer (a response, an
error, or the client's own disconnect) rather than the client's timeout; its deadline is
``FAULT_SLACK_S`` past the fault's timer for ``d-leg-without-p``, the request timeout for the
others. After MINUTES no request starts; those in flight finish; then both pools must drain to
0 blocks within the drain window (default ``T`` + 10 s: P's retention, and D settling a failed
load). What either still holds then is leaked. A sampler reads both nodes' ``/pdwire/stats``
every ``sample_interval`` seconds from start to the end of the drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import random
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Final, NamedTuple

import httpx

from pdwire.http_models import CLIENT_KEEPALIVE_S, DecodeParams, PrefillParams
from pdwire.versions import LEGACY, PDWIRE_2, WIRE_VERSION

from .http_tls import client_tls
from .node_api import NodeServer
from .run import (
    MODEL,
    Case,
    Deployment,
    Outcome,
    Progress,
    RunConfig,
    RunError,
    check,
    deployed,
    node_stats,
    percentile,
    prompt_kv_bytes,
    round_or_none,
    step,
    stream_completion,
)

logger = logging.getLogger(__name__)

NO_FAULT: Final = "none"
FAULTS: Final = (
    "disconnect-mid-stream",
    "give-up-before-first-token",
    "d-leg-without-p",
    "p-leg-without-d",
)
EXPECTED: Final[dict[str, frozenset[str]]] = {
    NO_FAULT: frozenset({"ok"}),
    "disconnect-mid-stream": frozenset({"disconnected"}),
    "give-up-before-first-token": frozenset({"abandoned", "raced"}),
    "d-leg-without-p": frozenset({"load-failed"}),
    "p-leg-without-d": frozenset({"prefilled"}),
}
FAULT_SLACK_S: Final = 2.0  # past a fault's timer: D's backstop (1 s) and settling its blocks
GIVE_UP_FRACTION: Final = 0.25  # of the shortest TTFT seen, for give-up-before-first-token
_FIRST_GIVE_UP_S: Final = 0.002  # before any TTFT was seen
_DRAIN_POLL_S: Final = 0.2
_SETTLE_WINDOW_S: Final = 10.0  # D's wait for a failed load's blocks (node._SETTLE_S)
_EXCERPT: Final = 300


def deployment_config(run: RunConfig) -> RunConfig:
    """``run`` as a soak deploys it: unless set, pools of 8 x ``concurrency`` requests (P holds
    each p-leg-without-d's blocks for ``T``), and D's receive timeout ``T`` + 2 s, so that it
    ends after P's ready wait (6.3-R3)."""
    per_request = run.shape().blocks_for(run.prompt_tokens + run.max_tokens)
    return dataclasses.replace(
        run,
        num_blocks=run.num_blocks or 8 * run.concurrency * per_request,
        receive_timeout=run.receive_timeout or run.abort_timeout + 2.0,
    )


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """A soak of the deployment ``run`` (``run.requests`` is the number of distinct prompts)."""

    run: RunConfig
    minutes: float
    fault_rate: float = 0.1
    d_deadline_ms: int = 1500  # the deadline_ms of a d-leg-without-p (pdwire/2)
    drain_timeout: float = 0.0  # 0: abort_timeout + 10 s
    sample_interval: float = 0.5
    window_s: float = 10.0
    progress_interval: float = 5.0

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"the soak must last more than 0 minutes, got {self.minutes}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"the fault rate must be in [0, 1], got {self.fault_rate}")
        if self.d_deadline_ms < 1 or self.drain_timeout < 0:
            raise ValueError("d_deadline_ms must be at least 1 and drain_timeout not negative")

    @property
    def drain_s(self) -> float:
        return self.drain_timeout or self.run.abort_timeout + _SETTLE_WINDOW_S

    @property
    def receive_timeout(self) -> float:
        return self.run.receive_timeout or self.run.abort_timeout + 60.0

    def deadline_s(self, kind: str) -> float:
        """How long a request of ``kind`` may take to be terminal."""
        if kind != "d-leg-without-p":
            return self.run.request_timeout
        if self.run.profile == PDWIRE_2:
            timer = self.d_deadline_ms / 1000
        else:
            timer = min(self.run.abort_timeout, self.receive_timeout)
        return timer + FAULT_SLACK_S

    def describe(self) -> str:
        r = self.run
        return (
            f"1P (TP{r.prefill_tp} PP{r.prefill_pp}) -> 1D (TP{r.decode_tp} PP{r.decode_pp}), "
            f"{r.profile}, {self.minutes:g} min, fault rate {self.fault_rate:g}, concurrency "
            f"{r.concurrency}, {r.prompt_tokens} prompt tokens, max_tokens {r.max_tokens}, "
            f"T {r.abort_timeout:g} s, receive timeout {self.receive_timeout:g} s"
        )

    def as_dict(self) -> dict[str, Any]:
        deployment = self.run.as_dict()
        deployment["prompts"] = deployment.pop("requests")
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "run"}
        return {**fields, "drain_timeout": self.drain_s, "deployment": deployment}


@dataclasses.dataclass
class Record:
    """One request of the soak; times in seconds since the soak started."""

    index: int
    kind: str  # NO_FAULT or one of FAULTS
    start: float
    deadline_s: float  # how long it may take to be terminal
    end: float = math.nan
    ttft_ms: float | None = None
    outcome: str = ""
    terminal: bool = False
    why: str | None = None

    @property
    def expected(self) -> bool:
        return self.outcome in EXPECTED[self.kind]

    @property
    def late(self) -> bool:
        """Not terminal by its deadline."""
        return not self.terminal or self.end - self.start > self.deadline_s


class Sample(NamedTuple):
    t: float
    blocks_prefill: int
    blocks_decode: int


class Sampler:
    """Both nodes' ``blocks_in_use``, every ``interval`` seconds, in a thread of its own."""

    def __init__(self, prefill: NodeServer, decode: NodeServer, interval: float, t0: float) -> None:
        self.nodes, self.interval, self.t0 = (prefill, decode), interval, t0
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdwire-soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def sample(self, http: httpx.Client) -> Sample | None:
        try:
            p, d = (int(node_stats(http, n)["blocks_in_use"]) for n in self.nodes)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            logger.warning("cannot read /pdwire/stats: %s", exc)
            return None
        s = Sample(round(time.perf_counter() - self.t0, 3), p, d)
        self.samples.append(s)
        return s

    def _run(self) -> None:
        with httpx.Client(timeout=5.0, verify=client_tls()) as http:
            while True:
                self.sample(http)
                if self._stop.wait(self.interval):
                    return


class Clients:
    """The closed loop: ``concurrency`` clients, one request at a time each, until ``stop_at``."""

    def __init__(
        self,
        config: SoakConfig,
        deployment: Deployment,
        cases: list[Case],
        kv_bytes: int,
        t0: float,
    ) -> None:
        assert deployment.prefill and deployment.decode and deployment.proxy
        self.config, self.cases, self.kv_bytes, self.t0 = config, cases, kv_bytes, t0
        self.prefill, self.decode = deployment.prefill, deployment.decode
        self.url = f"{deployment.proxy.url}/v1/completions"
        profile = config.run.profile
        self.version = None if profile == LEGACY else WIRE_VERSION[profile]
        self.records: list[Record] = []
        self._rng = random.Random(f"pdwire-soak/{config.run.seed}")
        self._faults = itertools.cycle(FAULTS)
        self._ids = itertools.count()
        self._min_ttft_ms = math.inf

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self, stop_at: float) -> None:
        limits = httpx.Limits(
            max_connections=self.config.run.concurrency, keepalive_expiry=CLIENT_KEEPALIVE_S
        )
        timeout = self.config.run.request_timeout
        async with httpx.AsyncClient(timeout=timeout, limits=limits, verify=client_tls()) as http:

            async def loop() -> None:
                while self.now() < stop_at:
                    self.records.append(await self.one(http, next(self._ids)))

            await asyncio.gather(*(loop() for _ in range(self.config.run.concurrency)))

    def _kind(self) -> str:
        return next(self._faults) if self._rng.random() < self.config.fault_rate else NO_FAULT

    async def one(self, http: httpx.AsyncClient, index: int) -> Record:
        kind = self._kind()
        base = self.cases[index % len(self.cases)]
        case = dataclasses.replace(base, request_id=f"pdwire-soak-{self.config.run.seed}-{index}")
        limit = self.config.run.request_timeout
        rec = Record(index, kind, round(self.now(), 4), self.config.deadline_s(kind))
        try:
            if kind == "d-leg-without-p":
                await self._d_without_p(http, case, rec)
            elif kind == "p-leg-without-d":
                await self._p_without_d(http, case, rec)
            else:
                await self._through_proxy(http, case, rec)
            rec.terminal = True
        except httpx.TimeoutException as exc:
            rec.outcome, rec.why = "no-answer", f"{type(exc).__name__} after {limit}s"
        except httpx.HTTPError as exc:  # an answer, of a kind: the connection broke
            rec.outcome, rec.why, rec.terminal = "failed", f"{type(exc).__name__}: {exc}", True
        rec.end = round(self.now(), 4)
        return rec

    async def _through_proxy(self, http: httpx.AsyncClient, case: Case, rec: Record) -> None:
        out = Outcome(case, time.perf_counter())
        send = stream_completion(
            http, self.url, self.config.run, out, first_only=rec.kind == "disconnect-mid-stream"
        )
        try:
            if rec.kind == "give-up-before-first-token":
                seen = self._min_ttft_ms
                give_up = seen * GIVE_UP_FRACTION / 1000 if seen < math.inf else _FIRST_GIVE_UP_S
                await asyncio.wait_for(send, max(give_up, 0.001))
            else:
                await send
        except TimeoutError:  # asyncio's: the client gave up and closed the connection
            pass
        except httpx.TimeoutException:
            raise
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        rec.ttft_ms = out.ttft_ms
        if rec.kind == NO_FAULT:
            rec.why = check(out, self.kv_bytes)
            rec.outcome = "ok" if rec.why is None else "failed"
            if rec.why is None and rec.ttft_ms is not None:
                self._min_ttft_ms = min(self._min_ttft_ms, rec.ttft_ms)
        elif out.error is not None:
            rec.outcome, rec.why = "failed", out.error
        elif rec.kind == "disconnect-mid-stream":
            got = out.first is not None
            rec.outcome = "disconnected" if got else "failed"
            rec.why = None if got else "the stream ended before its first token"
        else:
            rec.outcome = "abandoned" if out.first is None else "raced"

    async def _d_without_p(self, http: httpx.AsyncClient, case: Case, rec: Record) -> None:
        engine = self.prefill.engine
        params = DecodeParams(
            remote_bootstrap_addr=engine.bootstrap_url,
            remote_engine_id=engine.engine_id,
            transfer_id=f"xfer-never-prefilled-{uuid.uuid4()}",
            pdwire_version=self.version,
            deadline_ms=self.config.d_deadline_ms if self.version is not None else None,
        )
        r = await self._post(http, self.decode, case, params.dump(), self.config.run.max_tokens)
        if r.status_code >= 400 and "KV load failed" in r.text:
            rec.outcome, rec.why = "load-failed", None
        else:
            rec.outcome = "loaded" if r.is_success else "failed"
            rec.why = f"D answered {r.status_code}: {r.text[:_EXCERPT]}"

    async def _p_without_d(self, http: httpx.AsyncClient, case: Case, rec: Record) -> None:
        params = PrefillParams(
            transfer_id=f"xfer-never-pulled-{uuid.uuid4()}", pdwire_version=self.version
        )
        r = await self._post(http, self.prefill, case, params.dump(), 1)
        rec.outcome = "prefilled" if r.is_success else "failed"
        rec.why = None if r.is_success else f"P answered {r.status_code}: {r.text[:_EXCERPT]}"

    async def _post(
        self,
        http: httpx.AsyncClient,
        node: NodeServer,
        case: Case,
        params: dict[str, Any],
        max_tokens: int,
    ) -> httpx.Response:
        body = {
            "model": MODEL,
            "prompt": case.prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "kv_transfer_params": params,
        }
        headers = {"X-Request-Id": case.request_id}
        return await http.post(f"{node.url}/v1/completions", json=body, headers=headers)


async def _drive(
    clients: Clients, sampler: Sampler, config: SoakConfig, progress: Progress
) -> None:
    stop_at = clients.now() + config.minutes * 60
    sending = asyncio.create_task(clients.run(stop_at))
    while True:
        done, _ = await asyncio.wait({sending}, timeout=config.progress_interval)
        if done:
            sending.result()
            return
        recs = clients.records
        elapsed = clients.now()
        faults = sum(r.kind != NO_FAULT for r in recs)
        bad = sum(not r.expected for r in recs)
        s = sampler.latest()
        blocks = f"{s.blocks_prefill}/{s.blocks_decode}" if s else "?"
        progress.line(
            f"soak {elapsed:.0f}s: {len(recs)} requests, {len(recs) / elapsed:.1f} rps, "
            f"{faults} faults, {bad} unexpected, blocks P/D {blocks}"
        )


def _drain(sampler: Sampler, timeout: float) -> Sample:
    """Poll until both pools are empty or ``timeout`` passes; the last reading."""
    deadline = time.monotonic() + timeout
    last: Sample | None = None
    with httpx.Client(timeout=5.0, verify=client_tls()) as http:
        while True:
            last = sampler.sample(http) or last
            if last is not None and last.blocks_prefill == last.blocks_decode == 0:
                return last
            if time.monotonic() >= deadline:
                if last is None:
                    raise RunError("the drain could not read either node's /pdwire/stats")
                return last
            time.sleep(_DRAIN_POLL_S)


# -- the report ------------------------------------------------------------------------------


@dataclasses.dataclass
class SoakReport:
    config: SoakConfig
    records: list[Record]
    samples: list[Sample]
    leaked_prefill: int
    leaked_decode: int
    drain_s: float
    wall_s: float = 0.0

    @property
    def duration_s(self) -> float:
        """From the soak's start to the end of its last request."""
        return max((r.end for r in self.records), default=0.0) or self.config.minutes * 60

    @property
    def unexpected(self) -> list[Record]:
        return [r for r in self.records if not r.expected]

    @property
    def late(self) -> int:
        return sum(r.late for r in self.records)

    @property
    def exit_code(self) -> int:
        clean = not self.unexpected and not self.late
        return 0 if self.records and clean and not self.leaked_prefill + self.leaked_decode else 1

    def ttfts(self, records: list[Record] | None = None) -> list[float]:
        rows = self.records if records is None else records
        return [r.ttft_ms for r in rows if r.outcome == "ok" and r.ttft_ms is not None]

    def windows(self) -> list[dict[str, Any]]:
        """Requests ended, rps and TTFT per ``window_s`` window; a last window shorter than
        half of one joins the one before."""
        span, width = self.duration_s, self.config.window_s
        edges = [i * width for i in range(max(1, math.ceil(span / width)))] + [span]
        if len(edges) > 2 and edges[-1] - edges[-2] < width / 2:
            del edges[-2]
        out = []
        for i, (a, b) in enumerate(itertools.pairwise(edges)):
            last = i == len(edges) - 2
            rows = [r for r in self.records if a <= r.end and (r.end < b or last)]
            ttfts = self.ttfts(rows)
            out.append(
                {
                    "t0": round(a, 3),
                    "t1": round(b, 3),
                    "requests": len(rows),
                    "rps": round(len(rows) / (b - a), 3) if b > a else None,
                    "faults": sum(r.kind != NO_FAULT for r in rows),
                    "ttft_p50_ms": round_or_none(percentile(ttfts, 50)),
                    "ttft_p99_ms": round_or_none(percentile(ttfts, 99)),
                }
            )
        return out

    def kinds(self) -> dict[str, dict[str, Any]]:
        """Per kind (NO_FAULT and each fault): count, outcomes, which are expected, late."""
        out: dict[str, dict[str, Any]] = {}
        for kind in (NO_FAULT, *FAULTS):
            rows = [r for r in self.records if r.kind == kind]
            took = [r.end - r.start for r in rows]
            out[kind] = {
                "count": len(rows),
                "outcomes": dict(Counter(r.outcome for r in rows)),
                "expected": sorted(EXPECTED[kind]),
                "late_terminal": sum(r.late for r in rows),
                "deadline_s": self.config.deadline_s(kind),
                "seconds_p50": round_or_none(percentile(took, 50)),
                "seconds_max": round_or_none(max(took, default=None)),
            }
        return out

    def as_dict(self) -> dict[str, Any]:
        windows, kinds = self.windows(), self.kinds()
        rps = [w["rps"] for w in windows if w["rps"] is not None]
        return {
            "requests": len(self.records),
            "terminal": sum(r.terminal for r in self.records),
            "unexpected": len(self.unexpected),
            "late_terminal": self.late,
            "leaked_blocks_prefill": self.leaked_prefill,
            "leaked_blocks_decode": self.leaked_decode,
            "minutes": self.config.minutes,
            "fault_rate": self.config.fault_rate,
            "rps": round(len(self.records) / self.duration_s, 3),
            "rps_window_min": min(rps, default=None),
            "rps_window_mean": round_or_none(sum(rps) / len(rps) if rps else None),
            "ttft_p50_ms": round_or_none(percentile(self.ttfts(), 50)),
            "ttft_p99_ms": round_or_none(percentile(self.ttfts(), 99)),
            "plain": kinds[NO_FAULT],
            "faults": {k: kinds[k] for k in FAULTS},
            "windows": windows,
            "samples": [s._asdict() for s in self.samples],
            "duration_s": round(self.duration_s, 3),
            "drain_s": round(self.drain_s, 3),
            "wall_s": round(self.wall_s, 3),
            "config": self.config.as_dict(),
            "unexpected_requests": [
                {**dataclasses.asdict(r), "late": r.late} for r in self.unexpected[:50]
            ],
        }

    def summary(self) -> str:
        d = self.as_dict()

        def num(v: float | None, unit: str = "") -> str:
            return "n/a" if v is None else f"{v:.1f}{unit}"

        rows = [
            (
                "requests",
                f"{d['requests']} (terminal {d['terminal']}, unexpected {d['unexpected']}, "
                f"ok {d['plain']['outcomes'].get('ok', 0)})",
            ),
            (
                "rps",
                f"{d['rps']:.1f} overall; per {self.config.window_s:g} s window min "
                f"{num(d['rps_window_min'])} / mean {num(d['rps_window_mean'])}",
            ),
            ("TTFT p50 / p99", f"{num(d['ttft_p50_ms'], ' ms')} / {num(d['ttft_p99_ms'], ' ms')}"),
        ]
        faults = sum(v["count"] for v in d["faults"].values())
        rows.append(("faults", f"{faults} (fault rate {self.config.fault_rate:g})"))
        for kind, v in d["faults"].items():
            outcomes = ", ".join(f"{o} {n}" for o, n in sorted(v["outcomes"].items()))
            took = f"longest {num(v['seconds_max'], ' s')} of {v['deadline_s']:g} s allowed"
            rows.append((f"  {kind}", f"{v['count']} ({outcomes}; {took})" if outcomes else "0"))
        rows += [
            (
                "leaked blocks P / D",
                f"{self.leaked_prefill} / {self.leaked_decode} (drain "
                f"{self.drain_s:.1f} s of at most {self.config.drain_s:g} s)",
            ),
            ("late terminal", str(self.late)),
            ("wall", f"{self.wall_s:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"pdwire run --soak: {self.config.describe()}"]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        bad = [r for r in self.records if not r.expected or r.late]
        if bad:
            lines.append(f"  unexpected or late requests ({len(bad)}, the first 20):")
            lines += [
                f"    #{r.index} {r.kind}: {r.outcome}{' (late)' if r.late else ''}: {r.why}"
                for r in bad[:20]
            ]
        return "\n".join(lines)


def write_json(report: SoakReport, path: str) -> Path:
    """Write the report to ``path`` and its plot beside it (``.png``); the plot's path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.as_dict(), f, indent=2)
        f.write("\n")
    png = Path(path).with_suffix(".png")
    write_plot(report, png)
    return png


def write_plot(report: SoakReport, path: Path) -> None:
    """Two panels over time: both pools' blocks in use, and the TTFT of the ok requests with
    each window's p50 and p99."""
    from matplotlib.figure import Figure  # no pyplot: no global state, the Agg canvas

    fig = Figure(figsize=(10, 6.5), layout="constrained")
    blocks, ttft = fig.subplots(2, 1, sharex=True)
    t = [s.t for s in report.samples]
    blocks.step(t, [s.blocks_prefill for s in report.samples], where="post", label="P")
    blocks.step(t, [s.blocks_decode for s in report.samples], where="post", label="D")
    blocks.set_ylabel("blocks in use")
    blocks.set_title(report.config.describe(), fontsize=8)
    ok = [r for r in report.records if r.outcome == "ok" and r.ttft_ms is not None]
    ttft.scatter([r.start for r in ok], [r.ttft_ms for r in ok], s=4, alpha=0.4, label="TTFT")
    for q, style in (("ttft_p50_ms", "-"), ("ttft_p99_ms", "--")):
        xs, ys = [], []
        for w in report.windows():
            if w[q] is not None:
                xs += [w["t0"], w["t1"]]
                ys += [w[q], w[q]]
        ttft.plot(xs, ys, style, color="black", linewidth=1, label=q[5:8] + " per window")
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_xlabel("seconds since the soak started")
    for ax in (blocks, ttft):
        ax.axvline(report.duration_s, color="grey", linewidth=0.8, linestyle=":")
        ax.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=100)


# -- the soak --------------------------------------------------------------------------------


def run_soak(config: SoakConfig, progress: Progress | None = None) -> SoakReport:
    """Start the deployment, soak it, drain it, stop it all.

    Raises ``RunError`` (or ``WorkerError``, ``TimeoutError``, ``OSError``) when the deployment
    cannot start; a request that fails is in the report, not raised."""
    progress = progress or Progress()
    t0 = time.perf_counter()
    run = config.run
    kv_bytes = prompt_kv_bytes(run.shape(), run.prompt_tokens)
    progress.line(
        f"pdwire run --soak: {config.describe()}; {run.shape().num_blocks} blocks per pool"
    )
    with deployed(run, progress) as (deployment, cases):
        assert deployment.prefill is not None and deployment.decode is not None
        start = time.perf_counter()
        sampler = Sampler(deployment.prefill, deployment.decode, config.sample_interval, start)
        sampler.start()
        try:
            clients = Clients(config, deployment, cases, kv_bytes, start)
            progress.line(f"soaking for {config.minutes:g} min, {run.concurrency} clients")
            asyncio.run(_drive(clients, sampler, config, progress))
            with step(progress, f"draining both pools (at most {config.drain_s:g} s)"):
                drain_start = time.perf_counter()
                last = _drain(sampler, config.drain_s)
                drained = time.perf_counter() - drain_start
        finally:
            sampler.stop()
    report = SoakReport(
        config=config,
        records=sorted(clients.records, key=lambda r: r.index),
        samples=sorted(sampler.samples),
        leaked_prefill=last.blocks_prefill,
        leaked_decode=last.blocks_decode,
        drain_s=drained,
    )
    report.wall_s = time.perf_counter() - t0
    return report
