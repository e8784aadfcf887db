"""The protocol running for real: ZMQ side channel, Mooncake transfer engine, bootstrap server,
proxy, a model-free engine node and a vLLM KV connector, all built on ``pdwire``."""
