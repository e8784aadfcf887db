"""pdwire as a vLLM general plugin: the installed entry point registers ``PdwireConnector`` with
vLLM's KV connector factory, and a second call changes nothing."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.vllm


def test_the_plugin_registers_the_connector_by_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from reference_connector.vllm.connector import PdwireConnector

    plugins = entry_points(group="vllm.general_plugins")
    (found,) = (e for e in plugins if e.value.startswith("reference_connector."))
    register = found.load()
    register()
    register()  # vLLM may load its plugins more than once in a process
    assert KVConnectorFactory.get_connector_class_by_name("PdwireConnector") is PdwireConnector
