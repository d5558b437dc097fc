"""Prompts (docs/lifecycles.md: prompts): a session's queue of prompts, one turn at a time."""
