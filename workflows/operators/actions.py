"""Operator actions (docs/operations.md): operations too, each audited as a session event with the
operator's reason — retry a `failed` goal operation or fence (a fresh budget, same identity),
resolve a maintenance run in `recovery_required` (to `failed` or `completed`; the hold is
released), drain and undrain a session."""

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from ...models.enums import SyncStatus
from ...models.operations import GoalFence, GoalOperation, MaintenanceRun
from ...models.tables import AgentSession, GoalState
from .. import leases
from ..errors import Conflict, InvalidArgument, NotFound
from ..fences import lifecycle
from ..goals.lifecycle import GOAL
from ..kinds.fence import FenceStatus
from ..kinds.goal import OperationStatus, ProviderPhase
from ..kinds.maintenance import MaintenanceError, MaintenanceStatus
from ..maintenance import runs
from ..sessions.rows import append_event, lock_session
from ..validation import MAX_REASON_BYTES, check_choice, check_text

OPERATOR_EVENT = "operator-action"
RESOLVE_TO = {"failed": MaintenanceStatus.FAILED, "completed": MaintenanceStatus.COMPLETED}


def check_operator_reason(value: Any) -> str:
    """An operator action says why: 1 byte to 4 KiB of text."""
    return check_text("reason", value, MAX_REASON_BYTES)


@dataclass(frozen=True)
class Done:
    """What an action changed, for the caller to publish after commit."""

    kind: str  # goal, fence, maintenance, session
    target_id: str
    workspace_id: str
    session_id: str


def audit(
    session: Session,
    row: Any,
    action: str,
    target_id: str,
    reason: str,
    now: datetime,
    **details: Any,
) -> None:
    """The action's record in the events of `row`'s session (its row is locked)."""
    event_id = str(uuid.uuid4())
    append_event(
        session,
        row.workspace_id,
        row.session_id,
        kind=OPERATOR_EVENT,
        record_id=f"operator:{event_id}",
        idempotency_key=f"operator:{action}:{target_id}:{event_id}",
        now=now,
        payload={"action": action, "target_id": target_id, "reason": reason, **details},
    )


def _owned(row: Any, workspace_id: str | None) -> bool:
    return row is not None and (workspace_id is None or row.workspace_id == workspace_id)


def retry(
    session: Session, operation_id: str, reason: str, now: datetime, workspace_id: str | None
) -> Done:
    """A `failed` goal operation or fence goes again with a fresh budget and the same id."""
    fence = session.get(GoalFence, operation_id, populate_existing=True)
    if _owned(fence, workspace_id):
        assert fence is not None
        lock_session(session, fence.workspace_id, fence.session_id)
        if fence.status != FenceStatus.FAILED:
            raise Conflict(f"fence {operation_id} is {fence.status}: only a failed one is retried")
        lifecycle.retry(session, operation_id, now)
        if fence.clear_operation_id:
            clear = session.get(GoalOperation, fence.clear_operation_id, populate_existing=True)
            if clear is not None and clear.status == OperationStatus.FAILED:
                _reopen(session, clear, now, must_be_current=False)
        return _retried(session, fence, "fence", operation_id, reason, now)
    op = session.get(GoalOperation, operation_id, populate_existing=True)
    if not _owned(op, workspace_id):
        raise NotFound(f"no goal operation or fence {operation_id}", operation_id=operation_id)
    assert op is not None
    lock_session(session, op.workspace_id, op.session_id)
    if op.status != OperationStatus.FAILED:
        raise Conflict(
            f"goal operation {operation_id} is {op.status}: only a failed one is retried"
        )
    _reopen(session, op, now, must_be_current=True)
    return _retried(session, op, "goal", operation_id, reason, now)


def _retried(
    session: Session, row: Any, kind: str, operation_id: str, reason: str, now: datetime
) -> Done:
    audit(session, row, "retry", operation_id, reason, now, target_kind=kind)
    return Done(kind, operation_id, row.workspace_id, row.session_id)


def _reopen(session: Session, op: GoalOperation, now: datetime, must_be_current: bool) -> None:
    """A failed goal operation is `prepared` again with a fresh budget, and its goal state
    points at it again — only while it is still the session's newest revision: retrying an
    older one would take the goal back."""
    state = session.get(GoalState, (op.workspace_id, op.session_id), populate_existing=True)
    if state is None or state.revision != op.goal_revision:
        if must_be_current:
            raise Conflict(
                f"goal operation {op.operation_id} is revision {op.goal_revision}; the goal "
                f"is at revision {state.revision if state else 0}: submit a new one instead"
            )
        return
    GOAL.move(
        session,
        op.operation_id,
        OperationStatus.PREPARED,
        GoalOperation.status == OperationStatus.FAILED,
        provider_phase=ProviderPhase.PREPARED,
        attempt=0,
        first_dispatched_at=None,
        accepted_at=None,
        completed_at=None,
        last_error=None,
        next_attempt_at=now,
        **leases.RELEASED,
    )
    session.execute(
        update(GoalState)
        .where(GoalState.workspace_id == op.workspace_id, GoalState.session_id == op.session_id)
        .values(
            sync_status=SyncStatus.PENDING, pending_operation_id=op.operation_id, last_error=None
        )
    )


def resolve(
    session: Session, run_id: str, to: str, reason: str, now: datetime, workspace_id: str | None
) -> Done:
    """A run in `recovery_required` ends `failed` (operator_resolved) or `completed`, with
    the reason as its detail; the session's hold is released (by the caller, after commit)."""
    status = RESOLVE_TO[check_choice("to", to, set(RESOLVE_TO))]
    run = session.get(MaintenanceRun, run_id, populate_existing=True)
    if not _owned(run, workspace_id):
        raise NotFound(f"no maintenance run {run_id}", run_id=run_id)
    assert run is not None
    lock_session(session, run.workspace_id, run.session_id)
    if run.status != MaintenanceStatus.RECOVERY_REQUIRED:
        raise Conflict(f"run {run_id} is {run.status}: only a run in recovery is resolved")
    fields: dict[str, Any] = {
        "detail": f"resolved by an operator: {reason}",
        "error_code": (
            MaintenanceError.OPERATOR_RESOLVED if status == MaintenanceStatus.FAILED else None
        ),
    }
    if not runs.transition(session, run, status, now, **fields):
        raise Conflict(f"run {run_id} changed meanwhile; look again")
    audit(
        session,
        run,
        "resolve",
        run_id,
        reason,
        now,
        target_kind="maintenance",
        to=to,
    )
    return Done("maintenance", run_id, run.workspace_id, run.session_id)


def set_admission(
    session: Session, workspace_id: str, session_id: str, admission: str, reason: str, now: datetime
) -> None:
    """Drain (`draining`: maintenance is refused with RuntimeDraining) or undrain (`open`).
    A session already so changes nothing and writes nothing (no second history record)."""
    if admission not in ("open", "draining"):
        raise InvalidArgument("admission must be open or draining", field="admission")
    if session.get(AgentSession, (workspace_id, session_id)) is None:
        # A typo must not make a session: only one the control plane knows is drained.
        raise NotFound(f"unknown session {workspace_id}/{session_id}")
    row = lock_session(session, workspace_id, session_id)
    if row.admission == admission:
        return
    before, row.admission = row.admission, admission
    action = "drain" if admission == "draining" else "undrain"
    audit(
        session,
        row,
        action,
        f"{workspace_id}/{session_id}",
        reason,
        now,
        target_kind="session",
        admission_before=before,
    )
