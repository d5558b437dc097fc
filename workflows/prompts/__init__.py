"""Prompts (DESIGN 4.7): a session's queue of prompts, one turn at a time."""
