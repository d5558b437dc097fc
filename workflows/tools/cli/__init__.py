"""The `agent-radar` command (docs/operations.md), one module per command group. This package is the
composition root of the tools: importing it registers every command on `cli`."""

from . import (  # noqa: F401
    goals,
    health,
    maintenance,
    operators,
    services,
    sessions,
    status,
)
from .common import cli, main

__all__ = ["cli", "main"]
