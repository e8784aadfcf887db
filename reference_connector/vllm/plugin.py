"""pdwire as a vLLM general plugin (entry point group ``vllm.general_plugins``): vLLM calls
``register`` in each of its processes, which adds ``PdwireConnector`` to vLLM's KV connector
factory, so that ``"kv_connector": "PdwireConnector"`` needs no ``kv_connector_module_path``."""

from __future__ import annotations

import contextlib
from typing import Final

NAME: Final = "PdwireConnector"


def register() -> None:
    """Add the connector to vLLM's factory; a second call in the same process changes nothing
    (vLLM may load its plugins more than once)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # "Connector '...' is already registered."
        KVConnectorFactory.register_connector(NAME, "reference_connector.vllm.connector", NAME)
