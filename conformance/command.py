"""Testees the harness starts from a command template: a proxy (the proxy suite), a P (the
registration suite). A template is a command line with ``{placeholder}`` fields; it runs without
a shell, its output goes to a log file the case can read, and it stops with its process group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import httpx

from . import warm_start
from .case import WireLog, expect
from .peers.http import probe
from .testees import fork_command

STOP_S: Final = 5.0  # from SIGTERM to SIGKILL


def fill(template: str, values: dict[str, str], what: str) -> list[str]:
    """``template``'s arguments with ``values`` in their placeholders; ``ValueError`` naming
    the known placeholders when it uses another one or does not parse."""
    try:
        return [arg.format_map(values) for arg in shlex.split(template)]
    except (KeyError, ValueError, IndexError) as exc:
        known = ", ".join("{" + k + "}" for k in values)
        raise ValueError(f"bad {what} command template {template!r} ({exc}); use {known}") from exc


def with_env(template: str, env: dict[str, str]) -> str:
    """``template`` run with ``env`` added to its environment (by ``env(1)``)."""
    if not env:
        return template
    return shlex.join(["env", *(f"{k}={v}" for k, v in env.items())]) + " " + template


def check(template: str, placeholders: Sequence[str], what: str) -> None:
    """``ValueError`` unless ``template`` is a command line using only ``placeholders``."""
    fill(template, dict.fromkeys(placeholders, "x"), what)


class TemplateProcess:
    """One testee process started from a filled template, its output in a log file. A template
    that runs the reference node or proxy (``testees.FORKED``, after ``env NAME=VALUE...``) is
    forked from the warm starter, as the harness's own testees are: the same process, started
    without importing its modules again."""

    def __init__(self, what: str, args: list[str], env: dict[str, str], log: WireLog) -> None:
        self.what, self.args, self.env, self.log = what, args, env, log
        self.process: asyncio.subprocess.Process | warm_start.ForkedProcess | None = None
        fd, name = tempfile.mkstemp(prefix=f"pdwire-{what}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)

    async def spawn(self) -> None:
        self.log.note(f"starting the {self.what}", shlex.join(self.args))
        args, env = _without_env(self.args, self.env)
        self.process = fork_command(args, env, self.log_path, session=True)
        if self.process is not None:
            return
        with self.log_path.open("wb") as out:
            self.process = await asyncio.create_subprocess_exec(
                *self.args, stdout=out, stderr=out, env=self.env, start_new_session=True
            )

    @property
    def returncode(self) -> int | None:
        p = self.process
        if isinstance(p, warm_start.ForkedProcess):
            return p.poll()
        return None if p is None else p.returncode

    async def wait_listening(self, url: str, timeout: float) -> None:
        """Wait until ``url``'s port accepts connections; ``RuntimeError`` when the process
        exits first or ``timeout`` passes."""
        host, port = url.removeprefix("http://").rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise RuntimeError(f"the {self.what} exited with {self.returncode}: {self.tail()}")
            try:
                _, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                await asyncio.sleep(0.05)  # polling another process's port: nothing to await
                continue
            writer.close()
            self.log.note(f"the {self.what} listens at {url}")
            return
        raise RuntimeError(
            f"the {self.what} did not listen at {url} within {timeout}s: {self.tail()}"
        )

    async def wait_answer(
        self,
        url: str,
        until: float,
        accept: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
        http: httpx.AsyncClient | None = None,
    ) -> httpx.Response | None:
        """Poll ``GET url`` until an answer ``accept`` takes (by default, HTTP 200), and return
        it; None when ``until`` (monotonic) comes first; ``CaseFailed`` when the process exits."""
        while True:
            got = await probe(url, http)
            if got is not None and accept(got):
                return got
            expect(self.returncode is None, f"{self.what} exited: {self.tail()}")
            if time.monotonic() >= until:
                return None
            await asyncio.sleep(0.2)  # polling another process's server: nothing to await

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    async def stop(self) -> None:
        p = self.process
        if p is not None and self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            if not await self._ended(STOP_S):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await self._ended(None)
        self.log_path.unlink(missing_ok=True)

    async def _ended(self, timeout: float | None) -> bool:
        """Whether the process ended within ``timeout`` seconds (None: however long)."""
        p = self.process
        if isinstance(p, asyncio.subprocess.Process):
            try:
                await asyncio.wait_for(p.wait(), timeout)
            except TimeoutError:
                return False
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)  # the starter's report, read without blocking the loop
        return True


def _without_env(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``args`` without a leading ``env NAME=VALUE...`` (``with_env``), and ``env`` with those
    variables added."""
    if not args or args[0] != "env":
        return args, env
    rest, added = args[1:], dict(env)
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        name, value = rest.pop(0).split("=", 1)
        added[name] = value
    return rest, added
