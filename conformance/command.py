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

from .case import WireLog, expect
from .peers.http import probe

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
    """One testee process started from a filled template, its output in a log file."""

    def __init__(self, what: str, args: list[str], env: dict[str, str], log: WireLog) -> None:
        self.what, self.args, self.env, self.log = what, args, env, log
        self.process: asyncio.subprocess.Process | None = None
        fd, name = tempfile.mkstemp(prefix=f"pdwire-{what}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)

    async def spawn(self) -> None:
        self.log.note(f"starting the {self.what}", shlex.join(self.args))
        with self.log_path.open("wb") as out:
            self.process = await asyncio.create_subprocess_exec(
                *self.args, stdout=out, stderr=out, env=self.env, start_new_session=True
            )

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

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
        if p is not None and p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(p.wait(), STOP_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await p.wait()
        self.log_path.unlink(missing_ok=True)
