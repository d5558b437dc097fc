"""The agent-host kit (docs/hosts.md): the protocol's server side for a host written in
Python. `AgentHost(agent, token=…)` answers every call of docs/protocol.md and keeps its
promises, signs and publishes the reports; `HostServer` serves calls on a real socket (the
simulator serves through it too). Your code is the `Agent`: it runs turns and maintenance."""

from .agent_host import Agent, AgentHost
from .agents import TimerAgent, broker_reporter
from .server import HostError, HostServer, bearer_matches
from .sessions import HostSession, Run, Turn

__all__ = [
    "Agent",
    "AgentHost",
    "HostError",
    "HostServer",
    "HostSession",
    "Run",
    "TimerAgent",
    "Turn",
    "bearer_matches",
    "broker_reporter",
]
