"""A simulated session's settings, set through `/sim/` (how its agent behaves and what its
host gets wrong), and SimError, the error answer a call gets. What the session holds — its
goal, revision, fences, epoch, turns and runs — is the host kit's (host/sessions.py)."""

from dataclasses import dataclass

from ...host.server import HostError

# The error answer a call gets: the host kit's (host/server.py).
SimError = HostError


@dataclass
class SimSettings:
    missing: bool = False  # every call answers 404 session_not_found
    goal_mode: str = "applied"  # or "accepted": acknowledge now, apply after apply_delay_ms
    apply_delay_ms: int = 100
    # Goal continuation turns: started when a goal is set, settled after turn_duration_ms
    # (0: never on its own) or on cancel. cancel_mode: "immediate" settles at once,
    # "accepted" settles after cancel_delay_ms and reports it, "ignore" never settles.
    continuation_turns: bool = True
    turn_duration_ms: int = 200
    cancel_mode: str = "immediate"
    cancel_delay_ms: int = 100
    # How long a turn's start is in flight before its report goes out (a late report).
    report_delay_ms: int = 0
    # Maintenance: runs finish after maintenance_duration_ms with maintenance_outcome
    # ("applied", "noop", "cancelled" or "error:<text>"); ignore_cancel makes cancels do
    # nothing.
    maintenance_duration_ms: int = 300
    maintenance_outcome: str = "applied"
    ignore_cancel: bool = False
    # Turn ids numbered per process (turn-1, turn-2, … again after a restart) instead of
    # unique for good: a host that gives an id again.
    numbered_turns: bool = False
    turn_number: int = 0  # the last one given, with numbered_turns


# What `/sim/sessions/{ws}/{sid}` and `/sim/defaults` set: `live` is the session's own.
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
