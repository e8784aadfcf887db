"""A side-channel relay of the tests': D's DEALERs connect to its ROUTER; for each D socket it
opens a DEALER to P's ROUTER, so P sees one peer per D socket, as without the relay. Messages
are counted per direction; a policy drops or duplicates the Nth of a direction (1-based)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Literal, Self

import zmq

Direction = Literal["to_p", "to_d"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """What to do with the messages of one direction, by their 1-based index."""

    drop: frozenset[int] = frozenset()
    duplicate: frozenset[int] = frozenset()

    @classmethod
    def dropping(cls, *nth: int) -> Policy:
        return cls(drop=frozenset(nth))

    @classmethod
    def duplicating(cls, *nth: int) -> Policy:
        return cls(duplicate=frozenset(nth))


@dataclasses.dataclass
class Counts:
    seen: int = 0
    dropped: int = 0
    duplicated: int = 0


class Relay:
    """Relay between D and P's side channel at ``upstream``, on its own thread."""

    def __init__(
        self, upstream: str, *, to_p: Policy | None = None, to_d: Policy | None = None
    ) -> None:
        self.upstream = upstream
        self.policies: dict[Direction, Policy] = {
            "to_p": to_p or Policy(),
            "to_d": to_d or Policy(),
        }
        self.counts: dict[Direction, Counts] = {"to_p": Counts(), "to_d": Counts()}
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop_addr = f"inproc://relay-stop-{port}"
        self._stop_rx = self._ctx.socket(zmq.PAIR)
        self._stop_rx.bind(self._stop_addr)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"relay-{port}", daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            stop_tx = self._ctx.socket(zmq.PAIR)
            stop_tx.connect(self._stop_addr)
            stop_tx.send(b"")
            self._thread.join(5.0)
            stop_tx.close(linger=0)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def snapshot(self) -> dict[Direction, Counts]:
        with self._lock:
            return {d: dataclasses.replace(c) for d, c in self.counts.items()}

    def _copies(self, direction: Direction) -> int:
        """How many copies of the next message of ``direction`` to pass on (0, 1 or 2)."""
        with self._lock:
            counts, policy = self.counts[direction], self.policies[direction]
            counts.seen += 1
            if counts.seen in policy.drop:
                counts.dropped += 1
                return 0
            if counts.seen in policy.duplicate:
                counts.duplicated += 1
                return 2
            return 1

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        backs: dict[bytes, zmq.Socket[bytes]] = {}
        owners: dict[zmq.Socket[bytes], bytes] = {}
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_rx in ready:
                    return
                if self._front in ready:
                    identity, *frames = self._front.recv_multipart()
                    back = backs.get(identity)
                    if back is None:
                        back = self._ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self.upstream)
                        backs[identity], owners[back] = back, identity
                        poller.register(back, zmq.POLLIN)
                    for _ in range(self._copies("to_p")):
                        back.send_multipart(frames)
                for back, identity in owners.items():
                    if back in ready:
                        frames = back.recv_multipart()
                        for _ in range(self._copies("to_d")):
                            self._front.send_multipart([identity, *frames])
        finally:
            for back in owners:
                back.close(linger=0)
            self._front.close(linger=0)
            self._stop_rx.close(linger=0)
