"""What an agent host keeps of a session (host/agent_host.py): its goal, revision, fences and
epoch, which survive a restart, and the turns and runs of its current process; and the
checks of a call's body (a bad one is refused `422 rejected`, nothing changed)."""

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .server import HostError

# Settled turns a session keeps in memory (HostSession.prune_settled).
SETTLED_TURNS_KEPT = 1000


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

    def reported(self) -> dict[str, Any]:
        """The turn as a report tells it (docs/protocol.md: reports)."""
        shown = {k: v for k, v in asdict(self).items() if v is not None}
        del shown["runtime_epoch"]
        shown.pop("text", None)
        return shown


@dataclass
class Run:
    run_id: str
    kind: str
    args: dict
    state: str = "running"  # or "done", or REFUSED
    applied: bool = False
    cancelled: bool = False
    error: str | None = None
    input_tokens: int | None = None
    result_tokens: int | None = None
    summary: str | None = None


# A run cancelled before its start came: its start is refused (calls.refuse_unknown_run).
REFUSED = "refused"

# What an agent may say of a finished run (AgentHost.finish; docs/protocol.md: maintenance).
RUN_RESULT = ("applied", "cancelled", "error", "input_tokens", "result_tokens", "summary")


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
    # Every prompt's turn and every run by its key, kept across epochs: the same key again
    # gets the same answer, with no second turn or run (docs/protocol.md: idempotence).
    prompts: dict[str, str] = field(default_factory=dict)  # prompt_id -> turn_id
    runs: dict[str, Run] = field(default_factory=dict)
    # Goal revisions answered `accepted`, by operation id, until the agent applies them.
    pending_goals: dict[str, dict] = field(default_factory=dict)
    # What the session's process runs: gone with it at a new epoch.
    turns: dict[str, Turn] = field(default_factory=dict)

    def snapshot(self) -> "HostSession":
        """What a call can be undone to: its own dictionaries and lists, sharing what they
        hold (a change replaces a Turn or a Run, never alters one)."""
        return replace(
            self,
            fences=list(self.fences),
            prompts=dict(self.prompts),
            runs=dict(self.runs),
            pending_goals=dict(self.pending_goals),
            turns=dict(self.turns),
        )

    def prune_settled(self) -> None:
        """Settled turns are kept to answer a late cancel `already_settled`; past twice
        SETTLED_TURNS_KEPT the oldest go, down to that many (a cancel of one then answers
        `not_found`, which the workers take as its end too)."""
        if len(self.turns) <= 2 * SETTLED_TURNS_KEPT:
            return
        settled = [turn_id for turn_id, t in self.turns.items() if t.phase == "settled"]
        for turn_id in settled[: len(settled) - SETTLED_TURNS_KEPT]:
            del self.turns[turn_id]

    def fenced(self, operation_id: str, revision: int) -> bool:
        return [operation_id, revision] in self.fences

    def kept(self) -> dict[str, Any]:
        """What survives a restart."""
        names = ("workspace_id", "session_id", "live", "runtime_epoch", "goal", "revision")
        return {n: getattr(self, n) for n in names} | {
            "applied_operation_id": self.applied_operation_id,
            "fences": self.fences,
            "prompts": self.prompts,
            "pending_goals": self.pending_goals,
            "runs": {run_id: asdict(run) for run_id, run in self.runs.items()},
        }

    @classmethod
    def from_kept(cls, kept: dict[str, Any]) -> "HostSession":
        runs = {run_id: Run(**run) for run_id, run in kept.pop("runs", {}).items()}
        return cls(**kept, runs=runs)


# The protocol's bounds (docs/protocol/agent-host.openapi.yaml): ids, revisions, texts.
MAX_ID_CHARS = 255
MAX_TEXT_CHARS = 64 * 1024
# Maintenance kinds and the arguments each takes (docs/protocol.md: maintenance).
MAINTENANCE_ARGS: dict[str, frozenset[str]] = {
    "compact": frozenset(),
    "summarize_up_to": frozenset({"turn"}),
    "summarize_from": frozenset({"turn"}),
}


def refuse(detail: str) -> HostError:
    return HostError(422, "rejected", detail=detail)


def text_of(body: Any, name: str, max_chars: int = MAX_ID_CHARS) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value or len(value) > max_chars:
        raise refuse(f"{name} must be a string of 1 to {max_chars} characters")
    return value


def int_of(body: Any, name: str, minimum: int = 1) -> int:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value < 2**63:
        raise refuse(f"{name} must be a whole number from {minimum}")
    return value


def fences_of(body: dict) -> list[list]:
    """A resume's fences, every one checked before any is held."""
    value = body.get("fences") or []
    if not isinstance(value, list) or len(value) > 10_000:
        raise refuse("fences must be a list of at most 10000")
    return [[text_of(f, "target_operation_id"), int_of(f, "target_revision")] for f in value]


def maintenance_of(body: dict) -> tuple[str, str, dict]:
    """A maintenance start's run id, kind and arguments, as its kind takes them."""
    run_id, kind = text_of(body, "run_id"), text_of(body, "kind")
    args = body.get("args") or {}
    if kind not in MAINTENANCE_ARGS:
        raise refuse(f"kind must be one of {sorted(MAINTENANCE_ARGS)}")
    if not isinstance(args, dict) or set(args) != MAINTENANCE_ARGS[kind]:
        raise refuse(f"{kind} takes the arguments {sorted(MAINTENANCE_ARGS[kind])}")
    if "turn" in args:
        int_of(args, "turn", minimum=0)
    return run_id, kind, args
