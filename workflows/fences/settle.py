"""A fence settled without the agent's word (docs/lifecycles.md: fences): the session was offline
or gone, so its clear completes with phase and sync `unknown` and waits to be delivered when the
session is live again (workflows/steps/restore.py), which `clear_delivered` records."""

from datetime import datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from ...models.db import rowcount
from ...models.enums import (
    OPEN_OPERATION_STATUSES,
    OperationStatus,
    ProviderPhase,
    SyncStatus,
)
from ...models.tables import GoalFence, GoalOperation, GoalState
from .. import leases, records


def settle_clear_locally(
    session: Session,
    fence_id: str,
    clear_operation_id: str,
    workspace_id: str,
    session_id: str,
    now: datetime,
) -> bool:
    """The fence's clear completes `unknown` (observed kept) and is marked undelivered; the
    goal state is `unknown`. True if the clear was still open."""
    done = session.execute(
        update(GoalOperation)
        .where(
            GoalOperation.operation_id == clear_operation_id,
            GoalOperation.status.in_(OPEN_OPERATION_STATUSES),
        )
        .values(
            status=OperationStatus.COMPLETED,
            provider_phase=ProviderPhase.UNKNOWN,
            completed_at=now,
            **leases.RELEASED,
        )
    )
    if rowcount(done) != 1:
        return False
    session.execute(
        update(GoalFence).where(GoalFence.fence_id == fence_id).values(clear_undelivered=True)
    )
    session.execute(
        update(GoalState)
        .where(
            GoalState.workspace_id == workspace_id,
            GoalState.session_id == session_id,
            GoalState.pending_operation_id == clear_operation_id,
        )
        .values(sync_status=SyncStatus.UNKNOWN, pending_operation_id=None)
    )
    return True


def clear_delivered(
    session: Session, fence_id: str, clear: records.GoalOperation, answer: dict | None
) -> None:
    """The clear reached the agent (or the agent already had something newer): the fence has
    nothing left to deliver. An applied answer is the evidence the local settlement lacked."""
    session.execute(
        update(GoalFence).where(GoalFence.fence_id == fence_id).values(clear_undelivered=False)
    )
    if answer is None or answer.get("phase") != ProviderPhase.APPLIED:
        return
    session.execute(
        update(GoalOperation)
        .where(
            GoalOperation.operation_id == clear.operation_id,
            GoalOperation.provider_phase == ProviderPhase.UNKNOWN,
        )
        .values(provider_phase=ProviderPhase.APPLIED, evidence=answer.get("evidence"))
    )
    goal = answer.get("goal")
    session.execute(
        update(GoalState)
        .where(
            GoalState.workspace_id == clear.workspace_id,
            GoalState.session_id == clear.session_id,
            GoalState.revision == clear.goal_revision,
            GoalState.pending_operation_id.is_(None),
        )
        .values(
            observed=goal,
            sync_status=SyncStatus.SYNCED if goal is None else SyncStatus.DIVERGED,
        )
    )
