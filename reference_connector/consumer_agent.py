"""The D worker's agent: a ``ConsumerSession`` driven by ZMQ DEALERs and the bootstrap server
(spec §3.1, §4.2).

The agent takes no protocol decision and keeps no timer of its own: the session owns the
receive timeout and the deadline. The agent queries the bootstrap server when told to, sends
each pull (and each cancel and heartbeat) on a new DEALER, feeds back every frame received on it
until the session closes it, and reports the session's verdicts to the engine as callbacks. P
writes the KV straight into the memory the caller registered with the transport before
``start``.

A new DEALER's set-up and its connection's handshake take about half of a pull's round trip on
loopback. So that a pull does not wait for them, the agent keeps one DEALER connected ahead,
never used, per P worker address it sent to in the last ``SPARE_IDLE_S`` (up to
``SPARE_ADDRS``), and sends the next message to that address on it: still a socket of its own,
as 3.1 asks.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, assert_never

import zmq

from pdwire.consumer import ConsumerConfig, ConsumerSession
from pdwire.events import (
    AbortRequested,
    BlocksReleased,
    ClosePull,
    ConsumerInput,
    ConsumerOutput,
    EngineResolved,
    LeaseRejected,
    LoadRequest,
    LoadsRequested,
    QueryBootstrap,
    ReplyReceived,
    RequestFailed,
    RequestLoaded,
    RequestQueued,
    SendPull,
    TimePassed,
)
from pdwire.http_models import EngineEntry
from pdwire.messages import ErrorCode, LeaseHeartbeat, XferCancel, XferMetadata
from pdwire.planning import Side
from pdwire.transitions import LoadState

from . import bootstrap_client
from .loop_thread import DeadlineTimer, LoopThread, on_loop, run_callback
from .metrics import Counts
from .transport import MooncakeTransport

logger = logging.getLogger(__name__)

#: 4.2-R4: the reason every request of the batch fails with when the engine is not found.
ENGINE_NOT_FOUND: Final = "remote engine_id {engine_id} not found from bootstrap server {addr}"
#: How many P worker addresses keep a DEALER connected ahead; the least recently used loses it.
SPARE_ADDRS: Final = 16
#: How long a DEALER connected ahead waits for a message before it is closed: no socket of D's
#: goes on reconnecting to the address of a P worker that D no longer pulls from, or that is gone.
SPARE_IDLE_S: Final = 10.0

#: ``on_loaded(d_req_id, pull_s)``: the request's KV is in its blocks; it may decode. ``pull_s``
#: is the time from the first pull that carried it to the reply that completed it.
OnLoaded = Callable[[str, float], None]
#: ``on_failed(d_req_id, code, reason, blocks_free)``: loading failed for good; free the blocks
#: now only when ``blocks_free``, else on ``on_released``.
OnFailed = Callable[[str, ErrorCode, str, bool], None]
#: ``on_released(d_req_id)``: no write can land in this failed request's blocks any more.
OnReleased = Callable[[str], None]


@dataclasses.dataclass
class _OpenPull:
    addr: str
    socket: zmq.Socket[bytes]


def _kind(message: XferMetadata | XferCancel | LeaseHeartbeat) -> str:
    """The ``kind`` label of a message D sends (a pdwire/2 pull is an ``XferMetadata`` too)."""
    if isinstance(message, XferMetadata):
        return "pull"
    return "cancel" if isinstance(message, XferCancel) else "heartbeat"


def _session_of(transport: MooncakeTransport) -> tuple[str, int]:
    host, _, port = transport.session.rpartition(":")
    return host, int(port)


class ConsumerAgent:
    """One D worker's side channel.

    ``config.hostname``/``config.port`` must name ``transport``'s engine (``config_for`` fills
    them in): that is where P writes. The callbacks run on the agent's loop thread: they must be
    quick and thread-safe; an exception they raise is logged."""

    def __init__(
        self,
        config: ConsumerConfig,
        transport: MooncakeTransport,
        *,
        on_loaded: OnLoaded,
        on_failed: OnFailed,
        on_released: OnReleased,
        query_timeout: float = 30.0,
    ) -> None:
        if (config.hostname, config.port) != _session_of(transport):
            raise ValueError(
                f"the config names {config.hostname}:{config.port} but the transport is at "
                f"{transport.session}: P would write elsewhere (use ConsumerAgent.config_for)"
            )
        self._config = config
        self._session = ConsumerSession(config)
        self._transport = transport
        self._on_loaded = on_loaded
        self._on_failed = on_failed
        self._on_released = on_released
        self._query_timeout = query_timeout
        self._thread = LoopThread(name=f"pdwire-d-{transport.session}")
        self._timer = DeadlineTimer(self._thread.loop, self._on_timer)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pulls: dict[int, _OpenPull] = {}
        # A DEALER connected ahead per P worker address, least recently used first.
        self._spares: collections.OrderedDict[str, zmq.Socket[bytes]] = collections.OrderedDict()
        self._queries: set[asyncio.Task[None]] = set()
        self._closed = False
        self._pulls_sent = 0
        self._replies_received = 0
        self._first_pull: dict[str, float] = {}  # d_req_id -> loop time its first pull left
        self.counts = Counts()

    @classmethod
    def config_for(cls, transport: MooncakeTransport, side: Side, **fields: Any) -> ConsumerConfig:
        """A ``ConsumerConfig`` whose hostname and port are ``transport``'s engine."""
        hostname, port = _session_of(transport)
        return ConsumerConfig(hostname=hostname, port=port, side=side, **fields)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Start the loop thread. Loads asked for before are served from then on."""
        self._thread.start(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Close every socket (linger 0) and stop the loop."""
        if self._thread.alive:
            try:
                self._thread.submit(self._close()).result(timeout)
            except Exception:
                logger.exception("D worker %s: error while closing", self._transport.session)
        self._thread.stop(timeout)
        if not self._ctx.closed:
            self._ctx.destroy(linger=0)

    async def _close(self) -> None:
        self._closed = True
        self._timer.cancel()
        tasks = list(self._queries)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pull_id in list(self._pulls):
            self._close_pull(pull_id)
        for spare in self._spares.values():
            spare.close(linger=0)
        self._spares.clear()
        self._first_pull.clear()
        self._ctx.destroy(linger=0)

    # -- the engine's calls (any thread; they return at once and apply in order) ----------

    def queue(self, request: RequestQueued) -> None:
        """A request whose KV P holds arrived: renew its lease until its load settles (§6.4)."""
        self._thread.call(self._feed, request)

    def load(self, requests: Sequence[LoadRequest]) -> None:
        """Load these requests (one engine step's batch)."""
        self._thread.call(self._feed, LoadsRequested(tuple(requests)))

    def abort(self, d_req_id: str, on_unsent: OnReleased | None = None) -> None:
        """Give up loading ``d_req_id``. ``on_unsent(d_req_id)`` runs (on the loop thread) when
        no pull carried its blocks yet: the session then only asks P to release, and reports
        nothing more for it, so the blocks are the engine's again at once."""
        self._thread.call(self._abort, d_req_id, on_unsent)

    def _abort(self, d_req_id: str, on_unsent: OnReleased | None) -> None:
        unsent = self._session.state_of(d_req_id) is LoadState.RESOLVING
        self._feed(AbortRequested(d_req_id))
        if unsent and on_unsent is not None and not self._closed:
            run_callback("on_unsent", on_unsent, d_req_id)

    @property
    def pulls_sent(self) -> int:
        """Pulls and cancels sent."""
        return self._pulls_sent

    @property
    def replies_received(self) -> int:
        return self._replies_received

    @property
    def open_sockets(self) -> int:
        """Sockets of pulls, cancels and heartbeats still open (the spares not counted)."""
        return len(self._pulls)

    @property
    def spare_addrs(self) -> list[str]:
        """The P worker addresses with a DEALER connected ahead, least recently used first."""
        return list(self._spares)

    def metrics(self) -> dict[str, Any]:
        """The agent's counts, with the leases its session renews (``metrics.Counts``)."""

        async def read() -> dict[str, Any]:
            snapshot = self.counts.snapshot()
            snapshot["values"]["pdwire_d_leases"] = {"": self._session.leases}
            return snapshot

        return on_loop(self._thread, read(), self.counts.snapshot)

    # -- the loop thread ---------------------------------------------------------------------

    def _on_timer(self) -> None:
        self._feed(TimePassed())

    def _feed(self, event: ConsumerInput) -> None:
        if self._closed:
            return
        try:
            out = self._session.handle(event, self._thread.time())
        except Exception:
            logger.exception(
                "D worker %s: the session refused %s", self._transport.session, type(event)
            )
            out = []
        for output in out:
            self._dispatch(output)
        self._timer.arm(self._session.next_deadline())

    def _dispatch(self, output: ConsumerOutput) -> None:
        match output:
            case SendPull():
                self._send_pull(output)
            case ClosePull(pull_id=pull_id):
                self._close_pull(pull_id)
            case QueryBootstrap(engine_id=engine_id, bootstrap_addr=addr):
                task = asyncio.create_task(self._resolve(engine_id, addr), name=f"query {addr}")
                self._queries.add(task)
                task.add_done_callback(self._queries.discard)
            case RequestLoaded(d_req_id=d_req):
                sent = self._first_pull.pop(d_req, None)
                took = 0.0 if sent is None else self._thread.time() - sent
                self.counts.inc("pdwire_d_loads_total", "loaded")
                self.counts.observe("pdwire_d_pull_seconds", took)
                run_callback("on_loaded", self._on_loaded, d_req, took)
            case RequestFailed(d_req_id=d_req, code=code, reason=reason, blocks_free=free):
                self._first_pull.pop(d_req, None)
                self.counts.inc("pdwire_d_loads_total", "failed")
                self.counts.inc("pdwire_d_failures_total", str(code))
                run_callback("on_failed", self._on_failed, d_req, code, reason, free)
            case BlocksReleased(d_req_id=d_req):
                self._first_pull.pop(d_req, None)
                run_callback("on_released", self._on_released, d_req)
            case LeaseRejected(addr=addr, reason=reason):
                logger.warning(
                    "P worker %s refused a KV lease renewal (%s): set the same "
                    "kv_lease_duration on P and D",
                    addr,
                    reason,
                )
            case _:
                assert_never(output)

    async def _resolve(self, engine_id: str, addr: str) -> None:
        entry: EngineEntry | None = None
        try:
            reply = await bootstrap_client.query(addr, timeout=self._query_timeout)
        except bootstrap_client.BootstrapError as exc:
            logger.warning("query of %s for engine %s failed: %s", addr, engine_id, exc)
        except Exception:
            logger.exception("query of %s for engine %s failed", addr, engine_id)
        else:
            entry = next((e for e in reply.root.values() if e.engine_id == engine_id), None)
        error = "" if entry is not None else ENGINE_NOT_FOUND.format(engine_id=engine_id, addr=addr)
        self._feed(EngineResolved(engine_id, entry, error))

    def _dealer(self, addr: str) -> zmq.Socket[bytes]:
        """A new DEALER connected to ``addr``; raises ``zmq.ZMQError`` for a bad address."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if "[" in addr:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _restock(self, addr: str) -> None:
        """Connect the next DEALER to ``addr`` ahead of its use. It runs once a pull to the
        address closed, not while that pull's reply is due: the loop, and the interpreter a D
        worker may share with P's, has time for it then."""
        if self._closed or addr in self._spares:
            return
        spare = self._spares[addr] = self._dealer(addr)  # a pull to the address connected
        self._thread.loop.call_later(SPARE_IDLE_S, self._retire, addr, spare)
        while len(self._spares) > SPARE_ADDRS:
            _, oldest = self._spares.popitem(last=False)
            oldest.close(linger=0)

    def _retire(self, addr: str, spare: zmq.Socket[bytes]) -> None:
        """Close ``spare`` if it is still the unused DEALER of ``addr``."""
        if self._spares.get(addr) is spare:
            del self._spares[addr]
            spare.close(linger=0)

    def _send_pull(self, pull: SendPull) -> None:
        sock = self._spares.pop(pull.addr, None)
        if sock is None:
            try:
                sock = self._dealer(pull.addr)
            except zmq.ZMQError as exc:
                # Nothing more to do here: the session's receive timeout ends the pull.
                logger.error("pull %d: cannot connect to %s: %s", pull.pull_id, pull.addr, exc)
                return
        self._pulls_sent += 1
        self.counts.inc("pdwire_d_messages_sent_total", _kind(pull.message))
        if isinstance(pull.message, XferMetadata):
            now = self._thread.time()
            for d_req, (_, blocks) in pull.message.req_blocks.items():
                if any(blocks):  # a release-only pull never loads
                    self._first_pull.setdefault(d_req, now)
        self._open(pull.pull_id, pull.addr, sock, [pull.data])

    def _open(self, pull_id: int, addr: str, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Send ``frames`` on ``sock`` and read its replies until the pull closes. A DEALER queues
        a message for a connection still being made, so the send does not block."""
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the session's receive timeout ends the pull
            logger.warning("pull %d: not sent: %r", pull_id, exc)
        self._pulls[pull_id] = _OpenPull(addr, sock)
        self._thread.loop.add_reader(sock.FD, self._read, pull_id, sock)
        # The FD signals edges: a reply already waiting would not wake the reader.
        if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._thread.loop.call_soon(self._read, pull_id, sock)

    def _read(self, pull_id: int, sock: zmq.Socket[bytes]) -> None:
        """Feed every reply waiting on the pull's socket, until it closes."""
        while not sock.closed:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                logger.warning("pull %d: receive failed: %s", pull_id, exc)
                return
            self._replies_received += 1
            self._feed(ReplyReceived(pull_id, data))

    def _close_pull(self, pull_id: int) -> None:
        pull = self._pulls.pop(pull_id, None)
        if pull is None:
            return
        self._thread.loop.remove_reader(pull.socket.FD)
        pull.socket.close(linger=0)
        self._thread.loop.call_soon(self._restock, pull.addr)
