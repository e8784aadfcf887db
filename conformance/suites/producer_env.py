"""The producer suite's world: the harness is the client and D of a P under test.

``ProducerEnv`` is opened once per run: it reads P's ``/query`` entry, learns P's TP and PP
sizes and KV geometry, and starts the harness's transfer engine. Each case gets a
``ProducerCtx``: fake D workers (``DWorker``), P legs (``prefill``), pulls (``pull``) and whole
transfers (``load``), everything logged in the case's wire log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, Final

import httpx
import zmq.asyncio

from pdwire.codec import encode_pull
from pdwire.messages import Fingerprint, XferMetadataV2
from pdwire.planning import target_ranks
from pdwire.sim.geometry import Geometry
from pdwire.versions import ALL_CAPS, CURRENT_VERSION, LEGACY, PDWIRE_2

from ..case import CaseFailed, Skip, Unsupported, WireLog, expect
from ..peers.engine import Engine
from ..peers.fake_d import DWorker, PullResult, exchange
from ..peers.http import HttpResult, request, request_id, transfer_id

DEFAULT_BLOCKS: Final = 64  # blocks of each fake D worker


@dataclasses.dataclass(frozen=True)
class ProducerOptions:
    api: str  # P's OpenAI API, e.g. http://127.0.0.1:8100
    bootstrap: str  # P's bootstrap server, e.g. http://127.0.0.1:8998
    engine_id: str | None = None  # which engine of the /query reply (default: DP rank 0's)
    geometry: Geometry | None = None  # P's KV geometry; default: from its registered fingerprint
    model: str | None = None  # default: the first model of /v1/models
    abort_timeout: float | None = None  # P's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, when known
    vocab: int = 1000  # prompts use token ids in [1, vocab)
    prompt_tokens: int = 40  # the default prompt length
    request_timeout: float = 30.0


class ProducerEnv:
    """What every producer case shares: P's addresses, sizes and geometry, and the harness's
    engine and sockets."""

    def __init__(self, options: ProducerOptions) -> None:
        self.options = options
        self.http = httpx.AsyncClient(timeout=options.request_timeout)
        self.zmq = zmq.asyncio.Context()
        self.engine: Engine | None = None
        self.query: dict[str, Any] = {}
        self.entry: dict[str, Any] = {}
        self.dp_rank = 0
        self.geometry = Geometry()
        self.fingerprint: Fingerprint | None = None
        self.model = options.model or ""
        self._workers: dict[tuple[int, int, int, int], DWorker] = {}
        self._ids = itertools.count(1)

    async def open(self) -> None:
        log = WireLog()
        got = await request(self.http, "GET", f"{self.options.bootstrap}/query", log)
        if not got.ok or not isinstance(got.body, dict) or not got.body:
            raise RuntimeError(
                f"P's bootstrap server at {self.options.bootstrap} gave no engine on GET /query "
                f"(HTTP {got.status} {got.error or got.body!r}): is P up and registered?"
            )
        self.query = got.body
        for dp, entry in got.body.items():
            if self.options.engine_id in (None, entry.get("engine_id")):
                self.dp_rank, self.entry = int(dp), entry
                break
        else:
            raise RuntimeError(f"no engine {self.options.engine_id!r} at {self.options.bootstrap}")
        fp = self.entry.get("fingerprint")
        if isinstance(fp, dict):
            self.fingerprint = Fingerprint(**fp)
        geometry = self.options.geometry
        if geometry is None:
            if self.fingerprint is None:
                raise RuntimeError(
                    "P registered no fingerprint: give its KV geometry (--layers, --kv-heads, "
                    "--head-dim, --block-size)"
                )
            f = self.fingerprint
            geometry = Geometry(f.num_layers, f.num_kv_heads, f.head_size, f.block_size)
        self.geometry = dataclasses.replace(geometry, num_blocks=DEFAULT_BLOCKS)
        if not self.model:
            models = await request(self.http, "GET", f"{self.options.api}/v1/models", log)
            try:
                self.model = str(models.body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise RuntimeError(f"GET {self.options.api}/v1/models named no model") from None
        self.engine = Engine()

    async def close(self) -> None:
        await self.http.aclose()
        self.zmq.destroy(linger=0)
        if self.engine is not None:
            self.engine.close()

    @property
    def p_tp(self) -> int:
        return int(self.entry.get("tp_size") or len(self.entry.get("worker_addr", {})) or 1)

    @property
    def p_pp(self) -> int:
        addrs: dict[str, dict[str, str]] = self.entry.get("worker_addr", {})
        first: dict[str, str] = next(iter(addrs.values()), {})
        return int(self.entry.get("pp_size") or len(first) or 1)

    @property
    def p_version(self) -> int:
        return int(self.entry.get("pdwire_version") or 0)

    def worker(self, tp_size: int, tp_rank: int, pp_size: int = 1, pp_rank: int = 0) -> DWorker:
        key = (tp_size, tp_rank, pp_size, pp_rank)
        if key not in self._workers:
            assert self.engine is not None
            self._workers[key] = DWorker(self.engine, self.geometry, *key)
        return self._workers[key]

    def next_id(self) -> int:
        return next(self._ids)


@dataclasses.dataclass
class Loaded:
    """One whole transfer: the P leg, and every pull the D workers sent for it."""

    transfer_id: str
    d_req_id: str
    prefill: HttpResult | None
    pulls: list[tuple[DWorker, str, PullResult]]  # (D worker, P worker address, result)
    blocks: dict[int, list[int]]  # per D TP rank: the blocks asked for


class ProducerCtx:
    """One producer case's view of the world."""

    def __init__(self, env: ProducerEnv, log: WireLog) -> None:
        self.env = env
        self.log = log
        self.options = env.options
        self.geometry = env.geometry

    # -- P -----------------------------------------------------------------------------------

    @property
    def p_tp(self) -> int:
        return self.env.p_tp

    @property
    def p_pp(self) -> int:
        return self.env.p_pp

    def addr(self, tp: int = 0, pp: int = 0) -> str:
        try:
            return str(self.env.entry["worker_addr"][str(tp)][str(pp)])
        except KeyError:
            raise CaseFailed(f"P's /query entry has no worker (tp {tp}, pp {pp})") from None

    def require_pdwire2(self) -> None:
        """Unsupported unless P registered as speaking pdwire/2."""
        if self.env.p_version < 2:
            raise Unsupported("P did not announce pdwire/2 at its bootstrap server")

    def require_cap(self, cap: str) -> None:
        self.require_pdwire2()
        if cap not in (self.env.entry.get("pdwire_caps") or []):
            raise Unsupported(f"P did not announce the capability {cap!r}")

    @property
    def abort_timeout(self) -> float:
        """P's ready-wait and retention timer; skips the case when the run was not told it."""
        t = self.options.abort_timeout
        if t is None:
            raise Skip("P's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT is unknown: pass --abort-timeout")
        return t

    def prompt(self, tokens: int | None = None) -> list[int]:
        n = tokens or self.options.prompt_tokens
        k = self.env.next_id()
        span = max(2, self.options.vocab - 1)
        return [1 + (k * 7919 + i * 104729) % span for i in range(n)]

    def blocks_for(self, tokens: int | None = None) -> int:
        n = tokens or self.options.prompt_tokens
        return -(-n // self.geometry.block_size)

    def new_transfer_id(self) -> str:
        return transfer_id()

    def new_d_req(self) -> str:
        return f"d-{self.env.next_id()}"

    async def prefill(
        self,
        transfer: str | None,
        tokens: int | None = None,
        *,
        params: dict[str, Any] | None = None,
        **body: Any,
    ) -> HttpResult:
        """Send P the P leg of a request (§5.1) and wait for its answer."""
        kv: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if transfer is not None:
            kv["transfer_id"] = transfer
        payload: dict[str, Any] = {
            "model": self.env.model,
            "prompt": self.prompt(tokens),
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": params if params is not None else kv,
            **body,
        }
        headers = {"X-Request-Id": request_id()}
        return await request(
            self.env.http,
            "POST",
            f"{self.options.api}/v1/completions",
            self.log,
            body=payload,
            headers=headers,
        )

    def start_prefill(
        self, transfer: str | None, tokens: int | None = None, **kw: Any
    ) -> asyncio.Task[HttpResult]:
        return asyncio.create_task(self.prefill(transfer, tokens, **kw))

    # -- D -----------------------------------------------------------------------------------

    def worker(
        self, tp_size: int | None = None, tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0
    ) -> DWorker:
        """A fake D worker (D TP defaults to P's)."""
        return self.env.worker(tp_size or self.p_tp, tp_rank, pp_size, pp_rank)

    def targets(self, worker: DWorker) -> list[str]:
        """The P workers ``worker`` pulls from for a transfer (§10.1, §10.2)."""
        side = worker.side
        addrs: list[str] = []
        for tp in target_ranks(side.tp_size, side.tp_rank, self.p_tp):
            pps = [worker.pp_rank] if side.pp_size == self.p_pp else range(self.p_pp)
            addrs.extend(self.addr(tp, pp) for pp in pps)
        return addrs

    def announce(self, caps: Sequence[str] | None = None, **fields: Any) -> dict[str, Any]:
        """The pdwire/2 fields of an announcing pull."""
        out: dict[str, Any] = {
            "pdwire_version": CURRENT_VERSION,
            "pdwire_caps": sorted(ALL_CAPS if caps is None else caps),
        }
        if self.env.fingerprint is not None:
            out["fingerprint"] = self.env.fingerprint
        out.update(fields)
        return out

    def encode(self, msg: XferMetadataV2, announce: bool) -> bytes:
        return encode_pull(msg, PDWIRE_2 if announce else LEGACY)

    async def send(
        self,
        addr: str,
        data: bytes | list[bytes],
        *,
        timeout: float | None = None,
        linger_after: float = 0.0,
    ) -> PullResult:
        """Send raw frames on a new DEALER to ``addr``; collect the replies."""
        wait = timeout if timeout is not None else self.options.request_timeout
        return await exchange(self.env.zmq, addr, data, wait, self.log, linger_after=linger_after)

    async def pull(
        self,
        worker: DWorker,
        addr: str,
        req_blocks: dict[str, tuple[str, list[list[int]]]],
        *,
        announce: bool = False,
        caps: Sequence[str] | None = None,
        with_layout: bool = True,
        timeout: float | None = None,
        linger_after: float = 0.0,
        **fields: Any,
    ) -> PullResult:
        """One pull from ``worker`` to the P worker at ``addr``."""
        extra = {**(self.announce(caps) if announce else {}), **fields}
        msg = worker.pull(req_blocks, with_layout=with_layout, **extra)
        return await self.send(
            addr, self.encode(msg, announce), timeout=timeout, linger_after=linger_after
        )

    async def load(
        self,
        *,
        tokens: int | None = None,
        d_tp: int | None = None,
        announce: bool = False,
        pull_first: bool = False,
        scattered: bool = False,
        transfer: str | None = None,
    ) -> Loaded:
        """A whole transfer: P's leg, then (or, with ``pull_first``, before its answer) every
        pull of every D TP rank, each to its paired P workers."""
        tid = transfer or self.new_transfer_id()
        d_req = self.new_d_req()
        n = self.blocks_for(tokens)
        leg = self.start_prefill(tid, tokens)
        prefill: HttpResult | None = None
        if not pull_first:
            prefill = await leg
            expect(
                prefill.ok,
                f"P's leg failed: HTTP {prefill.status} {prefill.error or prefill.body!r}",
            )
        d_size = d_tp or self.p_tp
        workers = [self.worker(d_size, r) for r in range(d_size)]
        blocks = {w.side.tp_rank: w.take(n, scattered=scattered) for w in workers}
        jobs = [
            (w, a, self.pull(w, a, {d_req: (tid, [blocks[w.side.tp_rank]])}, announce=announce))
            for w in workers
            for a in self.targets(w)
        ]
        results = await asyncio.gather(*(job for _, _, job in jobs))
        if prefill is None:
            prefill = await leg
        pulls = [(w, a, r) for (w, a, _), r in zip(jobs, results, strict=True)]
        return Loaded(tid, d_req, prefill, pulls, blocks)

    def release(self, loaded: Loaded) -> None:
        """Give the transfer's blocks back to the fake D workers."""
        for w, _, _ in loaded.pulls:
            w.give_back(loaded.blocks.get(w.side.tp_rank, []))

    def expect_loaded(self, loaded: Loaded) -> None:
        """Every pull ended FINISH listing the request ok, every block asked for holds bytes,
        and no byte outside them changed."""
        for w, a, r in loaded.pulls:
            expect(
                r.status is not None and r.status.name == "FINISH" and loaded.d_req_id in r.ok(),
                f"pull of D rank {w.side.tp_rank} to {a}: expected FINISH with "
                f"{loaded.d_req_id} in ok_reqs, got {r.describe()}",
            )
        for w in {id(w): w for w, _, _ in loaded.pulls}.values():
            missing = w.unwritten(loaded.blocks[w.side.tp_rank])
            expect(
                not missing,
                f"D rank {w.side.tp_rank}: (region, block) never written: {missing[:8]}",
            )
            stray = w.stray_bytes()
            expect(
                stray == 0,
                f"D rank {w.side.tp_rank}: {stray} bytes written outside the blocks asked for",
            )
