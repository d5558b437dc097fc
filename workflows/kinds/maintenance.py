"""The maintenance run kind (docs/lifecycles.md: maintenance): its statuses, record, task
names and declaration. Its rules are `maintenance/runs.py`, its steps `steps/maintenance.py`
and `steps/maintenance_sweep.py`."""

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from ...models.operations import MaintenanceRun as MaintenanceRunRow
from .base import Kind, settled_before

START_MAINTENANCE_TASK = "agent_radar.start_maintenance"  # public
CANCEL_MAINTENANCE_TASK = "agent_radar.cancel_maintenance"  # public
EXECUTE_TASK = "agent_radar.maintenance.execute"


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


@dataclass(frozen=True)
class MaintenanceRun:
    run_id: str
    workspace_id: str
    session_id: str
    client_submit_id: str
    kind: str
    args: dict | None
    status: str
    error_code: str | None
    detail: str | None
    revision: int
    runtime_epoch: int
    applied: bool | None
    input_tokens: int | None
    result_tokens: int | None
    summary: str | None
    cancel_requested_at: datetime | None
    lease_owner: str | None
    lease_token: str | None
    lease_expires_at: datetime | None
    started_at: datetime
    finished_at: datetime | None

    @property
    def settled(self) -> bool:
        return self.status in TERMINAL_MAINTENANCE_STATUSES


KIND = Kind(
    "maintenance",
    "maintenance run",
    MaintenanceRunRow,
    MaintenanceRunRow.run_id,
    MaintenanceRunRow.started_at,
    MaintenanceRunRow.detail,
    MaintenanceRun,
    tuple(MaintenanceStatus),
    settled=TERMINAL_MAINTENANCE_STATUSES,
    prunable=settled_before(
        MaintenanceRunRow,
        TERMINAL_MAINTENANCE_STATUSES,
        MaintenanceRunRow.started_at,
        MaintenanceRunRow.finished_at,
    ),
    public_tasks=(START_MAINTENANCE_TASK, CANCEL_MAINTENANCE_TASK),
)
