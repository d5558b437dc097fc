"""agent-radar: a durable control plane for fleets of AI agent sessions.

The one import name of the distribution. `from agent_radar import AgentRadar` is the client
(docs/architecture.md); its errors are importable from here too (`from agent_radar import
NotFound`), as from `agent_radar.workflows.errors`. The repository keeps the product's
folders at its top (`workflows/`, `tasks/`, `models/`, `beat/`); a built wheel holds them here,
so `agent_radar` is the only top-level package a service that installs it gets. In the
repository they are linked in here; a checkout without symbolic links (Windows' default) finds
them through `_TopFolders` (docs/packaging.md)."""

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

__all__ = ["AgentRadar"]
FOLDERS = ("models", "workflows", "tasks", "beat")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _TopFolders(importlib.abc.MetaPathFinder):
    """`agent_radar.<folder>` from the repository's top, where the link is a plain file."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        parent, _, folder = fullname.rpartition(".")
        init = os.path.join(_ROOT, folder, "__init__.py")
        if parent != __name__ or folder not in FOLDERS or not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[os.path.dirname(init)]
        )


if not os.path.isdir(os.path.join(os.path.dirname(__file__), "workflows")):
    sys.meta_path.insert(0, _TopFolders())


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
