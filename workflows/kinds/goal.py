"""The goal operation kind (docs/lifecycles.md: goals): its statuses, record, task names and
declaration. Its rules are in goals/, its steps in steps/goals/."""

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy import ColumnElement, and_, or_, select

from ...models.operations import GoalOperation as GoalOperationRow
from ...models.tables import GoalState as GoalStateRow
from .base import Kind

# Public: what producers in any language publish (README.md).
GOAL_CONTROL_TASK = "agent_radar.goal_control"
# Internal: published after a commit (the rows are the outbox).
DISPATCH_TASK = "agent_radar.goal.dispatch"


class OperationStatus(StrEnum):
    PREPARED = "prepared"
    DISPATCHED = "dispatched"
    COMPLETED = "completed"
    FAILED = "failed"
    SUPERSEDED = "superseded"


# "Open": models/tables.py states it in SQL for the partial index of open operations
# (OPEN_OPERATION_SQL; tests/rules/test_kinds.py checks the two agree).
OPEN_OPERATION_STATUSES = (OperationStatus.PREPARED, OperationStatus.DISPATCHED)
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


def _prunable(cutoff: datetime) -> ColumnElement[bool]:
    return and_(
        GoalOperationRow.created_at < cutoff,  # what the index on age finds
        GoalOperationRow.status.in_(TERMINAL_OPERATION_STATUSES),
        or_(
            GoalOperationRow.completed_at < cutoff,
            and_(GoalOperationRow.completed_at.is_(None), GoalOperationRow.created_at < cutoff),
        ),
        # the operation a goal state still points at stays (its session's state, found by
        # its key: one lookup per row, however many sessions there are)
        ~select(GoalStateRow.pending_operation_id)
        .where(
            GoalStateRow.workspace_id == GoalOperationRow.workspace_id,
            GoalStateRow.session_id == GoalOperationRow.session_id,
            GoalStateRow.pending_operation_id == GoalOperationRow.operation_id,
        )
        .exists(),
    )


KIND = Kind(
    "goal",
    "goal operation",
    GoalOperationRow,
    GoalOperationRow.operation_id,
    GoalOperationRow.created_at,
    GoalOperationRow.last_error,
    GoalOperation,
    tuple(OperationStatus),
    settled=TERMINAL_OPERATION_STATUSES,
    prunable=_prunable,
    public_tasks=(GOAL_CONTROL_TASK,),
)
