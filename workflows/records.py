"""Frozen records returned by the client (docs/packaging.md); their fields are the columns of
the tables (models/tables.py)."""

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from ..models.enums import (
    TERMINAL_MAINTENANCE_STATUSES,
    TERMINAL_OPERATION_STATUSES,
    FenceStatus,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")


def from_row(cls: type[R], row: Any, **extra: Any) -> R:
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(cls) if f.name not in extra}
    return cls(**values, **extra)


def record_of(record_type: type[R], row: Any) -> R:
    """A row as its record: through the record's own `from_row` where it has one (derived
    fields), else field by field."""
    own = getattr(record_type, "from_row", None)
    return own(row) if own is not None else from_row(record_type, row)


def as_dict(record: Any) -> dict[str, Any]:
    def convert(value):
        return value.isoformat() if isinstance(value, datetime) else value

    return {k: convert(v) for k, v in dataclasses.asdict(record).items()}


@dataclass(frozen=True)
class GoalOperation:
    operation_id: str
    workspace_id: str
    session_id: str
    client_submit_id: str
    origin: str
    action: str
    objective: str | None
    goal_revision: int
    status: str
    provider_phase: str
    evidence: dict | None
    last_error: str | None
    attempt: int
    lease_owner: str | None
    lease_token: str | None
    lease_expires_at: datetime | None
    next_attempt_at: datetime | None
    first_dispatched_at: datetime | None
    accepted_at: datetime | None
    completed_at: datetime | None
    created_at: datetime

    @property
    def settled(self) -> bool:
        return self.status in TERMINAL_OPERATION_STATUSES


@dataclass(frozen=True)
class GoalState:
    workspace_id: str
    session_id: str
    revision: int
    desired: dict | None
    observed: dict | None
    tombstoned: bool
    sync_status: str
    pending_operation_id: str | None
    last_error: str | None


@dataclass(frozen=True)
class SessionInfo:
    workspace_id: str
    session_id: str
    provider: str | None
    provider_session_id: str | None
    live: bool | None
    runtime_epoch: int
    host_id: str
    admission: str
    active_turn_id: str | None
    last_report_at: datetime | None


@dataclass(frozen=True)
class Host:
    """A registered agent host (docs/lifecycles.md: sessions) and how many sessions are bound to
    it."""

    host_id: str
    url: str
    sessions: int = 0


@dataclass(frozen=True)
class Fence:
    fence_id: str
    workspace_id: str
    session_id: str
    target_operation_id: str
    target_revision: int
    client_submit_id: str
    reason: str
    status: str
    clear_operation_id: str | None
    cancel_operation_id: str | None
    attempt: int
    lease_owner: str | None
    lease_token: str | None
    lease_expires_at: datetime | None
    next_attempt_at: datetime | None
    last_error: str | None
    completed_at: datetime | None
    created_at: datetime
    # A stored fence is accepted: it forbids its generation from now on, whatever happens
    # to its delivery.
    intent_accepted: bool = True
    settled: bool = False

    @classmethod
    def from_row(cls, row) -> "Fence":
        settled = row.status in (FenceStatus.COMPLETED, FenceStatus.FAILED)
        return from_row(cls, row, intent_accepted=True, settled=settled)


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


@dataclass(frozen=True)
class HistoryRow:
    """One row per record (record_id) at the position of its first event, holding its
    latest revision; a record that is not terminal yet shows as pending."""

    sequence: int
    kind: str
    record_id: str
    revision: int | None
    payload: dict | None
    pending: bool
    created_at: datetime


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    workspace_id: str
    session_id: str
    client_submit_id: str
    text: str
    status: str
    position: int
    turn_id: str | None
    created_at: datetime
    dispatched_at: datetime | None
    attempt: int = 0  # failed sends (budgets.py); an offline session's wait uses none
    last_error: str | None = None

    @property
    def settled(self) -> bool:
        return self.status in ("completed", "failed")


@dataclass(frozen=True)
class SessionStop:
    """`stop_session`'s record: `status` is `stopping` until the turn and the maintenance run
    it named have ended, then `completed` (`settled`)."""

    stop_id: str
    workspace_id: str
    session_id: str
    client_submit_id: str
    reason: str
    turn_id: str | None
    cancel_operation_id: str | None
    run_id: str | None
    created_at: datetime
    status: str = "stopping"
    settled: bool = False


@dataclass(frozen=True)
class TurnCancel:
    """A durable turn cancel (docs/lifecycles.md: cancels): made by a fence, a stop or the
    stale-cancel sweep."""

    operation_id: str
    workspace_id: str
    session_id: str
    turn_id: str
    reason: str
    status: str
    result: str | None
    attempt: int
    next_attempt_at: datetime | None
    last_error: str | None
    completed_at: datetime | None
    created_at: datetime

    @property
    def settled(self) -> bool:
        return self.status in ("completed", "failed")


@dataclass(frozen=True)
class OperationSummary:
    """One line of `op list` (docs/operations.md): any kind of operation."""

    kind: str  # goal, fence, cancel, maintenance, prompt, stop
    id: str
    workspace_id: str
    session_id: str
    client_submit_id: str | None
    status: str
    created_at: datetime
    last_error: str | None
