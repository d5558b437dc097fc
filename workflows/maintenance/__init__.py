"""Maintenance runs (DESIGN 4.6): admission, the state machine and its records, the executor."""
