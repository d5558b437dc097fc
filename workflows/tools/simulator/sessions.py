"""A simulated session's state: its settings, goal, fences, turns and maintenance runs; and
SimError, the error answer a call gets."""

from dataclasses import dataclass, field

from ...host.server import HostError

# The error answer a call gets: the host kit's (host/server.py).
SimError = HostError


@dataclass
class SimSession:
    live: bool = True
    epoch: int = 1
    missing: bool = False
    goal: dict | None = None
    applied_revision: int = 0
    applied_operation_id: str | None = None  # the goal operation applied last
    goal_mode: str = "applied"  # or "accepted": acknowledge now, apply after apply_delay_ms
    apply_delay_ms: int = 100
    fences: set = field(default_factory=set)
    # Goal continuation turns: started when a goal is set, settled after turn_duration_ms
    # (0: never on its own) or on cancel. cancel_mode: "immediate" settles at once,
    # "accepted" settles after cancel_delay_ms and reports it, "ignore" never settles.
    continuation_turns: bool = True
    turn_duration_ms: int = 200
    cancel_mode: str = "immediate"
    cancel_delay_ms: int = 100
    # How long a turn's start is in flight before its report goes out (a late report).
    report_delay_ms: int = 0
    turns: dict = field(default_factory=dict)  # turn_id -> SimTurn
    # Maintenance: runs finish after maintenance_duration_ms with maintenance_outcome
    # ("applied", "noop", "cancelled" or "error:<text>"); ignore_cancel makes cancels do
    # nothing.
    maintenance_duration_ms: int = 300
    maintenance_outcome: str = "applied"
    ignore_cancel: bool = False
    runs: dict = field(default_factory=dict)  # run_id -> SimRun
    prompt_turns: dict = field(default_factory=dict)  # prompt_id -> turn_id
    # Turn ids numbered per process (turn-1, turn-2, … again after a restart) instead of
    # unique for good: a host that gives an id again.
    numbered_turns: bool = False
    turn_number: int = 0


@dataclass
class SimRun:
    run_id: str
    done_at: float
    outcome: str
    cancelled: bool = False


@dataclass
class SimTurn:
    turn_id: str
    origin: str
    source_goal_operation_id: str | None
    source_goal_revision: int | None
    phase: str = "running"
    outcome: str | None = None
    prompt_id: str | None = None


SESSION_SETTINGS = (
    "live",
    "missing",
    "goal_mode",
    "apply_delay_ms",
    "continuation_turns",
    "turn_duration_ms",
    "cancel_mode",
    "cancel_delay_ms",
    "report_delay_ms",
    "maintenance_duration_ms",
    "maintenance_outcome",
    "ignore_cancel",
    "numbered_turns",
)
