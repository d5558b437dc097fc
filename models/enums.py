"""Enumerations of the statuses and kinds the tables store (docs/lifecycles.md), as plain
string enums stored as text."""

from enum import StrEnum


class Admission(StrEnum):
    OPEN = "open"
    DRAINING = "draining"


class SyncStatus(StrEnum):
    PENDING = "pending"
    APPLYING = "applying"
    SYNCED = "synced"
    DIVERGED = "diverged"
    UNKNOWN = "unknown"
    FAILED = "failed"


class OperationStatus(StrEnum):
    PREPARED = "prepared"
    DISPATCHED = "dispatched"
    COMPLETED = "completed"
    FAILED = "failed"
    SUPERSEDED = "superseded"


OPEN_OPERATION_STATUSES = (OperationStatus.PREPARED, OperationStatus.DISPATCHED)
# The SQL condition "the goal operation is open", written out with its values: the partial
# index of open operations (ix_goal_operations_open_due) is defined by it, and a query uses
# that index only where it states the condition the same way, not through bound parameters.
OPEN_OPERATION_SQL = "status IN ({})".format(
    ", ".join(f"'{s.value}'" for s in OPEN_OPERATION_STATUSES)
)
TERMINAL_OPERATION_STATUSES = (
    OperationStatus.COMPLETED,
    OperationStatus.FAILED,
    OperationStatus.SUPERSEDED,
)


class ProviderPhase(StrEnum):
    PREPARED = "prepared"
    DISPATCHED = "dispatched"
    ACCEPTED = "accepted"
    APPLIED = "applied"
    UNKNOWN = "unknown"


class Origin(StrEnum):
    CLIENT = "client"
    FENCE = "fence"


class GoalAction(StrEnum):
    SET = "set"
    CLEAR = "clear"
    PAUSE = "pause"
    RESUME = "resume"


class FenceStatus(StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    # Delivery gave up past its budget (the fence row still forbids its generation, and every
    # resume still preloads it).
    FAILED = "failed"


class TurnPhase(StrEnum):
    SUBMITTED = "submitted"
    RUNNING = "running"
    SETTLED = "settled"


# Turn phases only move forward (docs/lifecycles.md: turns).
TURN_PHASE_ORDER = {TurnPhase.SUBMITTED: 0, TurnPhase.RUNNING: 1, TurnPhase.SETTLED: 2}


class TurnOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    INTERRUPTED = "interrupted"


class TurnOrigin(StrEnum):
    USER_PROMPT = "user_prompt"
    GOAL_CONTINUATION = "goal_continuation"
    PROVIDER_INITIATED = "provider_initiated"


class CancelStatus(StrEnum):
    PREPARED = "prepared"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"


class CancelResult(StrEnum):
    CANCELED = "canceled"
    ALREADY_SETTLED = "already_settled"
    INTERRUPTED = "interrupted"


class MaintenanceStatus(StrEnum):
    RUNNING = "running"
    CANCELLING = "cancelling"
    FINALIZING = "finalizing"
    RECOVERY_REQUIRED = "recovery_required"
    COMPLETED = "completed"
    NOOP = "noop"
    CANCELLED = "cancelled"
    PARTIALLY_COMPLETED = "partially_completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


LIVE_MAINTENANCE_STATUSES = (
    MaintenanceStatus.RUNNING,
    MaintenanceStatus.CANCELLING,
    MaintenanceStatus.FINALIZING,
    MaintenanceStatus.RECOVERY_REQUIRED,
)
TERMINAL_MAINTENANCE_STATUSES = (
    MaintenanceStatus.COMPLETED,
    MaintenanceStatus.NOOP,
    MaintenanceStatus.CANCELLED,
    MaintenanceStatus.PARTIALLY_COMPLETED,
    MaintenanceStatus.FAILED,
    MaintenanceStatus.INTERRUPTED,
)


class MaintenanceError(StrEnum):
    CANCEL_TIMEOUT = "cancel_timeout"
    WORKER_LOST = "worker_lost"
    OPERATION_PERSIST_FAILED = "operation_persist_failed"
    SUMMARY_FAILED = "summary_failed"
    CANCELLED = "cancelled"
    NO_HISTORY = "no_history"
    # The runtime's final answer could not be stored (ill-typed, out of range, NUL …).
    INVALID_RUNTIME_ANSWER = "invalid_runtime_answer"
    # The run's host reported a newer runtime epoch (it restarted) or no longer has the run.
    RUNTIME_RESTARTED = "runtime_restarted"
    # The agent host ran another turn or run when this one was to start there.
    SESSION_BUSY = "session_busy"
    # An operator resolved a run in recovery to `failed` (docs/operations.md); detail is the reason.
    OPERATOR_RESOLVED = "operator_resolved"


class PromptStatus(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    COMPLETED = "completed"
    FAILED = "failed"
