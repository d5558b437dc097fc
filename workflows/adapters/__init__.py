"""Adapters: the runtime port and its HTTP adapter (DESIGN 6), the broker and the task
publisher, configuration from the environment (DESIGN 7.4)."""
