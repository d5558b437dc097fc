"""What an agent host keeps of a session (host/agent_host.py): its goal, revision, fences and
epoch, which survive a restart, and the turns and runs of its current process; and the
checks of a call's body (a bad one is refused `422 rejected`, nothing changed)."""

from dataclasses import dataclass, field
from typing import Any

from .server import HostError


@dataclass
class Turn:
    turn_id: str
    runtime_epoch: int
    origin: str
    source_goal_operation_id: str | None = None
    source_goal_revision: int | None = None
    prompt_id: str | None = None
    phase: str = "running"
    outcome: str | None = None
    text: str | None = None  # a prompt's, for the agent


@dataclass
class Run:
    run_id: str
    kind: str
    args: dict
    state: str = "running"  # or "done"
    applied: bool = False
    cancelled: bool = False
    error: str | None = None
    input_tokens: int | None = None
    result_tokens: int | None = None
    summary: str | None = None


@dataclass
class HostSession:
    workspace_id: str
    session_id: str
    live: bool = True
    runtime_epoch: int = 1
    goal: dict | None = None  # exactly {objective, status}, or None
    revision: int = 0
    applied_operation_id: str | None = None
    fences: list[list] = field(default_factory=list)  # [operation_id, revision] pairs
    # What the session's process runs: gone with it at a new epoch.
    turns: dict[str, Turn] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)  # prompt_id -> turn_id
    runs: dict[str, Run] = field(default_factory=dict)

    def fenced(self, operation_id: str, revision: int) -> bool:
        return [operation_id, revision] in self.fences

    def kept(self) -> dict[str, Any]:
        """What survives a restart."""
        names = ("workspace_id", "session_id", "live", "runtime_epoch", "goal", "revision")
        return {n: getattr(self, n) for n in names} | {
            "applied_operation_id": self.applied_operation_id,
            "fences": self.fences,
        }


def text_of(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise HostError(422, "rejected", detail=f"{name} must be a non-empty string")
    return value


def int_of(body: Any, name: str) -> int:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HostError(422, "rejected", detail=f"{name} must be a whole number")
    return value


def list_of(body: dict, name: str) -> list:
    value = body.get(name) or []
    if not isinstance(value, list):
        raise HostError(422, "rejected", detail=f"{name} must be a list")
    return value
