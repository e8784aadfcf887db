"""Free TCP ports for the processes a run starts.

A port is picked by the parent and bound later by a child, so another process can take it in
between. The kernel hands out ephemeral ports (``bind(("", 0))``, pyzmq's
``bind_to_random_port``, every outgoing connection) from ``ip_local_port_range``, and the Mooncake
engine takes its RPC ports from 15000-17000; a port picked below the ephemeral range and above
Mooncake's is one that only an explicit choice, like this one, takes.
"""

from __future__ import annotations

import functools
import random
import socket
from contextlib import closing
from pathlib import Path
from typing import Final

PICK_RANGE: Final = (20000, 32000)
TRIES: Final = 200
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@functools.cache
def _pick_range() -> tuple[int, int]:
    """``PICK_RANGE``, cut to end below the ephemeral range where that starts lower."""
    low, high = PICK_RANGE
    try:
        ephemeral_low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return low, high
    return (low, min(high, ephemeral_low)) if ephemeral_low > low + 1000 else (low, high)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now, outside the ranges others pick from."""
    low, high = _pick_range()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    picks = [random.randrange(low, high) for _ in range(TRIES)]
    for port in [*picks, 0]:  # 0 last: every pick was taken, so the kernel chooses
        with closing(socket.socket(family)) as s:
            try:
                s.bind((host, port))
            except OSError:
                if port == 0:
                    raise
                continue
            chosen: int = s.getsockname()[1]
            return chosen
    raise AssertionError("unreachable")
