"""What a failed fault test reports (``conftest.failure_evidence``): the log of every node and
service it used, each node's ending with its threads' stacks."""

from __future__ import annotations

import pytest

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
    node_log = sections[f"log of the decode node at {d.url}"]
    assert node_log.startswith('stats: {"role": "decode"'), node_log[:200]
    # the front's stacks and its worker's, each through the module that serves it
    assert 'reference_connector/cli_common.py", line' in node_log, node_log
    assert 'reference_connector/worker_process.py", line' in node_log, node_log
    assert d.alive()
