"""`from agent_radar.host import AgentHost`: the agent-host kit (docs/hosts.md), as
`agent_radar.workflows.host` has it."""

from .workflows.host import *  # noqa: F403 - the kit's names, as it lists them
from .workflows.host import __all__  # noqa: F401
