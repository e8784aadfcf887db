"""The P worker's agent: a ``ProducerSession`` driven by a ZMQ ROUTER, the Mooncake transfer
engine and the bootstrap server (spec §3.1, §4.1, §4.4).

The agent takes no protocol decision. It binds the side-channel ROUTER, registers it, and then
only moves things between the session and real I/O: frames in, replies out, writes to the
transfer engine (on a thread pool, never on the loop), and the session's outputs for the engine
as callbacks. Everything the session sees happens on the agent's loop thread, with the loop's
monotonic clock as ``now``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, assert_never

import zmq

from pdwire.events import (
    FreeBlocks,
    FreeReason,
    MessageReceived,
    ProducerInput,
    ProducerOutput,
    RejectRequest,
    SendReply,
    StartWrite,
    TimePassed,
    TransferFinished,
    TransferStarted,
    TransferWillNotSend,
    WriteCompleted,
)
from pdwire.http_models import RegisterWorkerPayload
from pdwire.messages import ErrorCode, XferResponse, XferResponseStatus
from pdwire.negotiation import Offer
from pdwire.producer import ProducerConfig, ProducerSession
from pdwire.versions import PDWIRE_2, Capability

from . import bootstrap_client
from .loop_thread import DeadlineTimer, LoopThread, on_loop, run_callback
from .metrics import Counts
from .transport import ENGINE_RAISED, OK, MooncakeTransport

logger = logging.getLogger(__name__)
#: A batch write that takes longer is logged: D is waiting on it.
SLOW_WRITE_S = 5.0
#: How many completed batch writes ``recent_writes`` keeps.
RECENT_WRITES = 256
#: How many messages one turn of the loop takes from the ROUTER before other work runs.
RECEIVE_BATCH = 64

#: ``on_free(p_req_id, transfer_id, reason)``: P may free the request's blocks now.
OnFree = Callable[[str, str, FreeReason], None]
#: ``on_reject(p_req_id, transfer_id, code, message)``: fail the request's HTTP leg (§10.11.8).
OnReject = Callable[[str, str, ErrorCode, str], None]


@dataclasses.dataclass(frozen=True, slots=True)
class WriteTime:
    """One completed batch write: the D requests it carried, when the transfer engine call
    started (``time.monotonic()``, one clock for every process of the host) and how long it
    took, and what it moved (bytes counted only when its status was 0)."""

    d_req_ids: tuple[str, ...]
    started: float
    seconds: float
    descriptors: int
    nbytes: int
    status: int


def _count_reply(counts: Counts, reply: XferResponse) -> None:
    """A reply sent, and each request it failed by its error code (UNKNOWN: a legacy reply
    names none); an ERROR that lists no request fails the pull, counted once."""
    counts.inc("pdwire_p_replies_sent_total", reply.status.name)
    code = getattr(reply, "err_code", None) or "UNKNOWN"
    codes = getattr(reply, "err_codes", None) or {}
    failed = reply.err_reqs or ([""] if reply.status is XferResponseStatus.ERROR else [])
    for d_req in failed:
        counts.inc("pdwire_p_failures_total", codes.get(d_req) or code)


class AgentStartError(RuntimeError):
    """The agent could not start: its socket could not be bound or its registration failed."""


def _endpoint_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ProducerAgent:
    """One P worker's side channel.

    ``on_free`` and ``on_reject`` run on the agent's loop thread: they must be quick (hand the
    work to the engine's own thread) and thread-safe; an exception they raise is logged.
    ``sender_threads`` is how many batch writes may run at once, to as many D workers: the
    writes to one D worker run one after another (``_start_write``). ``announce`` says whether the
    registration carries the pdwire/2 fields (``pdwire_version``, ``pdwire_caps``, ``tp_size``,
    ``pp_size``, and ``fingerprint`` when ``fingerprint`` is announced); by default it does
    exactly when the config's profile is pdwire/2 (4.1-R9 to R11). ``host`` is the worker's IP:
    the ROUTER binds there on a random port, and that endpoint is what it registers.
    """

    def __init__(
        self,
        config: ProducerConfig,
        transport: MooncakeTransport,
        *,
        bootstrap_url: str,
        engine_id: str,
        on_free: OnFree,
        on_reject: OnReject,
        dp_rank: int = 0,
        tp_rank: int | None = None,
        pp_rank: int = 0,
        host: str = "127.0.0.1",
        sender_threads: int = 4,
        announce: bool | None = None,
        register_timeout: float = 30.0,
    ) -> None:
        if tp_rank is not None and tp_rank != config.side.tp_rank:
            raise ValueError(f"tp_rank {tp_rank} differs from the config's {config.side.tp_rank}")
        if sender_threads < 1:
            raise ValueError(f"sender_threads must be at least 1, got {sender_threads}")
        self._config = config
        self._session = ProducerSession(config)
        self._transport = transport
        self._bootstrap_url = bootstrap_url
        self._engine_id = engine_id
        self._ranks = (dp_rank, config.side.tp_rank, pp_rank)
        self._host = host
        self._announce = config.profile == PDWIRE_2 if announce is None else announce
        self._register_timeout = register_timeout
        self._on_free = on_free
        self._on_reject = on_reject
        self._thread = LoopThread(name=f"pdwire-p-{engine_id}-{dp_rank}.{config.side.tp_rank}")
        self._timer = DeadlineTimer(self._thread.loop, self._on_timer)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=sender_threads, thread_name_prefix="pdwire-p-sender"
        )
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._serving = False
        self._address = ""
        self._closed = False
        self._counted = threading.Condition()
        self._pulls_received = 0
        self._writes = 0
        self._recent: collections.deque[WriteTime] = collections.deque(maxlen=RECENT_WRITES)
        # Per D worker (``StartWrite.peer``) with a write running: the writes queued behind it.
        self._queued: dict[str, collections.deque[StartWrite]] = {}
        self._queued_lock = threading.Lock()
        self.counts = Counts()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Bind the ROUTER, register it at the bootstrap server (with its retries), then serve.

        Raises ``AgentStartError`` when registration fails or takes longer than ``timeout``; the
        agent is stopped then."""
        self._thread.start()
        future = self._thread.submit(self._open())
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.stop()
            raise AgentStartError(
                f"P worker {self._describe()} did not register at {self._bootstrap_url} "
                f"within {timeout}s"
            ) from None
        except BaseException:
            self.stop()
            raise

    async def _open(self) -> None:
        self._bind()
        await self._register()
        # 4.4-R6: pulls are served only once registered; earlier ones wait in the socket.
        self._serve()

    def _bind(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host = _endpoint_host(self._host)
        if host.startswith("["):
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            raise AgentStartError(f"cannot bind the side channel on tcp://{host}: {exc}") from exc
        self._address = f"tcp://{host}:{port}"

    async def _register(self) -> None:
        try:
            await bootstrap_client.register(
                self._bootstrap_url,
                self._payload(),
                timeout=self._register_timeout,
                auth_key=self._config.auth_key if self._announce else None,
            )
        except bootstrap_client.BootstrapError as exc:
            raise AgentStartError(
                f"P worker {self._describe()} at {self._address} could not register at the "
                f"bootstrap server {self._bootstrap_url}: {exc}"
            ) from exc

    def _serve(self) -> None:
        assert self._sock is not None
        self._serving = True
        self._thread.loop.add_reader(self._sock.FD, self._receive)
        self._thread.loop.call_soon(self._receive)  # pulls that came before registration
        logger.info("P worker %s serving at %s", self._describe(), self._address)

    def _describe(self) -> str:
        dp, tp, pp = self._ranks
        return f"{self._engine_id} dp={dp} tp={tp} pp={pp}"

    def _payload(self) -> RegisterWorkerPayload:
        dp, tp, pp = self._ranks
        fields: dict[str, Any] = {
            "engine_id": self._engine_id,
            "dp_rank": dp,
            "tp_rank": tp,
            "pp_rank": pp,
            "addr": self._address,
        }
        if self._announce:
            config = self._config
            offer = Offer.of(config.profile, config.caps)
            send_fingerprint = Capability.FINGERPRINT.value in offer.caps
            fields.update(
                pdwire_version=offer.version,
                pdwire_caps=sorted(offer.caps),
                tp_size=config.side.tp_size,
                pp_size=config.side.pp_size,
                fingerprint=config.fingerprint if send_fingerprint else None,
            )
        return RegisterWorkerPayload(**fields)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the socket (linger 0), wait for the writes in flight, stop the loop. The
        transport (and the memory registered with it) is the caller's to close afterwards."""
        if self._thread.alive:
            try:
                self._thread.submit(self._close()).result(timeout)
            except Exception:
                logger.exception("P worker %s: error while closing", self._describe())
        # Waits for writes in flight: their memory must stay registered until they end.
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._thread.stop(timeout)

    async def _close(self) -> None:
        self._closed = True
        self._timer.cancel()
        self._stop_serving()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    # -- the engine's calls (any thread; they return at once and apply in order) ----------

    def transfer_started(self, transfer_id: str, p_req_id: str) -> None:
        """The scheduler admitted the request that produces ``transfer_id``."""
        self._thread.call(self._feed, TransferStarted(transfer_id, p_req_id))

    def transfer_finished(self, transfer_id: str, p_req_id: str, blocks: list[list[int]]) -> None:
        """The request's KV is ready in ``blocks`` (per KV-cache group)."""
        self._thread.call(self._feed, TransferFinished(transfer_id, p_req_id, blocks))

    def transfer_will_not_send(self, transfer_id: str, p_req_id: str, reason: str = "") -> None:
        """The request ended without KV to send (a stop token, an abort, an error)."""
        self._thread.call(self._feed, TransferWillNotSend(transfer_id, p_req_id, reason))

    # -- counters ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The registered side-channel endpoint, ``tcp://host:port`` ("" before ``start``)."""
        return self._address

    @property
    def pulls_received(self) -> int:
        """Two-frame messages received: pulls, cancels and heartbeats."""
        return self._pulls_received

    @property
    def replies_sent(self) -> int:
        return int(self.counts.total("pdwire_p_replies_sent_total"))

    @property
    def writes(self) -> int:
        """Batch writes the session asked for (those queued behind another included)."""
        return self._writes

    @property
    def bytes_written(self) -> int:
        """Bytes of the batch writes that completed with status 0."""
        return int(self.counts.total("pdwire_p_written_bytes_total"))

    def metrics(self) -> dict[str, Any]:
        """The agent's counts, with its session's transfers by state (``metrics.Counts``)."""

        async def read() -> dict[str, Any]:
            snapshot = self.counts.snapshot()
            snapshot["values"]["pdwire_p_transfers"] = self._session.transfers_by_state()
            return snapshot

        return on_loop(self._thread, read(), self.counts.snapshot)

    @property
    def recent_writes(self) -> list[WriteTime]:
        """The last ``RECENT_WRITES`` completed batch writes, oldest first."""
        return list(self._recent)

    def wait_pulls(self, count: int, timeout: float) -> bool:
        """Block until ``pulls_received >= count``; False if ``timeout`` passed first."""
        with self._counted:
            return self._counted.wait_for(lambda: self._pulls_received >= count, timeout)

    # -- the loop thread ---------------------------------------------------------------------

    def _receive(self) -> None:
        """Take every message waiting on the ROUTER. Its FD signals edges, not levels: it is
        readable again only once the socket has been drained, so one call takes them all, up to
        ``RECEIVE_BATCH`` before it yields the loop to other work and comes back."""
        sock = self._sock
        for _ in range(RECEIVE_BATCH):
            if not self._serving or sock is None:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # the socket is closing
                logger.warning("%s: receive failed: %r", self._address, exc)
                return
            try:
                self._on_frames(frames)
            except Exception:  # the messages behind this one must still be taken
                logger.exception("%s: a message was not handled", self._address)
        self._thread.loop.call_soon(self._receive)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            logger.warning(
                "%s: dropped a message of %d frames (3.1-R5)", self._address, len(frames)
            )
            return
        identity, data = frames
        with self._counted:
            self._pulls_received += 1
            self._counted.notify_all()
        self.counts.inc("pdwire_p_messages_received_total")
        self._feed(MessageReceived(identity, data))

    def _stop_serving(self) -> None:
        """Take no more messages from the ROUTER (replies may still be sent)."""
        if self._serving and self._sock is not None:
            self._thread.loop.remove_reader(self._sock.FD)
        self._serving = False

    def _on_timer(self) -> None:
        self._feed(TimePassed())

    def _feed(self, event: ProducerInput) -> None:
        if self._closed:
            return
        try:
            out = self._session.handle(event, self._thread.time())
        except Exception:
            logger.exception("P worker %s: the session refused %s", self._describe(), type(event))
            out = []
        for output in out:
            self._dispatch(output)
        self._timer.arm(self._session.next_deadline())

    def _dispatch(self, output: ProducerOutput) -> None:
        match output:
            case SendReply(identity=identity, reply=reply, data=data):
                self._send(identity, data)
                _count_reply(self.counts, reply)
            case StartWrite():
                self._start_write(output)
            case FreeBlocks(p_req_id=p_req, transfer_id=transfer_id, reason=reason):
                run_callback("on_free", self._on_free, p_req, transfer_id, reason)
            case RejectRequest(p_req_id=p_req, transfer_id=transfer_id, code=code, message=msg):
                run_callback("on_reject", self._on_reject, p_req, transfer_id, code, msg)
            case _:
                assert_never(output)

    def _send(self, identity: bytes, data: bytes) -> None:
        self._send_frames([identity, data])

    def _send_frames(self, frames: list[bytes]) -> None:
        """Send at once: a ROUTER never blocks a send (it drops a message to a peer that is gone
        or whose queue is full). A send may take the FD's edge for messages already waiting, so
        the receive looks again."""
        assert self._sock is not None
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("%s: reply not sent: %r", self._address, exc)
        if self._serving and int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._thread.loop.call_soon(self._receive)

    def _start_write(self, write: StartWrite) -> None:
        """Start ``write`` now, or right after the writes queued to the same D worker. Batches
        to one engine that run side by side share its connection and slow each other down: in
        the runtime benchmark's throughput case, 4 at once moved half the requests per second
        of 1 at a time (``docs/benchmarks.md``). The sender thread that ran a write runs the
        next one queued to its D worker without a hop through the loop."""
        self._writes += 1
        with self._queued_lock:
            queued = self._queued.get(write.peer)
            if queued is not None:
                queued.append(write)
                return
            self._queued[write.peer] = collections.deque()
        try:
            self._executor.submit(self._write_in_turn, write)
        except RuntimeError:  # the executor is shut down: the agent is stopping
            logger.warning("%s: write %d not started: stopping", self._address, write.write_id)
            with self._queued_lock:
                del self._queued[write.peer]

    def _write_in_turn(self, write: StartWrite) -> None:
        """On a sender thread: ``write``, then each write queued behind it to its D worker."""
        while True:
            t0 = time.monotonic()
            try:
                status = self._transport.write(write.peer, write.descriptors)
            except Exception as exc:
                logger.error("%s: write %d raised: %r", self._address, write.write_id, exc)
                status = ENGINE_RAISED
            self._thread.call(self._write_done, write, status, t0, time.monotonic() - t0)
            with self._queued_lock:
                queued = self._queued[write.peer]
                if self._closed or not queued:
                    del self._queued[write.peer]
                    return
                write = queued.popleft()

    def _write_done(self, write: StartWrite, status: int, started: float, took: float) -> None:
        """On the loop: the engine's status of ``write``, when it started and how long it took
        (timed on the sender thread: waiting for a thread and the hop back are not the
        write's)."""
        if took > SLOW_WRITE_S:  # D waits on it: say which write, for whom
            logger.warning(
                "%s: write %d to %s for %s took %.1fs",
                self._address, write.write_id, write.peer, write.d_req_ids, took,
            )  # fmt: skip
        nbytes = write.descriptors.total_bytes if status == OK else 0
        self.counts.inc("pdwire_p_writes_total", "ok" if status == OK else "failed")
        self.counts.inc("pdwire_p_written_bytes_total", by=nbytes)
        self.counts.observe("pdwire_p_write_seconds", took)
        self._recent.append(
            WriteTime(write.d_req_ids, started, took, len(write.descriptors), nbytes, status)
        )
        self._feed(WriteCompleted(write.write_id, status))
