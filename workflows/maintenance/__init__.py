"""Maintenance runs (docs/lifecycles.md: maintenance): admission, the state machine and its records,
the executor."""
