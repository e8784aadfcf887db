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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import msgspec
import zmq.asyncio

from pdwire import auth
from pdwire.codec import encode_cancel, encode_heartbeat, encode_pull
from pdwire.messages import (
    Fingerprint,
    LeaseHeartbeat,
    XferCancel,
    XferMetadataV2,
    layout_named,
)
from pdwire.planning import target_ranks
from pdwire.sim.geometry import Geometry
from pdwire.versions import ALL_CAPS, CURRENT_VERSION, LEGACY, PDWIRE_2

from ..case import CaseFailed, Unsupported, WireLog, declared_limit, expect, given
from ..discovery import discover
from ..peers.engine import Engine
from ..peers.fake_d import DWorker, PullResult, Reply, exchange
from ..peers.http import HttpResult, client, request, request_id, transfer_id
from ..peers.p_engine import OfPEngine, PEngine, registered_engine

DEFAULT_BLOCKS: Final = 64  # blocks of each fake D worker
PULL_FIRST_QUIET: Final = 2.0  # seconds; see ProducerCtx.pull_first_quiet
#: How long a release-only pull of a case's leftover transfer waits for P's answer, seconds: P
#: answers one for a transfer it holds at once, and one for a transfer it no longer holds
#: perhaps only at its timer.
RELEASE_WAIT: Final = 2.0
M = TypeVar("M", XferMetadataV2, XferCancel)


@dataclasses.dataclass(frozen=True)
class ProducerOptions:
    api: str  # P's OpenAI API, e.g. http://127.0.0.1:8100
    bootstrap: str  # P's bootstrap server, e.g. http://127.0.0.1:8998
    engine_id: str | None = None  # which engine of the /query reply (default: DP rank 0's)
    geometry: Geometry | None = None  # P's KV geometry; default: from its registered fingerprint
    model: str | None = None  # default: the first model of /v1/models
    abort_timeout: float | None = None  # P's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, when known
    kv_lease_duration: float | None = None  # P's lease (§6.4), when known; 0: P has none
    vocab: int = 1000  # prompts use token ids in [1, vocab)
    prompt_tokens: int = 40  # the default prompt length
    request_timeout: float = 30.0
    auth_key: bytes | None = None  # the key P shares (§8.6): pdwire/2 pulls and cancels signed
    #: P's limits (chapter 13) by name, those the run was told; the cases past a limit need it
    limits: Mapping[str, int] = dataclasses.field(default_factory=dict)
    kernel_block_size: int | None = None  # P's attention kernel's, when below its block size
    sliding_window: int | None = None  # the window of P's second KV-cache group (10.4.7)
    mamba: bool = False  # P's odd layers are state-space layers, its KV-cache group 1 (10.6.3)
    packed_rows: bool = False  # P's regions are slices of packed rows; the fake D's are too
    opaque_rows: bool = False  # P's packed rows are registered whole; the fake D's are too
    #: how P's blocks lie (``--kv-layout``); the fake D's lie the same. None: as P's fingerprint
    #: names it (§3.6.1), else as its model's config says (MLA), else "apart"
    kv_layout: str | None = None


class ProducerEnv(OfPEngine):
    """What every producer case shares: P's addresses, sizes and geometry, and the harness's
    engine and sockets."""

    def __init__(self, options: ProducerOptions) -> None:
        self.options = options
        self.http = client(options.request_timeout)
        self.zmq = zmq.asyncio.Context()
        self.engine: Engine | None = None
        self.p = PEngine({}, 0, {})
        self.geometry = Geometry()
        self.fingerprint: Fingerprint | None = None
        self.model = options.model or ""
        self._workers: dict[tuple[int, int, int, int], DWorker] = {}
        self._ids = itertools.count(1)

    async def open(self) -> None:
        log = WireLog()
        why = await self.refresh(self.options.request_timeout)
        if why is not None:
            raise RuntimeError(why)
        fp = self.entry.get("fingerprint")
        if isinstance(fp, dict):
            self.fingerprint = Fingerprint(**fp)
        geometry = self.options.geometry
        if geometry is None and self.fingerprint is not None:
            f = self.fingerprint
            geometry = Geometry(f.num_layers, f.num_kv_heads, f.head_size, f.block_size)
        if geometry is None:
            found = await discover(self.http, self.options.api, self.options.request_timeout)
            if found.geometry is None:
                raise RuntimeError(
                    f"P registered no fingerprint and {found.missing}: give its KV geometry "
                    "(--layers, --kv-heads, --head-dim, --block-size)"
                )
            geometry = found.geometry
        announced = layout_named(self.fingerprint.kv_layout) if self.fingerprint else None
        kernel = self.options.kernel_block_size or geometry.kernel_block_size
        window = self.options.sliding_window or geometry.sliding_window
        try:
            self.geometry = dataclasses.replace(
                geometry,
                num_blocks=DEFAULT_BLOCKS,
                kernel_block_size=kernel,
                sliding_window=window,
                mamba=self.options.mamba or geometry.mamba,
                packed_rows=self.options.packed_rows or geometry.packed_rows,
                opaque_rows=self.options.opaque_rows or geometry.opaque_rows,
                kv_layout=self.options.kv_layout or announced or geometry.kv_layout,
            )
        except ValueError as exc:
            raise RuntimeError(
                f"{exc}: check --kernel-block-size, --sliding-window, --mamba, --packed-rows, "
                "--opaque-rows and --kv-layout"
            ) from None
        if not self.model:
            models = await request(self.http, "GET", f"{self.options.api}/v1/models", log)
            try:
                self.model = str(models.body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise RuntimeError(f"GET {self.options.api}/v1/models named no model") from None
        self.engine = Engine()

    async def refresh(self, wait: float = 0.0) -> str | None:
        """Learn P's engine and its workers' addresses from its bootstrap server, waiting up to
        ``wait`` seconds for every worker to register: None when it named them all, else what
        went wrong."""
        o = self.options
        picked = await registered_engine(self.http, o.bootstrap, o.engine_id, WireLog(), wait)
        if isinstance(picked, str):
            return picked
        self.p = picked
        return None

    async def close(self) -> None:
        await self.http.aclose()
        self.zmq.destroy(linger=0)
        if self.engine is not None:
            self.engine.close()

    async def serving(self) -> str | None:
        """Whether P still serves (``runner.Probe``): its bootstrap server answers ``/query``;
        each of its workers answers a lease renewal of a transfer it never had: every P
        answers one at once (3.9-R5; a P without a lease, or older than vLLM 0.34, with
        ``ERROR``), and it creates nothing (6.4-R3); and its engine answers a P leg, whose
        transfer a release-only pull of every D worker then ends (10.10.8). A P that still
        talks but can no longer take a request (its blocks all held) fails the last."""
        t = ProducerCtx(self, WireLog())
        got = await request(self.http, "GET", f"{self.options.bootstrap}/query", t.log)
        if got.status == 0:
            return f"P's bootstrap server did not answer GET /query ({got.error})"
        for tp, stages in sorted(self.entry.get("worker_addr", {}).items()):
            for pp, addr in sorted(stages.items()):
                answer = await t.heartbeat(addr, [t.new_transfer_id()])
                if not answer.replies:
                    return (
                        f"P's worker tp{tp}/pp{pp} at {addr} answered nothing within "
                        f"{self.options.request_timeout:.1f}s to a lease renewal: its side "
                        "channel no longer serves"
                    )
        return await _takes_a_request(t)

    def worker(self, tp_size: int, tp_rank: int, pp_size: int = 1, pp_rank: int = 0) -> DWorker:
        key = (tp_size, tp_rank, pp_size, pp_rank)
        if key not in self._workers:
            assert self.engine is not None
            self._workers[key] = DWorker(self.engine, self.geometry, *key)
        return self._workers[key]

    def next_id(self) -> int:
        return next(self._ids)


async def _takes_a_request(t: ProducerCtx) -> str | None:
    """Why P cannot take a P leg now, or None once it took one and D released it."""
    tid = t.new_transfer_id()
    leg = await t.prefill(tid)
    if leg.status == 0:
        return f"P did not answer a P leg within {t.options.request_timeout:.1f}s ({leg.error})"
    if not leg.ok:
        return f"P answered a P leg with HTTP {leg.status} {leg.body!r}"
    d_req = t.new_d_req()
    await asyncio.gather(*(t.pull_to_targets(w, tid, d_req, []) for w in t.d_workers()))
    return None


@dataclasses.dataclass
class Loaded:
    """One whole transfer: the P leg, and every pull the D workers sent for it."""

    transfer_id: str
    d_req_id: str
    prefill: HttpResult | None
    pulls: list[tuple[DWorker, str, PullResult]]  # (D worker, P worker address, result)
    blocks: dict[DWorker, list[int]]  # per D worker: the blocks asked for
    prompt: list[int] = dataclasses.field(default_factory=list)


class ProducerCtx:
    """One producer case's view of the world."""

    def __init__(self, env: ProducerEnv, log: WireLog) -> None:
        self.env = env
        self.log = log
        self.options = env.options
        self.geometry = env.geometry
        self._prefilled: dict[str, None] = {}  # transfers whose P leg answered, in order
        self._settled: set[tuple[str, str]] = set()  # (transfer, P worker) that served it
        self._d_reqs: dict[str, str] = {}  # transfer -> the D request of its last pull

    async def close(self) -> None:
        """Release-only pulls (10.10.8) of every transfer the case had P hold, to each P worker
        that did not serve it, as a D that will not load it sends: P frees its blocks now, not at
        its timer. A P of vLLM's own steps its engine every millisecond while it holds blocks."""
        keyed = self.options.auth_key is not None
        pulls, left = [], set()
        for tid in self._prefilled:
            # P keeps a transfer for the D request that pulled it (10.11.7): release that one.
            d_req = self._d_reqs.get(tid) or self.new_d_req()
            for w in self.d_workers():
                for addr in self._targets_or_none(w):
                    if (tid, addr) not in self._settled:
                        left.add(tid)
                        release = {d_req: (tid, w.group_lists([]))}
                        pulls.append(
                            self.pull(w, addr, release, announce=keyed, timeout=RELEASE_WAIT)
                        )
        if pulls:
            self.log.note(f"releasing the {len(left)} transfers the case left at P")
            await asyncio.gather(*pulls, return_exceptions=True)

    def _targets_or_none(self, worker: DWorker) -> list[str]:
        try:
            return self.targets(worker)
        except CaseFailed:
            return []

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
        return given(
            self.options.abort_timeout, "P's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "--abort-timeout"
        )

    @property
    def lease(self) -> float:
        """P's kv_lease_duration, 0 when it has none; skips the case when the run was not told."""
        return given(self.options.kv_lease_duration, "P's kv_lease_duration", "--kv-lease-duration")

    def require_lease(self) -> float:
        """P's lease; unsupported when P has none."""
        if not self.lease:
            raise Unsupported("P has no kv_lease_duration (§6.4)")
        return self.lease

    async def heartbeat(
        self, addr: str, transfer_ids: Sequence[str], *, timeout: float | None = None
    ) -> PullResult:
        """A lease renewal (§3.9) of ``transfer_ids`` on a new DEALER to ``addr``."""
        data = encode_heartbeat(LeaseHeartbeat(list(transfer_ids)))
        return await self.send(addr, data, timeout=timeout)

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
        prompt: list[int] | None = None,
        leg_params: dict[str, Any] | None = None,
        **body: Any,
    ) -> HttpResult:
        """Send P the P leg of a request (§5.1) and wait for its answer; the prompt is a new
        one unless given. ``leg_params`` adds fields to the leg's kv_transfer_params,
        ``params`` replaces them."""
        kv: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if transfer is not None:
            kv["transfer_id"] = transfer
        kv.update(leg_params or {})
        payload: dict[str, Any] = {
            "model": self.env.model,
            "prompt": prompt if prompt is not None else self.prompt(tokens),
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": params if params is not None else kv,
            **body,
        }
        headers = {"X-Request-Id": request_id()}
        got = await request(
            self.env.http,
            "POST",
            f"{self.options.api}/v1/completions",
            self.log,
            body=payload,
            headers=headers,
        )
        sent = payload["kv_transfer_params"]
        if got.ok and isinstance(sent, dict) and isinstance(sent.get("transfer_id"), str):
            self._prefilled[sent["transfer_id"]] = None
        return got

    def start_prefill(
        self, transfer: str | None, tokens: int | None = None, **kw: Any
    ) -> asyncio.Task[HttpResult]:
        return asyncio.create_task(self.prefill(transfer, tokens, **kw))

    def expect_leg_ok(self, leg: HttpResult) -> None:
        expect(leg.ok, f"P's leg failed: HTTP {leg.status} {leg.error or leg.body!r}")

    async def ready(self, n: int = 1, tokens: int | None = None) -> list[str]:
        """``n`` transfers whose P legs have answered: their KV waits at P for pulls."""
        tids = [self.new_transfer_id() for _ in range(n)]
        for leg in await asyncio.gather(*(self.prefill(tid, tokens) for tid in tids)):
            self.expect_leg_ok(leg)
        return tids

    async def complete(self, prompt: list[int], **body: Any) -> HttpResult:
        """A plain completion at P, without kv_transfer_params."""
        payload = {"model": self.env.model, "prompt": prompt, "max_tokens": 1, **body}
        return await request(
            self.env.http, "POST", f"{self.options.api}/v1/completions", self.log, body=payload
        )

    async def first_token(self, prompt: list[int]) -> int:
        """The token P generates first after ``prompt``, asked with vLLM's return_token_ids;
        Unsupported when P does not return token ids."""
        got = await self.complete(prompt, return_token_ids=True)
        self.expect_leg_ok(got)
        try:
            ids = got.body["choices"][0]["token_ids"]
        except (KeyError, IndexError, TypeError):
            ids = None
        if not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
            raise Unsupported("P does not return token_ids (vLLM's return_token_ids)")
        return int(ids[0])

    # -- D -----------------------------------------------------------------------------------

    def worker(
        self, tp_size: int | None = None, tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0
    ) -> DWorker:
        """A fake D worker (D TP defaults to P's)."""
        return self.env.worker(tp_size or self.p_tp, tp_rank, pp_size, pp_rank)

    def targets(self, worker: DWorker, stage: int | None = None) -> list[str]:
        """The P workers ``worker`` pulls from for a transfer (§10.1, §10.2); with ``stage``,
        those of that P stage only."""
        side = worker.side
        addrs: list[str] = []
        for tp in target_ranks(side.tp_size, side.tp_rank, self.p_tp):
            pps = [worker.pp_rank] if side.pp_size == self.p_pp else range(self.p_pp)
            addrs.extend(self.addr(tp, pp) for pp in pps if stage is None or pp == stage)
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

    @property
    def max_message_bytes(self) -> int:
        """P's size limit (``message_bytes``); skips the case when the run was not told it."""
        return given(
            self.options.limits.get("message_bytes"),
            "P's size limit",
            "--max-message-bytes or message_bytes in --limits",
        )

    def limit(self, name: str) -> int:
        """P's limit ``name`` (chapter 13); skips the case when the run was not told it."""
        return declared_limit(self.options.limits, name, "P's")

    @property
    def auth_key(self) -> bytes:
        """The key P shares; skips the case when the run was not given one."""
        return given(self.options.auth_key, "P's shared key", "--auth-key-file")

    def sign(self, msg: M) -> M:
        """``msg`` signed when the run has P's key (8.6-R5), else as it is."""
        key = self.options.auth_key
        return msg if key is None else auth.sign(msg, key)

    def encode(self, msg: XferMetadataV2, announce: bool, *, signed: bool = True) -> bytes:
        if announce and signed:
            msg = self.sign(msg)
        return encode_pull(msg, PDWIRE_2 if announce else LEGACY)

    def pull_map(
        self,
        worker: DWorker,
        req_blocks: dict[str, tuple[str, list[list[int]]]],
        *,
        announce: bool = False,
        **fields: Any,
    ) -> dict[str, Any]:
        """A pull as the map that would be sent, keys in their order: to be altered and packed
        by hand."""
        extra = {**(self.announce() if announce else {}), **fields}
        data = self.encode(worker.pull(req_blocks, **extra), announce)
        obj: dict[str, Any] = msgspec.msgpack.decode(data)
        return obj

    async def send(
        self,
        addr: str,
        data: bytes | list[bytes],
        *,
        timeout: float | None = None,
        linger_after: float = 0.0,
        on_reply: Callable[[Reply], None] | None = None,
    ) -> PullResult:
        """Send raw frames on a new DEALER to ``addr``; collect the replies."""
        wait = timeout if timeout is not None else self.options.request_timeout
        got = await exchange(
            self.env.zmq, addr, data, wait, self.log, linger_after=linger_after, on_reply=on_reply
        )
        transfers = _transfers_of(data)
        self._d_reqs.update({tid: d_req for d_req, tid in transfers.items()})
        for d_req in got.ok():  # P may keep a transfer it answered in err_reqs, for a retry
            if d_req in transfers:
                self._settled.add((transfers[d_req], addr))
        return got

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
        on_reply: Callable[[Reply], None] | None = None,
        **fields: Any,
    ) -> PullResult:
        """One pull from ``worker`` to the P worker at ``addr``."""
        extra = {**(self.announce(caps) if announce else {}), **fields}
        msg = worker.pull(req_blocks, with_layout=with_layout, **extra)
        return await self.send(
            addr,
            self.encode(msg, announce),
            timeout=timeout,
            linger_after=linger_after,
            on_reply=on_reply,
        )

    def d_workers(self, d_tp: int | None = None, d_pp: int = 1) -> list[DWorker]:
        """Every worker of a fake D of TP ``d_tp`` (default P's) and PP ``d_pp``."""
        size = d_tp or self.p_tp
        return [self.worker(size, r, d_pp, s) for s in range(d_pp) for r in range(size)]

    async def pull_to_targets(
        self,
        worker: DWorker,
        transfer: str,
        d_req: str,
        blocks: list[int],
        *,
        announce: bool = False,
        **fields: Any,
    ) -> list[tuple[DWorker, str, PullResult]]:
        """``worker``'s pulls of one request, one to each P worker it pairs with, at once."""
        addrs = self.targets(worker)
        req = {d_req: (transfer, worker.group_lists(blocks))}
        results = await asyncio.gather(
            *(self.pull(worker, a, req, announce=announce, **fields) for a in addrs)
        )
        return [(worker, a, r) for a, r in zip(addrs, results, strict=True)]

    async def serve_ready(self, tid: str) -> None:
        """Every D worker pulls the ready transfer ``tid`` (announcing; signed when the run has
        a key), and each pull is served: P did not act on what it refused before."""
        d_req = self.new_d_req()
        taken = {w: w.take(self.blocks_for()) for w in self.d_workers()}
        try:
            for w, blocks in taken.items():
                for _, addr, r in await self.pull_to_targets(w, tid, d_req, blocks, announce=True):
                    self.expect_ok(w, addr, r, d_req)
                self.expect_written(w, blocks)
        finally:
            for w, blocks in taken.items():
                w.give_back(blocks)

    async def cancel(
        self,
        worker: DWorker,
        addr: str,
        reqs: dict[str, str],
        *,
        timeout: float | None = None,
        signed: bool = True,
        port: int | None = None,
    ) -> PullResult:
        """An XferCancel (§3.5) of ``worker``'s pulls for ``reqs`` (d_req_id -> transfer_id),
        on a new DEALER to ``addr``; ``port``: the ``remote_port`` those pulls named, when not
        the engine's."""
        s = worker.side
        msg = XferCancel(
            pdwire_version=CURRENT_VERSION,
            remote_hostname=worker.engine.hostname,
            remote_port=port or worker.engine.port,
            remote_tp_size=s.tp_size,
            remote_tp_rank=s.tp_rank,
            cancel_reqs=reqs,
            remote_pp_size=s.pp_size,
            remote_pp_rank=worker.pp_rank,
            reason="conformance",
        )
        data = encode_cancel(self.sign(msg) if signed else msg)
        return await self.send(addr, data, timeout=timeout)

    async def stop_leg(self, transfer: str, prompt: list[int]) -> HttpResult:
        """The P leg of ``prompt`` with its first token as a stop token (vLLM's
        stop_token_ids): P's request ends at once, so P will not send (§10.11.1). Unsupported
        when P does not return token ids or ignores stop_token_ids."""
        token = await self.first_token(prompt)
        leg = await self.prefill(transfer, prompt=prompt, stop_token_ids=[token])
        self.expect_leg_ok(leg)
        try:
            finish = leg.body["choices"][0]["finish_reason"]
        except (KeyError, IndexError, TypeError):
            finish = None
        if finish != "stop":
            raise Unsupported(f"P ignored stop_token_ids (finish_reason {finish!r})")
        return leg

    async def load(
        self,
        *,
        tokens: int | None = None,
        d_tp: int | None = None,
        d_pp: int = 1,
        announce: bool = False,
        pull_first: bool = False,
        scattered: bool = False,
        transfer: str | None = None,
        prompt: list[int] | None = None,
        blocks: int | None = None,
        leg_params: dict[str, Any] | None = None,
        **fields: Any,
    ) -> Loaded:
        """A whole transfer: P's leg, then every pull of every D worker, each to its paired P
        workers. With ``pull_first`` the pulls go first, and the leg only after P kept them
        unanswered for ``pull_first_quiet`` (a reply before the leg fails the case: P cannot
        know the transfer yet, §10.4). ``blocks``: how many blocks D asks for (default all of
        the prompt's: fewer is a prefix-cache hit); ``leg_params`` adds fields to the P leg's
        kv_transfer_params; ``fields`` override or add fields of every pull."""
        tid = transfer or self.new_transfer_id()
        d_req = self.new_d_req()
        ids = prompt if prompt is not None else self.prompt(tokens)
        n = blocks if blocks is not None else self.blocks_for(len(ids))
        workers = self.d_workers(d_tp, d_pp)
        taken = {w: w.take(n, scattered=scattered) for w in workers}

        def pulls() -> asyncio.Future[list[list[tuple[DWorker, str, PullResult]]]]:
            return asyncio.gather(
                *(
                    self.pull_to_targets(w, tid, d_req, taken[w], announce=announce, **fields)
                    for w in workers
                )
            )

        if pull_first:
            answered = asyncio.Event()
            fields["on_reply"] = lambda _: answered.set()
            pending = pulls()
            early = await _is_set_within(answered, self.pull_first_quiet)
            prefill = await self.prefill(tid, prompt=ids, leg_params=leg_params)
            groups = await pending
            expect(
                not early,
                f"P answered a pull for transfer {tid} before its leg was sent: "
                f"{[r.describe() for g in groups for _, _, r in g]}",
            )
        else:
            prefill = await self.prefill(tid, prompt=ids, leg_params=leg_params)
            self.expect_leg_ok(prefill)
            groups = await pulls()
        return Loaded(tid, d_req, prefill, [p for g in groups for p in g], taken, ids)

    @property
    def pull_first_quiet(self) -> float:
        """How long a pull sent before its leg waits alone: long enough for it to reach P
        before the leg does, short enough to leave most of P's ready wait to the leg."""
        t = self.options.abort_timeout
        return PULL_FIRST_QUIET if t is None else min(PULL_FIRST_QUIET, t / 4)

    def release(self, loaded: Loaded) -> None:
        """Give the transfer's blocks back to the fake D workers."""
        for w, blocks in loaded.blocks.items():
            w.give_back(blocks)

    def expect_loaded(self, loaded: Loaded) -> None:
        """Every pull ended FINISH listing the request ok, every block asked for holds bytes,
        and no byte outside them changed."""
        for w, a, r in loaded.pulls:
            self.expect_ok(w, a, r, loaded.d_req_id)
        for w, blocks in loaded.blocks.items():
            self.expect_written(w, blocks)

    def expect_ok(self, worker: DWorker, addr: str, r: PullResult, d_req: str) -> None:
        """The pull ended FINISH with ``d_req`` in ok_reqs."""
        expect(
            r.status is not None and r.status.name == "FINISH" and d_req in r.ok(),
            f"pull of {describe(worker)} to {addr}: expected FINISH with {d_req} in ok_reqs, "
            f"got {r.describe()}",
        )

    def expect_written(self, worker: DWorker, blocks: list[int]) -> None:
        """Every block asked for holds bytes, and nothing else of the worker's memory changed."""
        missing = worker.unwritten(blocks)
        expect(not missing, f"{describe(worker)}: (region, block) never written: {missing[:8]}")
        stray = worker.stray_bytes()
        expect(
            stray == 0, f"{describe(worker)}: {stray} bytes written outside the blocks asked for"
        )


def describe(worker: DWorker) -> str:
    s = worker.side
    pp = f" PP rank {worker.pp_rank}/{s.pp_size}" if s.pp_size > 1 else ""
    return f"D TP rank {s.tp_rank}/{s.tp_size}{pp}"


def _transfers_of(data: bytes | list[bytes]) -> dict[str, str]:
    """The transfer_id of each D request a pull's bytes name; nothing for what is not a pull."""
    try:
        obj = msgspec.msgpack.decode(data) if isinstance(data, bytes) else None
    except msgspec.DecodeError:
        return {}
    reqs = obj.get("req_blocks") if isinstance(obj, dict) else None
    if not isinstance(reqs, dict):
        return {}
    return {
        d_req: entry[0]
        for d_req, entry in reqs.items()
        if isinstance(d_req, str)
        and isinstance(entry, list)
        and entry
        and isinstance(entry[0], str)
    }


async def _is_set_within(event: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True
