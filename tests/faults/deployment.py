"""Processes for the fault tests: ``pdwire node`` (through ``conformance.testees``),
``pdwire bootstrap`` and ``pdwire proxy`` on free loopback ports with short timers; requests
timed against the bound each fault allows; the end check that both pools are empty again."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import httpx

from conformance.testees import (
    ABORT_TIMEOUT,
    ChildProcess,
    Role,
    Testee,
    TesteeError,
    free_port,
    spawn_node,
)
from pdwire.versions import PDWIRE_2

logger = logging.getLogger(__name__)

#: How late past its bound a request may end, or a pool drain, on a loaded 2-core machine.
SLACK: Final = 2.0
#: P's abort timeout (ready wait, retention): the testees' own, 2 s.
ABORT: Final = ABORT_TIMEOUT
#: D's receive timeout per pull, instead of abort + 60 s. At 3 s, a pull of a plain transfer
#: once got no reply in time on CI's loaded machine (test_p_restart's first transfer).
RECEIVE: Final = 6.0
#: The slow P's prefill (--prefill-delay), past D's deadline or P's ready wait, and long enough
#: that the test acts while the pull waits at P even when the pull reached P late.
SLOW_PREFILL: Final = 6.0
#: D's front-end backstop on a load (--load-timeout): far above every timer here.
LOAD_TIMEOUT: Final = 20.0
POLL: Final = 0.1  # polling another process's counters: nothing to await
START_TIMEOUT: Final = 60.0


# -- processes -------------------------------------------------------------------------------


@dataclasses.dataclass
class Service(ChildProcess):
    """A ``pdwire bootstrap`` or ``pdwire proxy`` process."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


def _spawn(name: str, args: Sequence[str]) -> tuple[subprocess.Popen[bytes], Path]:
    fd, log = tempfile.mkstemp(prefix=f"pdwire-fault-{name}-", suffix=".log")
    os.close(fd)
    with open(log, "ab") as out:  # O_APPEND: the harness appends lines too (print_stacks)
        cmd = [sys.executable, "-m", "pdwire", name, *args]
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return process, Path(log)


def _wait_http(service: Service, path: str, ok: Callable[[httpx.Response], bool]) -> Service:
    deadline = time.monotonic() + START_TIMEOUT
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if not service.alive():
                break
            try:
                if ok(http.get(f"{service.url}{path}")):
                    return service
            except httpx.HTTPError:
                pass
            time.sleep(POLL)
    tail = service.log_tail()
    service.stop()
    raise TesteeError(f"{service.name} at {service.url} did not get ready:\n{tail}")


def start_bootstrap(port: int | None = None) -> Service:
    """``pdwire bootstrap`` on ``port`` (a free one by default); returns once it serves."""
    port = port or free_port()
    process, log = _spawn("bootstrap", ["--port", str(port)])
    service = Service("bootstrap", f"http://127.0.0.1:{port}", process, log)
    return _wait_http(service, "/query", lambda r: r.status_code == 200)


def start_proxy(
    prefill: str, bootstrap: str, decode: str, profile: str = PDWIRE_2, *, ready: bool = True
) -> Service:
    """``pdwire proxy``; returns once it is ready (P healthy, an engine at ``bootstrap``), or
    with ``ready=False`` once it serves (answering 503 until then)."""
    port = free_port()
    args = ["--port", str(port), "--prefill", f"{prefill}@{bootstrap}", "--decode", decode]
    process, log = _spawn("proxy", [*args, "--profile", profile, "--timeout", "60"])
    service = Service("proxy", f"http://127.0.0.1:{port}", process, log)
    return _wait_http(service, "/health", lambda r: r.status_code == 200 or not ready)


def node(
    role: Role,
    *,
    profile: str = PDWIRE_2,
    tp: int = 1,
    prefill_delay: float = 0.0,
    abort_timeout: float = ABORT,
    extra: Sequence[str] = (),
    bootstrap: str = "",
    bootstrap_port: int = 0,
    port: int = 0,
    wait: bool = True,
) -> Testee:
    """A node with the fault tests' short timers, its API on ``port`` (0: a free one);
    ``wait=False`` returns before it is up."""
    flags = ["--load-timeout", str(LOAD_TIMEOUT), *extra]
    if role == "decode":
        flags += ["--receive-timeout", str(RECEIVE)]
    if prefill_delay:
        flags += ["--prefill-delay", str(prefill_delay)]
    testee = spawn_node(
        role,
        tp=tp,
        profile=profile,
        abort_timeout=abort_timeout,
        extra=flags,
        bootstrap=bootstrap,
        bootstrap_port=bootstrap_port,
        port=port,
    )
    if wait:
        testee.wait_healthy(START_TIMEOUT)
    return testee


def stats(testee: Testee) -> dict[str, Any]:
    reply = httpx.get(f"{testee.url}/pdwire/stats", timeout=5.0)
    reply.raise_for_status()
    body: dict[str, Any] = reply.json()
    return body


def engine_id(testee: Testee) -> str:
    return str(stats(testee)["engine_id"])


def worker_pids(testee: Testee) -> list[int]:
    return [int(w["pid"]) for w in stats(testee)["workers"]]


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie child of ours counts as gone; the workers are not our children
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def log_has(part: Testee | Service, text: str) -> bool:
    try:
        return text in part.log_path.read_text(errors="replace")
    except OSError:
        return False


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; the seconds it took. Fails after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 >= timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(POLL)
    return time.monotonic() - t0


def kill(testee: Testee) -> list[int]:
    """SIGKILL a node's front; its workers exit on their own once it is gone. Returns their
    pids, gone by then."""
    pids = worker_pids(testee)
    testee.process.kill()
    testee.process.wait(10.0)
    wait_for(lambda: all(pid_gone(p) for p in pids), 10.0, f"workers {pids} exit")
    return pids


def pulls_received(p: Testee) -> int:
    return sum(int(w.get("pulls_received", 0)) for w in stats(p)["workers"])


class Deployment:
    """What one test started; ``stop`` stops every part, also after a failure."""

    def __init__(self) -> None:
        self.parts: list[Testee | Service] = []

    def node(self, role: Role, **options: Any) -> Testee:
        testee = node(role, **options)
        self.parts.append(testee)
        return testee

    def nodes(self, *specs: tuple[Role, dict[str, Any]]) -> list[Testee]:
        """Start several nodes at once (their start-up is mostly imports)."""
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(node, role, **options) for role, options in specs]
            started: list[Testee] = []
            for future in futures:
                try:
                    started.append(future.result())
                except Exception:
                    for f in futures:
                        if f.exception() is None:
                            self.parts.append(f.result())
                    raise
        self.parts.extend(started)
        return started

    def bootstrap(self, port: int | None = None) -> Service:
        service = start_bootstrap(port)
        self.parts.append(service)
        return service

    def proxy(
        self, prefill: str, bootstrap: str, decode: Testee, profile: str, *, ready: bool = True
    ) -> Service:
        """``start_proxy`` for the P node at URL ``prefill``."""
        service = start_proxy(prefill, bootstrap, decode.url, profile, ready=ready)
        self.parts.append(service)
        return service

    def stop(self) -> None:
        threads = [threading.Thread(target=part.stop) for part in reversed(self.parts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.parts.clear()


# -- requests --------------------------------------------------------------------------------


def prompt(i: int) -> str:
    return f"fault probe {i} the quick brown fox jumps over the lazy dog"


def new_transfer_id() -> str:
    return f"xfer-{uuid.uuid4()}"


def p_body(text: str, transfer_id: str, **extra: Any) -> dict[str, Any]:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    return {"prompt": text, "max_tokens": 1, "kv_transfer_params": params, **extra}


def d_body(
    text: str,
    transfer_id: str,
    engine: str,
    bootstrap: str,
    deadline_ms: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": bootstrap,
        "remote_engine_id": engine,
        "transfer_id": transfer_id,
    }
    if deadline_ms is not None:
        params["deadline_ms"] = deadline_ms
    return {"prompt": text, "max_tokens": 4, "kv_transfer_params": params, **extra}


@dataclasses.dataclass
class Tracked:
    """One request and the bound, in seconds from sending it, by which it must be terminal."""

    name: str
    bound: float
    future: concurrent.futures.Future[httpx.Response] = dataclasses.field(
        default_factory=concurrent.futures.Future
    )
    sent: float | None = None  # None while it waits for a free client thread
    ended: float | None = None

    @property
    def took(self) -> float:
        assert self.sent is not None and self.ended is not None, f"{self.name} is not over"
        return self.ended - self.sent

    def state(self) -> str:
        """Where the request is, for a failure's report."""
        if self.sent is None:
            return f"{self.name}: waiting for a client thread"
        if self.ended is None:
            return f"{self.name}: no answer {time.monotonic() - self.sent:.2f}s after it was sent"
        return f"{self.name}: {self.outcome()} after {self.took:.2f}s (bound {self.bound}s)"

    def response(self) -> httpx.Response:
        """The response; HTTP-level failures (the peer died) are raised."""
        return self.future.result(0)

    def outcome(self) -> str:
        """``HTTP <status>``, or the transport error that ended the request."""
        error = self.future.exception(0)
        return f"HTTP {self.response().status_code}" if error is None else type(error).__name__


class Requests:
    """Requests in flight, each with the bound by which it must reach a terminal response."""

    def __init__(self, concurrency: int = 16) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        self._http = httpx.Client(limits=limits)
        self.tracked: list[Tracked] = []

    def post(self, name: str, url: str, body: dict[str, Any], bound: float) -> Tracked:
        tracked = Tracked(name, bound)
        self._pool.submit(self._send, tracked, f"{url}/v1/completions", body)
        self.tracked.append(tracked)
        return tracked

    def _send(self, tracked: Tracked, url: str, body: dict[str, Any]) -> None:
        tracked.sent = time.monotonic()
        timeout = tracked.bound + SLACK + 5.0  # the client never waits forever either
        try:
            response = self._http.post(url, json=body, timeout=timeout)
        except BaseException as exc:
            tracked.ended = time.monotonic()
            tracked.future.set_exception(exc)
        else:
            tracked.ended = time.monotonic()
            tracked.future.set_result(response)

    def terminal(self, *tracked: Tracked, queue: float = 30.0) -> list[Tracked]:
        """Every request (default: all so far) ended by its bound + SLACK after it was sent;
        ``queue`` bounds the wait for a client thread."""
        chosen = list(tracked or self.tracked)
        for t in chosen:
            wait_for(functools.partial(_is_sent, t), queue, f"{t.name} sent")
            assert t.sent is not None
            left = t.sent + t.bound + SLACK - time.monotonic()
            try:
                t.future.exception(max(0.0, left))
            except concurrent.futures.TimeoutError:
                raise AssertionError(
                    f"{t.name} not terminal within {t.bound}s + {SLACK}s"
                ) from None
            assert t.took <= t.bound + SLACK, f"{t.name} took {t.took:.2f}s, bound {t.bound}s"
            logger.info("%s", t.state())
        return chosen

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()


def blocks_in_use(testee: Testee) -> int:
    return int(stats(testee)["blocks_in_use"])


def _empty(testee: Testee) -> bool:
    return blocks_in_use(testee) == 0


def _is_sent(tracked: Tracked) -> bool:
    return tracked.sent is not None


def pools_drained(*nodes: Testee, timeout: float) -> dict[str, float]:
    """Every node's pool is empty within ``timeout`` seconds; the seconds each took."""
    t0 = time.monotonic()
    took: dict[str, float] = {}
    for testee in nodes:
        left = max(0.0, timeout - (time.monotonic() - t0))
        name = f"{testee.role}@{testee.url}"
        try:
            wait_for(functools.partial(_empty, testee), left, f"{name} holds no block")
        except AssertionError:
            raise AssertionError(f"{name} still holds {blocks_in_use(testee)} blocks") from None
        took[name] = time.monotonic() - t0
    logger.info("pools drained: %s", {k: round(v, 2) for k, v in took.items()})
    return took


def loaded(t: Tracked) -> dict[str, Any]:
    """D's response to ``t``: 200, with every loaded byte verified."""
    reply = t.response()
    assert reply.status_code == 200, f"{t.name}: {reply.status_code} {reply.text}"
    body: dict[str, Any] = reply.json()
    assert body["pdwire"]["verified"] is True, body["pdwire"]
    return body


def load_failed(t: Tracked) -> str:
    """D's response to ``t``: the 500 of a failed load; returns its message."""
    reply = t.response()
    assert reply.status_code == 500, f"{t.name}: {reply.status_code} {reply.text}"
    message: str = reply.json()["message"]
    assert message.startswith("KV load failed: "), message
    return message


def transfer(
    requests: Requests,
    p: Testee,
    d: Testee,
    i: int,
    *,
    d_bound: float,
    p_bound: float = 10.0,
    deadline_ms: int | None = None,
    bootstrap: str = "",
    engine: str = "",
    together: bool = True,
) -> tuple[Tracked, Tracked]:
    """Both legs of request ``i`` at once, as the proxy sends them (P's KV to D), or the P leg
    to its end first (``together=False``: D pulls KV that is ready)."""
    tid = new_transfer_id()
    p_leg = requests.post(f"P leg {i}", p.url, p_body(prompt(i), tid), p_bound)
    if not together:
        requests.terminal(p_leg)
    body = d_body(prompt(i), tid, engine or engine_id(p), bootstrap or p.bootstrap, deadline_ms)
    return p_leg, requests.post(f"D leg {i}", d.url, body, d_bound)
