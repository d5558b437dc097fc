"""agent-radar: a durable control plane for fleets of AI agent sessions.

The one import name of the distribution. `from agent_radar import AgentRadar` is the client
(docs/architecture.md); its errors are importable from here too (`from agent_radar import
NotFound`), as from `agent_radar.workflows.errors`. The repository keeps the product's
folders at its top (`workflows/`, `tasks/`, `models/`, `beat/`); in the repository they are
linked in here, and a built wheel holds them here, so `agent_radar` is the only top-level
package a service that installs it gets (docs/packaging.md)."""

from typing import Any

__all__ = ["AgentRadar"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import agent_radar.tasks.app` (a worker) does not load the
    # client, and the client's modules import nothing from here.
    if name == "AgentRadar":
        from agent_radar.workflows.client import AgentRadar

        return AgentRadar
    from agent_radar.workflows import errors

    found = getattr(errors, name, None)
    if isinstance(found, type) and issubclass(found, errors.AgentRadarError):
        return found
    raise AttributeError(f"module 'agent_radar' has no attribute {name!r}")
