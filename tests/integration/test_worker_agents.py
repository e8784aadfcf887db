"""Choosing a node worker's agent (``--agent MODULE:CALLABLE``): the errors say what is wrong."""

from __future__ import annotations

import pytest

from reference_connector import worker_agents
from reference_connector.kv_content import KVShape
from reference_connector.node import NodeConfig
from reference_connector.node_api import NodeServer
from reference_connector.node_worker import WorkerError
from reference_connector.worker_agents import AgentLoadError, load_factory


def test_empty_name_is_the_reference_agent() -> None:
    assert load_factory("") is worker_agents.reference_agent
    assert load_factory(worker_agents.REFERENCE) is worker_agents.reference_agent


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("reference_connector.worker_agents", "must be MODULE:CALLABLE"),
        (":agent", "must be MODULE:CALLABLE"),
        ("no_such_module_here:agent", "cannot import no_such_module_here"),
        ("reference_connector.worker_agents:nothing", "has no callable 'nothing'"),
        ("reference_connector.worker_agents:REFERENCE", "has no callable 'REFERENCE'"),
    ],
)
def test_bad_names_are_explained(name: str, says: str) -> None:
    with pytest.raises(AgentLoadError, match=says):
        load_factory(name)


def test_a_node_with_a_bad_agent_fails_to_start_and_says_why() -> None:
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8)
    node = NodeServer(NodeConfig(role="decode", shape=shape, agent="no_such_module_here:agent"))
    with pytest.raises(WorkerError, match="cannot import no_such_module_here"):
        node.start(port=0, timeout=30.0)
    assert not node.engine.healthy()
