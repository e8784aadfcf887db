"""Free TCP ports: for the processes a run starts, and for the harness's own fake peers.

A port is picked by the parent and bound later by a child, so another process can take it in
between. The kernel hands out ephemeral ports (``bind(("", 0))``, pyzmq's
``bind_to_random_port``, every outgoing connection) from ``ip_local_port_range``, and the Mooncake
engine takes its RPC ports from 15000-17000; a port picked below the ephemeral range and above
Mooncake's is one that only an explicit choice, like this one, takes.

A fake peer's socket binds at once, in the harness's process, but it must never take an address
that a peer of an earlier case had: the testee remembers what it learnt of an address (a P
worker's version, 8.2-R2), and would apply it to the newcomer.
"""

from __future__ import annotations

import functools
import os
import random
import socket
from contextlib import closing
from pathlib import Path
from typing import Any, Final

import zmq

PICK_RANGE: Final = (20000, 32000)
TRIES: Final = 200
#: Where fake peers bind (pyzmq's range for ``bind_to_random_port``), apart from PICK_RANGE so
#: that they never take a port picked for a process that has not bound it yet.
PEER_RANGE: Final = (49152, 65536)
_bound: set[int] = set()  # every port ``bind_fresh`` tried in this process
#: Every port ``free_port`` returned in this process: its caller may not have bound it yet, so
#: it is not picked again (a node given one port for its API and the same for its bootstrap
#: server would start one and fail on the other).
_given: set[int] = set()
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


#: ``K/N``: this process and its children pick from the K-th of N equal slices of the range, so
#: that N runs side by side (pytest's workers) never pick a port another has not bound yet.
SHARE_ENV: Final = "PDWIRE_PORT_SHARE"


@functools.cache
def _pick_range() -> tuple[int, int]:
    """``PICK_RANGE``, cut to end below the ephemeral range where that starts lower, and to this
    process's slice of it (``SHARE_ENV``)."""
    low, high = PICK_RANGE
    try:
        ephemeral_low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = high
    if ephemeral_low > low + 1000:
        high = min(high, ephemeral_low)
    k, _, n = os.environ.get(SHARE_ENV, "0/1").partition("/")
    if k.isdigit() and n.isdigit() and 0 <= int(k) < int(n):
        step = (high - low) // int(n)
        low, high = low + int(k) * step, low + (int(k) + 1) * step
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now and that this process has not returned
    before, outside the ranges others pick from."""
    low, high = _pick_range()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    picks = [random.randrange(low, high) for _ in range(TRIES)]
    for port in [*(p for p in picks if p not in _given), 0]:  # 0 last: the kernel chooses
        with closing(socket.socket(family)) as s:
            try:
                s.bind((host, port))
            except OSError:
                if port == 0:
                    raise
                continue
            chosen: int = s.getsockname()[1]
            _given.add(chosen)
            return chosen
    raise AssertionError("unreachable")


def bind_fresh(sock: zmq.Socket[Any], host: str) -> int:
    """Bind ``sock`` on ``host`` to a port of PEER_RANGE that no socket of this process tried
    before; return the port."""
    low, high = PEER_RANGE
    for _ in range(TRIES):
        port = random.randrange(low, high)
        if port in _bound:
            continue
        _bound.add(port)
        try:
            sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:  # taken, as an outgoing connection's port for one
            continue
        return port
    raise RuntimeError(f"no port of {low}-{high - 1} on {host} bound in {TRIES} tries")
