"""Registration cases: how a P's workers register at the bootstrap server, and where (§4.4).
Each case starts a P of its own against a scripted bootstrap server that lets every attempt
time out, refuses it, or accepts it late."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Final

import zmq
import zmq.asyncio

from pdwire import error_strings

from ..case import CaseFailed, case, expect
from ..peers.http import listens
from ..peers.loop_lag import LoopLag
from ..peers.registrar import Attempt, Script
from .registration_env import PORTLESS_HOST, Deployment, RegistrationCtx

#: How late P's own timers may fire, as the harness sees them, on a loaded machine (a backoff
#: of 1 s has been seen to end 1.84 s late while the test suite ran on two workers and two cores).
#: A P that does not back off at all still shows: its next attempt comes at once.
SLACK_S: Final = 3.0
#: How much earlier than P's backoff the next attempt may be seen, besides any stall of the
#: harness's loop when it read the request (P's timeout starts a moment before it arrives).
EARLY_S: Final = 0.1
BACKOFFS: Final = (1.0, 2.0)  # before the second and the third attempt (4.4-R4)
#: How long after P's last attempt its failure message may take to reach its output.
MESSAGE_WAIT_S: Final = 5.0
Worker = tuple[int, int, int]
#: What every worker of one engine registers alike (4.1-R12).
ENGINE_FIELDS: Final = ("pdwire_version", "pdwire_caps", "tp_size", "pp_size", "fingerprint")


def _by_worker(attempts: list[Attempt]) -> dict[Worker, list[Attempt]]:
    out: dict[Worker, list[Attempt]] = {}
    for a in attempts:
        if a.worker is None:
            raise CaseFailed(f"P sent a registration whose body names no ranks: {a.body!r}")
        out.setdefault(a.worker, []).append(a)
    return out


async def _first_registration(t: RegistrationCtx, p: Deployment) -> None:
    arrived = await p.registrar.wait(
        lambda: (
            any(a.arrived for a in p.registrar.registrations()) or p.process.returncode is not None
        ),
        t.options.start_timeout,
    )
    expect(
        bool(p.registrar.registrations()),
        f"P made no registration at {p.registrar.url} "
        + ("within its start bound" if not arrived else f"and exited: {p.process.tail()}"),
    )


def _failure_message(p: Deployment) -> re.Pattern[str]:
    return re.compile(
        r"Failed to register .+ with the Mooncake bootstrap server at \S*"
        + re.escape(p.registrar.host_port)
        + r"\S* after 3 attempts\."
    )


def _unbounded(attempts: list[Attempt], bound: float, lag: LoopLag) -> str:
    """What breaks 4.4-R1: an attempt left open longer than ``bound`` after its request, beyond
    how late the harness may have read its close."""
    now = time.monotonic()
    for i, a in enumerate(attempts, 1):
        waited = (a.closed or now) - (a.arrived or now)
        if waited > bound + lag.late_by(a.closed or now):
            return f"registration attempt {i} of worker {a.worker} waited {waited:.2f}s"
    return ""


def _expect_backoff(
    p: Deployment, worker: Worker, n: int, wait: float, timeout: float, last: Attempt, nxt: Attempt
) -> None:
    """4.4-R4: attempt ``n`` came ``wait`` after ``last`` ended. P ended ``last`` between its
    timeout (the request plus ``timeout``) and the moment the harness read the close, which a
    loaded machine can make late; the wait counts from either, whichever favours P."""
    assert last.closed is not None and last.arrived is not None
    after_close = nxt.opened - last.closed
    after_timeout = nxt.opened - (last.arrived + timeout)
    early = EARLY_S + p.registrar.lag.late_by(last.arrived)
    late = SLACK_S + p.registrar.lag.late_by(nxt.opened)
    expect(
        max(after_close, after_timeout) >= wait - early
        and min(after_close, after_timeout) <= wait + late,
        f"4.4-R4: worker {worker} made attempt {n} {after_close:.2f}s after attempt {n - 1} "
        f"was seen to end, and {after_timeout:.2f}s after its {timeout}s timeout, not "
        f"{wait:.0f}s (allowing {early:.2f}s early and {late:.2f}s late for the harness's own "
        "delays)",
    )


@case(
    "registration/4.4/1",
    "4.4-R2",
    covers=("4.4-R1", "4.4-R4", "4.4-R5"),
    timeout=90.0,
)
async def attempts_time_out(t: RegistrationCtx) -> None:
    """A registration whose every attempt times out: each attempt is bounded by
    VLLM_MOONCAKE_CONNECTOR_TIMEOUT, a worker makes three, 1 s and 2 s apart, then fails
    with 4.4-R5's message."""
    p = await t.deploy(Script("stall"), attempt_timeout=t.options.attempt_timeout)
    await _first_registration(t, p)
    timeout = t.options.attempt_timeout
    bound = timeout + SLACK_S
    message = _failure_message(p)
    # The whole sequence: three bounded attempts and both backoffs, then the message.
    settle = 3 * bound + sum(BACKOFFS) + 2 * SLACK_S + MESSAGE_WAIT_S

    def settled() -> bool:
        attempts = p.registrar.registrations()
        by_worker = _by_worker(attempts)
        return (
            bool(_unbounded(attempts, bound, p.registrar.lag))
            or any(len(mine) > 3 for mine in by_worker.values())
            or bool(message.search(p.output()))
            or p.process.returncode is not None
        )

    await p.registrar.wait(settled, settle)
    # the other workers' last attempts, which end about when the first worker's do
    await p.registrar.wait(
        lambda: all(a.closed for a in p.registrar.registrations()), bound + SLACK_S
    )
    attempts = p.registrar.registrations()
    unbounded = _unbounded(attempts, bound, p.registrar.lag)
    expect(not unbounded, f"4.4-R1: {unbounded}, longer than the {timeout}s bound")
    by_worker = _by_worker(attempts)
    for worker, mine in sorted(by_worker.items()):
        expect(len(mine) <= 3, f"4.4-R2: worker {worker} made {len(mine)} registration attempts")
    # P fails its start with the first worker that gives up, which can cut the others short.
    expect(
        any(len(mine) == 3 for mine in by_worker.values()),
        f"4.4-R2: no worker made 3 registration attempts, each of which timed out: "
        f"{ {w: len(m) for w, m in sorted(by_worker.items())} }",
    )
    for worker, mine in sorted(by_worker.items()):
        for i, wait in enumerate(BACKOFFS[: len(mine) - 1]):
            expect(
                mine[i].closed is not None and mine[i].arrived is not None,
                f"worker {worker}'s attempt {i + 1} never ended",
            )
            _expect_backoff(p, worker, i + 2, wait, timeout, mine[i], mine[i + 1])
    if not message.search(p.output()):
        await p.registrar.wait(lambda: bool(message.search(p.output())), MESSAGE_WAIT_S)
    expect(
        bool(message.search(p.output())),
        f"4.4-R5: P's output has no {message.pattern!r} after its attempts were exhausted; "
        f"its last lines:\n{p.process.tail()}",
    )


@case(
    "registration/4.4/2",
    "4.4-R3",
    timeout=90.0,
)
async def http_error_is_not_retried(t: RegistrationCtx) -> None:
    """A registration refused with HTTP 400 ends at once: the worker makes no second attempt."""
    p = await t.deploy(Script("reject", status=400))
    await _first_registration(t, p)
    # every worker's first attempt, then longer than the first backoff for a second one
    await asyncio.sleep(BACKOFFS[0] + 2 * SLACK_S)
    for worker, mine in sorted(_by_worker(p.registrar.registrations()).items()):
        expect(
            len(mine) == 1,
            f"worker {worker} registered again {mine[1].opened - mine[0].closed:.2f}s "
            f"after HTTP 400 ({len(mine)} attempts)"
            if len(mine) > 1 and mine[0].closed is not None
            else f"worker {worker} made {len(mine)} attempts after HTTP 400",
        )


async def _probe(ctx: zmq.asyncio.Context, addr: str, timeout: float) -> float | None:
    """Send a malformed message to ``addr``; when (monotonic) its first reply came, if any."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        await sock.send(b"\xc1 not a pull")
        try:
            await asyncio.wait_for(sock.recv_multipart(), timeout)
        except TimeoutError:
            return None
        return time.monotonic()
    finally:
        sock.close(linger=0)


HOLD_S: Final = 1.5  # how long the server holds each registration's 200


async def _probe_while_held(t: RegistrationCtx, p: Deployment) -> None:
    """4.4-R6: each registration, while the server holds its answer, gets a malformed message
    at the address it registers; P's ERROR to it (2.4-R1) must come after the server's 200."""
    ctx = zmq.asyncio.Context()
    # by the attempt's id(): the list of registrations is in the order the connections opened,
    # and one opened earlier may be read later, so an index would name another attempt then
    probes: dict[int, tuple[Attempt, asyncio.Task[float | None]]] = {}
    reply_wait = HOLD_S + t.options.request_timeout
    try:
        # each registration gets a probe as it arrives, until none arrived for HOLD_S
        while True:
            attempts = p.registrar.registrations()
            for a in attempts:
                if id(a) not in probes and a.addr is not None and a.arrived is not None:
                    t.log.sent(f"zmq {a.addr}", "a malformed message, while P registers")
                    probes[id(a)] = (a, asyncio.create_task(_probe(ctx, a.addr, reply_wait)))
            last = max(a.arrived or a.opened for a in attempts)
            seen = len(attempts)
            if not await p.registrar.wait(
                lambda: len(p.registrar.registrations()) > seen,  # noqa: B023 (awaited here)
                last + HOLD_S - time.monotonic(),
            ):
                break
        for a, task in probes.values():
            replied = await task
            expect(
                replied is not None,
                f"4.4-R6: P worker {a.worker} at {a.addr} never answered a malformed message "
                f"(2.4-R1) after its registration succeeded",
            )
            assert replied is not None and a.answered is not None
            expect(
                replied >= a.answered,
                f"4.4-R6: P worker {a.worker} at {a.addr} answered {a.answered - replied:.2f}s "
                f"before its registration succeeded",
            )
    finally:
        for _, task in probes.values():
            task.cancel()
        ctx.destroy(linger=0)


@case(
    "registration/4.4/3",
    "4.4-R12",
    covers=("4.4-R6", "4.4-R11", "4.1-R12"),
    timeout=90.0,
)
async def every_worker_registers_at_the_external_server(t: RegistrationCtx) -> None:
    """With an external bootstrap server, every P worker registers there, all with the same
    version, capabilities, sizes and fingerprint, serves nothing before the server accepted its
    registration, and P starts no bootstrap server of its own."""
    p = await t.deploy(Script("accept", hold=HOLD_S))
    await _first_registration(t, p)
    await _probe_while_held(t, p)
    until = time.monotonic() + t.options.start_timeout
    healthy = await p.process.wait_answer(f"{p.api}/health", until)
    expect(healthy is not None, "P did not answer /health within its start bound")
    registered = {a.worker for a in p.registrar.registrations() if a.answered}
    sizes = _sizes(t, p)
    expected = {(tp, pp) for tp in range(sizes[0]) for pp in range(sizes[1])}
    seen = {(w[1], w[2]) for w in registered if w is not None}
    missing = sorted(expected - seen)
    expect(
        not missing,
        f"P answers /health but its workers (tp_rank, pp_rank) {missing} never registered at "
        f"the external bootstrap server (registered: {sorted(seen)})",
    )
    announced = {
        a.worker: {f: a.body.get(f) for f in ENGINE_FIELDS}
        for a in p.registrar.registrations()
        if a.answered and isinstance(a.body, dict)
    }
    (first, theirs), *others = sorted(announced.items())
    for worker, mine in others:
        differ = {f: (mine[f], theirs[f]) for f in ENGINE_FIELDS if mine[f] != theirs[f]}
        expect(
            not differ,
            f"4.1-R12: worker {worker} registered other engine fields than worker {first} "
            f"(field: (its value, worker {first}'s)): {differ}",
        )
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", p.own_bootstrap_port)
    except OSError:
        return
    writer.close()
    raise CaseFailed(
        f"4.4-R11: P serves on VLLM_MOONCAKE_BOOTSTRAP_PORT {p.own_bootstrap_port} although its "
        f"workers register at the external server {p.registrar.url}"
    )


def _sizes(t: RegistrationCtx, p: Deployment) -> tuple[int, int]:
    """P's TP and PP sizes: as its registrations announce them (pdwire/2), else as the run
    was told, else 1."""
    for a in p.registrar.registrations():
        body = a.body if isinstance(a.body, dict) else {}
        tp, pp = body.get("tp_size"), body.get("pp_size")
        if isinstance(tp, int) and isinstance(pp, int):
            return tp, pp
    return t.options.tp or 1, t.options.pp or 1


@case(
    "registration/4.4/4",
    "4.4-R12",
    timeout=90.0,
)
async def address_without_port_is_refused(t: RegistrationCtx) -> None:
    """An external bootstrap address without a port is a configuration error that names
    itself: P does not start."""
    p = await t.deploy(Script("accept"), with_port=False)
    wanted = error_strings.BOOTSTRAP_ADDRESS_INVALID
    exited = await p.registrar.wait(
        lambda: wanted in p.output() or p.process.returncode is not None,
        t.options.start_timeout,
    )
    expect(
        wanted in p.output(),
        f"P given the bootstrap address {PORTLESS_HOST!r} "
        + ("exited" if exited else "kept starting")
        + f" without the error {wanted!r}; its last lines:\n{p.process.tail()}",
    )


#: 4.4-R14: how long P's own bootstrap server may take to listen after P's start.
OWN_SERVER_START_S: Final = 30.0
#: A loopback address other than 127.0.0.1: a server bound to every address answers there, one
#: bound to 127.0.0.1 does not.
OTHER_LOOPBACK: Final = "127.0.0.2"


@case(
    "registration/4.4/5",
    "4.4-R14",
    timeout=90.0,
)
async def own_bootstrap_server_listens_everywhere(t: RegistrationCtx) -> None:
    """Without an external bootstrap address, P serves a bootstrap server of its own within
    30 s of its start, at port VLLM_MOONCAKE_BOOTSTRAP_PORT of every address (0.0.0.0)."""
    p = await t.deploy(Script("accept"), own=True)
    port = p.own_bootstrap_port
    until = p.started + OWN_SERVER_START_S + SLACK_S
    answer = await p.process.wait_answer(f"http://127.0.0.1:{port}/query", until, lambda _: True)
    expect(
        answer is not None,
        f"P serves no bootstrap server at 127.0.0.1:{port} (VLLM_MOONCAKE_BOOTSTRAP_PORT) "
        f"{OWN_SERVER_START_S:.0f}s after its start",
    )
    assert answer is not None
    t.log.received(f"http 127.0.0.1:{port}", f"GET /query: HTTP {answer.status_code}")
    expect(
        answer.status_code == 200,
        f"GET /query at P's own bootstrap server 127.0.0.1:{port} answered HTTP "
        f"{answer.status_code}, not 200",
    )
    # Refused: nothing listens there. A timeout only says the machine is loaded: ask again.
    why = await listens(f"http://{OTHER_LOOPBACK}:{port}/query", time.monotonic() + SLACK_S * 10)
    expect(
        not why,
        f"P's own bootstrap server answers at 127.0.0.1:{port} but not at {OTHER_LOOPBACK}:"
        f"{port} ({why}): it does not listen on 0.0.0.0",
    )
