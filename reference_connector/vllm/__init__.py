"""pdwire as a vLLM V1 KV connector: ``reference_connector.vllm.connector.PdwireConnector``."""
