"""The product's error classes (docs/packaging.md): one base, one class per condition.

Each error has a stable `code` and structured attributes, and survives a round trip through
pickle or JSON (`to_dict` / `from_dict`), so it can cross a Celery boundary.
"""

from datetime import datetime
from typing import Any


class AgentRadarError(Exception):
    code = "agent_radar_error"

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.message = message
        self.attrs = attrs
        for key, value in attrs.items():
            setattr(self, key, value)

    def __reduce__(self):
        return (_restore, (self.__class__.__name__, self.message, self.attrs))

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": self.code,
            "type": self.__class__.__name__,
            "message": self.message,
            **self.attrs,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "AgentRadarError":
        attrs = {k: v for k, v in data.items() if k not in ("error", "type", "message")}
        return _restore(data["type"], data["message"], attrs)


class InvalidArgument(AgentRadarError):
    code = "invalid_argument"


class NotFound(AgentRadarError):
    code = "not_found"


class Conflict(AgentRadarError):
    code = "conflict"


class GoalOperationConflict(Conflict):
    code = "goal_operation_conflict"


class FenceConflict(Conflict):
    code = "fence_conflict"


class MaintenanceConflict(Conflict):
    code = "maintenance_conflict"


class PromptConflict(Conflict):
    code = "prompt_conflict"


class CancelConflict(Conflict):
    code = "cancel_conflict"


class GoalGenerationSuperseded(AgentRadarError):
    code = "goal_generation_superseded"


class GoalStateAbsent(AgentRadarError):
    code = "goal_state_absent"


class MaintenanceBusy(AgentRadarError):
    code = "maintenance_busy"


class MaintenanceRecoveryRequired(AgentRadarError):
    code = "maintenance_recovery_required"


class DatabaseNotReady(AgentRadarError):
    """The database has no agent-radar tables (or not all of them): it was never migrated,
    or the URL names another database. `agent-radar db upgrade` migrates it."""

    code = "database_not_ready"


class RuntimeDraining(AgentRadarError):
    code = "runtime_draining"


class SessionBusy(AgentRadarError):
    code = "session_busy"


class RuntimeDisconnected(AgentRadarError):
    """The agent host reports the session offline (HTTP 409 `disconnected`)."""

    code = "disconnected"
    # When the call that met it was asked, and the host that answered (the adapter sets them):
    # what it says of the session is that old, and of that host (workflows/sessions/rows.py).
    asked_at: datetime | None = None
    answered_by: str | None = None


class RuntimeFault(AgentRadarError):
    """Any other runtime answer that is not a success; `retryable` says whether to retry."""

    code = "runtime_fault"
    # Set per instance from the constructor's attributes; declared for readers and mypy.
    retryable: bool = False
    http_status: int | None = None
    asked_at: datetime | None = None  # as RuntimeDisconnected's
    answered_by: str | None = None


class WaitTimedOut(AgentRadarError, TimeoutError):
    """`wait` ran out before the record settled: nothing failed, the operation goes on. A
    TimeoutError too."""

    code = "timeout"


def _restore(type_name: str, message: str, attrs: dict[str, Any]) -> AgentRadarError:
    cls = _BY_NAME.get(type_name, AgentRadarError)
    return cls(message, **attrs)


_BY_NAME = {
    c.__name__: c
    for c in (
        AgentRadarError,
        InvalidArgument,
        NotFound,
        Conflict,
        GoalOperationConflict,
        FenceConflict,
        MaintenanceConflict,
        PromptConflict,
        CancelConflict,
        GoalGenerationSuperseded,
        GoalStateAbsent,
        MaintenanceBusy,
        MaintenanceRecoveryRequired,
        RuntimeDraining,
        SessionBusy,
        RuntimeDisconnected,
        RuntimeFault,
        WaitTimedOut,
    )
}
