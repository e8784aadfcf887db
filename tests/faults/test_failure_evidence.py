"""What a failed fault test reports (``conftest.failure_evidence``): first, in a few lines per
process, its counters and where its threads wait; then the log of every node and service it
used, each node's ending with its threads' stacks."""

from __future__ import annotations

import pytest

from conformance.testees import process_tree

from .conftest import Shared, failure_evidence
from .deployment import Deployment, Requests, Tracked

pytestmark = pytest.mark.faults


def test_a_failure_shows_its_requests_and_each_process_log_with_a_nodes_stacks(
    shared: Shared, deployment: Deployment, requests: Requests
) -> None:
    (d,) = shared.get(("decode", {}))
    bootstrap = deployment.bootstrap()
    answered = requests.post("local", d.url, {"prompt": "x", "max_tokens": 1}, 5.0)
    requests.terminal(answered)
    unsent = Tracked("never sent", 1.0)
    requests.tracked.append(unsent)
    funcargs = {"shared": shared, "deployment": deployment, "requests": requests}
    sections = dict(failure_evidence(funcargs))
    assert sections["requests"].splitlines() == [
        answered.state(),
        "never sent: waiting for a client thread",
    ]
    assert f"log of the bootstrap at {bootstrap.url}" in sections
    short = sections["where each process waits"].splitlines()
    head = short.index(f"log of the bootstrap at {bootstrap.url}")
    assert short[head + 1 : head + 3] == [
        "  stats: none (not a node)",
        f"process {bootstrap.process.pid}:",
    ], short
    at = short.index(f"log of the decode node at {d.url}")
    assert short[at + 1].startswith("  blocks_in_use=0 transfers_held=0"), short
    assert short[at + 2].startswith("  decode-tp0-pp0: pid="), short
    assert " alive=True pulls_sent=" in short[at + 2], short
    # a line per process, then a line per thread: the front's main thread serves, the
    # worker's main thread reads the front's commands
    block = short[at + 1 :]
    block = block[: next((i for i, x in enumerate(block) if x.startswith("log of ")), None)]
    assert [x for x in block if x.startswith("process ")] == [
        f"process {pid}:" for pid in process_tree(d.process.pid)
    ], block
    assert any(x.startswith("  main: ") and "cli_common.py" in x for x in block), block
    assert any(x.startswith("  main: ") and "worker_process.py" in x for x in block), block
    node_log = sections[f"log of the decode node at {d.url}"]
    assert node_log.startswith('stats: {"role": "decode"'), node_log[:200]
    # the front's stacks and its worker's, each through the module that serves it
    assert 'reference_connector/cli_common.py", line' in node_log, node_log
    assert 'reference_connector/worker_process.py", line' in node_log, node_log
    assert d.alive()
