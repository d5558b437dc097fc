"""Adapters: the runtime port and its HTTP adapter (docs/protocol.md), the broker and the task
publisher, configuration from the environment (docs/configuration.md)."""
