"""What ``pdwire tap`` adds to a pull's round trip, against the same pull sent directly, in one
run.

Run from the repository root: ``python -m tests.bench.tap_ratios [--quick] [--json PATH]``.
P is a bare ROUTER on a thread of its own that answers each message with one FINISH; D sends the
seeds' pull (4207 bytes) on a new DEALER each time, as D does, and waits for the reply. The
same number of round trips go directly to P's ROUTER and through the tap's relay, in
alternating rounds, so that a round's ratio compares neighbours in time. The tap decodes and
records every message (to a sink that keeps nothing). Nothing here asserts timings.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

import httpx
import zmq

from pdwire.codec import encode_pull, encode_response
from pdwire.messages import XferResponse, XferResponseStatus
from pdwire.vectors import seed_pull
from reference_connector.bootstrap import BootstrapServer
from reference_connector.tap import TapServer

from .codec_ratios import Settings, bench_main

PULL: Final = encode_pull(seed_pull(), "legacy")
FINISH: Final = encode_response(XferResponse(XferResponseStatus.FINISH, ["r0"]), "legacy")
CASE_NAMES: Final = ("pull round trip",)


def _echo(router: zmq.Socket[bytes], stop: threading.Event) -> None:
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(50):
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, FINISH])


def _round_trips(ctx: zmq.Context[zmq.Socket[bytes]], addr: str, n: int) -> list[float]:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(addr)
        dealer.send(PULL)
        reply = dealer.recv()
        took.append(time.perf_counter() - t0)
        dealer.close(linger=0)
        assert reply == FINISH, reply
    return took


def run_all(settings: Settings) -> list[dict[str, Any]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    direct = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    stop = threading.Event()
    echo = threading.Thread(target=_echo, args=(router, stop), daemon=True)
    echo.start()
    try:
        with BootstrapServer().start("127.0.0.1", 0) as boot:
            payload = {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": direct}
            httpx.post(f"{boot.url}/register", json=payload, timeout=10).raise_for_status()
            with TapServer(boot.url, lambda record: None).start() as tap:
                entries = httpx.get(f"{tap.url}/query", timeout=10).json()
                tapped = entries["0"]["worker_addr"]["0"]["0"]
                per_round = 20 if settings.repeats > 3 else 5
                _round_trips(ctx, direct, per_round)  # connections and caches warm
                _round_trips(ctx, tapped, per_round)
                rounds = [
                    (_round_trips(ctx, direct, per_round), _round_trips(ctx, tapped, per_round))
                    for _ in range(settings.repeats)
                ]
    finally:
        stop.set()
        echo.join(5)
        router.close(linger=0)
        ctx.term()
    base = statistics.median(t for d, _ in rounds for t in d)
    via = statistics.median(t for _, v in rounds for t in v)
    ratio = statistics.median(statistics.median(v) / statistics.median(d) for d, v in rounds)
    return [
        {
            "case": CASE_NAMES[0],
            "round_trips": 2 * per_round * settings.repeats,
            "direct_us": round(base * 1e6, 1),
            "tapped_us": round(via * 1e6, 1),
            "added_us": round((via - base) * 1e6, 1),
            "ratio": round(ratio, 3),
        }
    ]


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'case':<18} {'direct us':>10} {'tapped us':>10} {'added us':>9} {'ratio':>7}",
        *(
            f"{c['case']:<18} {c['direct_us']:>10.1f} {c['tapped_us']:>10.1f} "
            f"{c['added_us']:>9.1f} {c['ratio']:>7.3f}"
            for c in cases
        ),
        "ratio: the round trip through the tap over the direct one, median of the rounds",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(
        argv,
        "python -m tests.bench.tap_ratios",
        "A pull's round trip through pdwire tap against the same round trip sent directly",
        run_all,
        format_table,
    )


if __name__ == "__main__":
    raise SystemExit(main())
