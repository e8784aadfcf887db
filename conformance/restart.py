"""Restarting a testee that stopped serving: the user's ``--restart-command``, then the wait
until the testee serves again, so that the cases after one that broke it still run."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Awaitable, Callable
from typing import Final

#: How often the testee is asked whether it serves again after the command ended.
POLL_S: Final = 0.5


#: Asks a testee something it answers whenever it serves (or learns its addresses again): None
#: when it answered, else what went wrong.
Probe = Callable[[], Awaitable[str | None]]


async def restart(
    command: str, timeout: float, serving: Probe, refresh: Probe | None
) -> str | None:
    """Run ``command`` through the shell, then wait until the testee serves again (``serving``
    answers None), within ``timeout`` seconds in all: None when it does, else what went wrong.
    A world that learns its testee's addresses when it opens learns them again first
    (``refresh``): a restarted testee may have new ones."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    proc = await asyncio.create_subprocess_shell(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    try:
        code = await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"--restart-command did not end within {timeout:g}s"
    if code != 0:
        return f"--restart-command exited with status {code}"
    while True:
        why = await refresh() if refresh is not None else None
        if why is None:
            why = await serving()
        if why is None:
            return None
        if loop.time() >= deadline:
            return f"not serving {timeout:g}s after --restart-command began: {why}"
        await asyncio.sleep(POLL_S)
