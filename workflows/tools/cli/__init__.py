"""The `agent-radar` command (docs/operations.md), one module per command group. This package is the
composition root of the tools: importing it registers every command on `cli`."""

from agent_radar.workflows.tools.cli import (  # noqa: F401
    goals,
    health,
    maintenance,
    operators,
    services,
    sessions,
    status,
)
from agent_radar.workflows.tools.cli.common import cli, main

__all__ = ["cli", "main"]
